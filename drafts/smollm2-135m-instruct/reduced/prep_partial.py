"""On the device: rebuilds the partial target checkpoint (embedding dequantized with the gguf library).

python prep_partial.py PARTIAL_DIR   # writes PARTIAL_DIR/model.safetensors
"""

import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def main() -> None:
    d = Path(sys.argv[1])
    with safe_open(str(d / "embed_q8_0.safetensors"), "pt") as f:
        raw, qtype = f.get_tensor("q8_0").numpy(), int(f.metadata()["type"])
    embed = np.array(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)), dtype=np.float32)
    tensors = load_file(str(d / "layers.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["model.embed_tokens.weight"] = torch.from_numpy(embed.reshape(-1, hidden)).contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    print("partial target:", len(tensors), "tensors, embedding", tuple(embed.reshape(-1, hidden).shape))


if __name__ == "__main__":
    main()
