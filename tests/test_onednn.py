"""CPU linear layers through oneDNN packed weights (common/kernels/onednn.py): the same function as
F.linear, never a stale weight, and what the loader packs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.distributed import Comm
from common.kernels import onednn
from common.kernels.skinny import linear
from common.kv_cache import KVCache
from common.layers.linear import LINEAR_LAYERS
from common.loader import load_model
from common.models.generate import forward_rows
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (8192, 576), (100, 64)])
def test_packed_linear_is_f_linear(shape, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(shape, generator=gen), torch.randn(shape[0], generator=gen)
    x = torch.randn(1, rows, shape[1], generator=gen)
    onednn.pack(weight)
    with torch.inference_mode():
        got = onednn.linear(x, weight, bias)
        assert got is not None and got.shape == (1, rows, shape[0])
        # fp32 sums of K products in another order: within a few ulps of |x| |w| K
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=2e-4)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=2e-4)


def test_a_weight_changed_in_place_is_never_served_stale():
    weight = torch.randn(64, 32)
    x = torch.randn(3, 32)
    onednn.pack(weight)
    assert onednn.linear(x, weight) is not None
    weight.mul_(2.0)  # an optimizer step: the version counter moves on
    assert onednn.linear(x, weight) is None
    torch.testing.assert_close(linear(x, weight), x @ weight.T)


def test_a_prefill_of_many_rows_stays_on_f_linear():
    weight = torch.randn(64, 32)
    onednn.pack(weight)
    assert onednn.linear(torch.randn(1, onednn.MAX_ROWS, 32), weight) is not None
    assert onednn.linear(torch.randn(1, onednn.MAX_ROWS + 1, 32), weight) is None


def test_a_call_that_needs_a_gradient_falls_back():
    weight = torch.randn(64, 32)
    onednn.pack(weight)
    x = torch.randn(3, 32, requires_grad=True)
    assert onednn.linear(x, weight) is None
    linear(x, weight).sum().backward()  # F.linear: the gradient flows
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, 32))


def test_only_fp32_cpu_matrices_are_packed():
    for t in (torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8), torch.randn(2, 8, 4)):
        onednn.pack(t)
        assert not hasattr(t, "onednn")


def test_the_loader_packs_every_linear_and_the_lm_head_but_not_the_embedding(tmp_path):
    path = make_tiny_model(tmp_path / "m", seed=3, num_layers=2, tie_word_embeddings=False)
    model = load_model(path, Comm())
    linears = [m for m in model.modules() if isinstance(m, LINEAR_LAYERS)]
    assert linears and all(hasattr(m.weight, "onednn") for m in linears)
    assert hasattr(model.lm_head.weight, "onednn")
    assert not hasattr(model.model.embed_tokens.weight, "onednn")
    # a prompt of MAX_ROWS tokens: its forward is a packed call throughout
    prompt = torch.randint(0, 256, (onednn.MAX_ROWS,), generator=torch.Generator().manual_seed(0)).tolist()

    def logits():
        cache = KVCache.for_model(model, 1, len(prompt))
        return model.compute_logits(forward_rows(model, cache, [0], [0], [prompt])[0])

    with torch.inference_mode():
        packed = logits()
        for m in [*linears, model.lm_head]:
            del m.weight.onednn
        torch.testing.assert_close(packed, logits(), rtol=1e-5, atol=1e-5)
