"""On the device: rebuild the partial target checkpoint (fp32 embedding dequantized with the gguf library)."""
import sys
from pathlib import Path
import numpy as np, torch, gguf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
d = Path(sys.argv[1])
with safe_open(str(d / "embed_q8_0.safetensors"), "pt") as f:
    raw, qtype = f.get_tensor("q8_0").numpy(), int(f.metadata()["type"])
emb = np.array(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)), dtype=np.float32)
tensors = load_file(str(d / "layers.safetensors"))
tensors["model.embed_tokens.weight"] = torch.from_numpy(emb.reshape(-1, 576)).contiguous()
save_file(tensors, str(d / "model.safetensors"))
print("partial target", {k: tuple(v.shape) for k, v in list(tensors.items())[:3]}, emb.shape)
