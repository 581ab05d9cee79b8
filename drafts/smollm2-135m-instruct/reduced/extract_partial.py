"""Packs what a draft starts from (target layers 0-1, final norm, raw Q8_0 embedding) small enough to carry."""
import json, sys, numpy as np, torch
from pathlib import Path
from safetensors.torch import save_file
from common.gguf import open_gguf
from common.training.draft import config_to_dict
g = open_gguf(Path(sys.argv[1])); out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
cfg = config_to_dict(g.config); cfg["num_hidden_layers"] = 2
(out / "config.json").write_text(json.dumps(cfg, indent=2))
tensors = {}
for name in ["model.norm.weight"] + [n for n in [f"model.layers.{i}.{p}" for i in (0, 1) for p in (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]]:
    tensors[name] = g.get_slice(name)[:].contiguous()
save_file(tensors, str(out / "layers.safetensors"))
t = g.tensors["token_embd.weight"]
print(t.tensor_type, t.data.shape, t.data.dtype)
save_file({"q8_0": torch.from_numpy(np.array(t.data))}, str(out / "embed_q8_0.safetensors"), metadata={"type": str(int(t.tensor_type))})
