"""StaticStep: padded static-shape steps (CUDA graphs on the GPU, the same padding eagerly on the CPU)
give the unpadded forward's results and never touch KV slots outside the call."""

from __future__ import annotations

import pytest
import torch

from common.batch import pack
from common.cuda_graphs import StaticStep, buckets
from common.distributed import init_tp
from common.kv_cache import KVCache
from common.loader import load_model
from tests.tiny import make_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_buckets():
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(3000, 256) == [256, 512, 1024, 2048, 3000]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("graphs") / "m", seed=3, num_layers=2)
    return load_model(path, init_tp(1, 0), device=DEVICE)


@torch.inference_mode()
def test_padded_steps_match_eager_and_leave_other_slots_alone(model):
    max_batch, max_len, scratch = 8, 128, 8
    eager_cache = KVCache.for_model(model, max_batch + 1, max_len)
    static_cache = KVCache.for_model(model, max_batch + 1, max_len)

    def logits(cache):
        def fn(ids, pos, slots, ctx):
            hidden = model(ids, pos, slots, cache, ctx)
            return model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))

        return fn

    step = StaticStep(logits(static_cache), max_batch, max_len, scratch, DEVICE, use_graphs=True, min_ctx=32)
    gen = torch.Generator().manual_seed(0)
    lengths = [0] * max_batch
    previous = None
    for round_ in range(6):
        # Slots in use change from call to call (5 rows, then 3, ...): a padded row must never write
        # into a real slot left over from a bigger earlier call.
        slots = [s for s in range(max_batch) if (s + round_) % 3 != 0][: 5 - round_ % 3]
        width = 1 + round_ % 3
        rows = [torch.randint(0, 512, (width,), generator=gen).tolist() for _ in slots]
        batch = pack(rows, [lengths[s] for s in slots], slots, DEVICE, max_len, width=width)
        want = logits(eager_cache)(batch.input_ids, batch.positions, batch.slots, batch.ctx_len)
        got = step(batch.input_ids, batch.positions, batch.slots, batch.ctx_len)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if previous is not None:  # an output must survive the next replay (it is a copy)
            torch.testing.assert_close(previous[0], previous[1], rtol=0, atol=0)
        previous = (got, got.clone())
        for s in slots:
            lengths[s] += width
        for s in range(max_batch):  # every real slot's valid KV agrees with the eager cache
            n = lengths[s]
            for layer in range(len(eager_cache.k)):
                torch.testing.assert_close(static_cache.k[layer][s, :n], eager_cache.k[layer][s, :n])
                torch.testing.assert_close(static_cache.v[layer][s, :n], eager_cache.v[layer][s, :n])
    if DEVICE.type == "cuda":
        assert step.graphs, "graphs were captured"
