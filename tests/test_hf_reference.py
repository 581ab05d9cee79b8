"""Our transformer is the same function as Hugging Face transformers' on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
import transformers

from common.distributed import init_tp
from common.kv_cache import KVCache
from common.loader import load_model
from common.models.generate import forward_rows, greedy_generate
from tests.tiny import make_tiny_model

ARCHS = {
    "qwen3": dict(architecture="Qwen3ForCausalLM"),
    "qwen2-bias": dict(architecture="Qwen2ForCausalLM"),
    "llama3-untied-rope-scaling": dict(
        architecture="LlamaForCausalLM",
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, arch):
    path = make_tiny_model(tmp_path / arch, seed=5, num_layers=2, **ARCHS[arch])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    ours = load_model(path, init_tp(1, 0))
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
        cache = KVCache.for_model(ours, 1, len(prompt) + 1)
        got = ours.compute_logits(forward_rows(ours, cache, [0], [0], [prompt])[0])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        assert greedy_generate(ours, [prompt], 24)[0] == hf_tokens
