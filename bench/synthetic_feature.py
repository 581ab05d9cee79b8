"""A random target of real shapes and a random feature draft for it: timing without the real weights.

    python bench/synthetic_feature.py OUT --preset smollm2 [--dtype bfloat16]
      -> OUT/target (config.json, model.safetensors, a byte-level tokenizer) and OUT/draft (a feature draft
         reading the default layers, its shared embedding and head read from OUT/target)

What a speculative step costs does not depend on the weights: with a fixed policy the draft proposes k
tokens every step whether or not they are accepted, so a serving run of the pair times the draft's rounds
and the wider verify as a trained pair would (`bench/device.sh profile-feature`). Acceptance is about
zero, so the verify emits one token a step: the run measures cost, not speedup.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.distributed import Comm
from common.loader import load_model
from common.models.feature_draft import default_feature_layers
from common.tiny import make_tiny_model
from common.training.draft import save_draft
from common.training.feature_train import build_feature_draft

PRESETS = {
    # SmolLM2-135M-Instruct: Llama, tied embeddings.
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    intermediate_size=1536, architecture="LlamaForCausalLM",
                    config=dict(head_dim=64, rope_theta=100000.0)),
    # Qwen2.5-Coder-1.5B-Instruct: Qwen2, separate LM head.
    "qwen1.5b": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                     intermediate_size=8960, architecture="Qwen2ForCausalLM", tie_word_embeddings=False,
                     config=dict(head_dim=128, rope_theta=1000000.0)),
    # For trying the tools on a CPU.
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, architecture="LlamaForCausalLM"),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output folder (target/ and draft/ inside)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--markov-rank", type=int, default=32)
    a = ap.parse_args(argv)
    target = make_tiny_model(a.out / "target", seed=0, dtype=a.dtype, max_position_embeddings=4096,
                             **PRESETS[a.preset])  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(target, Comm(), device=device, dtype=torch.float32)
    layers = default_feature_layers(model.config.num_hidden_layers)
    draft = build_feature_draft(model, layers, a.markov_rank, seed=0, device=device)
    save_draft(draft, a.out / "draft", str(target.resolve()), a.dtype, False, {"synthetic": a.preset})
    print(f"{a.out}: target {a.preset} ({a.dtype}), feature draft over layers {list(layers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
