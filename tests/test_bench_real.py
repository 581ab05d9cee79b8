"""bench/bench_real.py's divergence margins: the top logits at a divergence, against transformers."""

from __future__ import annotations

from argparse import Namespace

import torch
import transformers

from bench.bench_real import margins
from common.distributed import init_tp
from common.loader import load_model
from common.models.generate import greedy_generate
from common.tiny import make_tiny_model


def test_margins_report_the_top_logits_at_a_divergence(tmp_path):
    path = make_tiny_model(tmp_path / "target", seed=7, architecture="Qwen2ForCausalLM")
    prompt = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    reference = greedy_generate(load_model(path, init_tp(1, 0)), [prompt], 6)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    position = 4
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + reference[:position]])).logits[0, -1]
    want = logits.topk(3)
    runner_up = int(want.indices[1])
    found = [
        {
            "prompt": 0,
            "position": position,
            "service_token": runner_up,
            "reference_token": reference[position],
        }
    ]
    args = Namespace(target=path, device="cpu", dtype="float32", reference_dtype="float32", top=3)

    [row] = margins(args, [tuple(prompt)], [reference], found)

    assert row["prompt"] == 0 and row["position"] == position
    assert row["float32"]["top2_ids"] == want.indices[:2].tolist()
    assert row["float32"]["top2_ids"][0] == reference[position]
    assert [t for t, _ in row["float32"]["top"]] == want.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([v for _, v in row["float32"]["top"]]), want.values, rtol=1e-4, atol=1e-4
    )
    gap = float(want.values[0] - want.values[1])
    assert abs(row["float32"]["top2_gap"] - gap) < 1e-4
    assert row["pair_is_top2"]
