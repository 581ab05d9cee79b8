"""Packs what a draft starts from small enough to carry to a device call: the target's layers 0-1 and
final norm (fp32, dequantized) and its embedding as the GGUF's raw Q8_0 blocks (exact; 30 MB).

    python extract_partial.py TARGET.gguf OUT_DIR
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from common.gguf import open_gguf
from common.training.draft import config_to_dict

LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)  # fmt: skip


def main() -> None:
    gguf_file, out = open_gguf(Path(sys.argv[1])), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_to_dict(gguf_file.config)
    cfg["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    names = ["model.norm.weight"] + [f"model.layers.{i}.{p}" for i in (0, 1) for p in LAYER_TENSORS]
    save_file({n: gguf_file.get_slice(n)[:].contiguous() for n in names}, str(out / "layers.safetensors"))
    embed = gguf_file.tensors["token_embd.weight"]
    raw = torch.from_numpy(np.array(embed.data))
    save_file({"q8_0": raw}, str(out / "embed_q8_0.safetensors"), {"type": str(int(embed.tensor_type))})


if __name__ == "__main__":
    main()
