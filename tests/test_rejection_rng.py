"""Counter-based RNG: bit-identical torch and Triton, separated streams, uniform output."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import scipy.stats
import triton
import triton.language as tl

from common.kernels import rng

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, stream_ptr, out_ptr, N: tl.constexpr):
    r = tl.program_id(0)
    k1, k2 = rng.tl_row_keys(tl.load(seed_ptr + r), tl.load(pos_ptr + r), tl.load(stream_ptr + r))
    idx = tl.arange(0, N)
    tl.store(out_ptr + r * N + idx, rng.tl_uniform(k1, k2, idx))


def test_triton_and_torch_give_identical_bits():
    g = torch.Generator().manual_seed(0)
    rows, n = 24, 256
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, dtype=torch.int64)
    seeds[:3] = torch.tensor([0, -1, 2**63 - 1])
    positions = torch.randint(0, 2**40, (rows,), generator=g)
    positions[:2] = torch.tensor([0, 2**33 + 5])
    streams = torch.arange(rows, dtype=torch.int32) % 4
    out = torch.empty(rows, n, device=DEVICE)
    args = [t.to(DEVICE) for t in (seeds, positions, streams)]
    _uniform_kernel[(rows,)](*args, out, N=n)
    ref = rng.uniform(seeds[:, None], positions[:, None], streams[:, None].long(), torch.arange(n)[None])
    assert torch.equal(out.cpu(), ref)


def test_streams_positions_and_seeds_give_unrelated_noise():
    index = torch.arange(4096)
    base = rng.uniform(torch.tensor(7), torch.tensor(100), rng.STREAM_ACCEPT, index)
    for other in (
        rng.uniform(torch.tensor(7), torch.tensor(100), rng.STREAM_DRAFT, index),
        rng.uniform(torch.tensor(7), torch.tensor(101), rng.STREAM_ACCEPT, index),
        rng.uniform(torch.tensor(8), torch.tensor(100), rng.STREAM_ACCEPT, index),
    ):
        # Pearson correlation of independent uniforms over 4096 draws: |r| < 5 / sqrt(4096).
        r = torch.corrcoef(torch.stack([base, other]))[0, 1]
        assert abs(r) < 5 / 64
        assert (base == other).float().mean() < 0.01


def test_uniform_and_gumbel_have_the_right_distribution():
    seeds = torch.arange(200)[:, None]
    u = rng.uniform(seeds, torch.tensor(3), rng.STREAM_RESIDUAL, torch.arange(500)[None]).flatten()
    assert 0 < u.min() and u.max() < 1
    assert scipy.stats.kstest(u.numpy(), "uniform").pvalue > 1e-4
    g = rng.gumbel(seeds, torch.tensor(3), rng.STREAM_BONUS, torch.arange(500)[None]).flatten()
    assert scipy.stats.kstest(g.numpy(), "gumbel_r").pvalue > 1e-4
