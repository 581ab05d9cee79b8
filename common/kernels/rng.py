"""Counter-based random numbers, bit-identical in PyTorch and Triton.

Every random draw in speculative decoding is a pure function of
``(seed, position, stream, index)``:

- ``seed``: the request's int64 seed;
- ``position``: the absolute token position the draw decides (so a seed gives the same
  output whatever else is in the batch, and however the work is split into rounds);
- ``stream``: which decision the draw is for. The draft side and the three target-side
  decisions use different streams, so their noise never shares a key;
- ``index``: the vocabulary id (Gumbel noise per token) or 0 (a single uniform).

The construction is two 32-bit lanes of a per-row key (murmur3 ``fmix32`` chains over the
seed words, the position words and the stream), then two ``fmix32`` per element. For a
fixed ``(seed, position)`` the last step of each lane is a bijection of the stream, so the
four streams always get different keys; distinct rows share both lanes with probability
2**-64. Element noise is cheap on purpose (4 multiplies): the verification kernel draws one
Gumbel variate per vocabulary entry and must stay memory bound.

The torch version works in int64 holding uint32 values; multiplication mod 2**32 is split in
16-bit halves so no intermediate overflows int64.
"""

import torch
import triton
import triton.language as tl

STREAM_DRAFT = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2
STREAM_BONUS = 3

_M32 = 0xFFFFFFFF
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9
_LANE2 = 0x7F4A7C15
_STREAM_MUL = 0x27D4EB2F
# 24 random bits -> a float32 in (0, 1) exactly, the same in both implementations.
_INV_2_24 = 1.0 / 16777216.0


# ---------------------------------------------------------------- torch (int64 holding uint32)


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for a uint32 held in int64, without int64 overflow."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor, stream: int | torch.Tensor):
    """Two uint32 lanes (as int64 tensors) keyed on (seed, position, stream); broadcasts."""
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    s_lo, s_hi = seed & _M32, (seed >> 32) & _M32
    p_lo, p_hi = position & _M32, (position >> 32) & _M32
    h = _fmix32(s_lo ^ _GOLDEN)
    h = _fmix32(h ^ s_hi)
    h = _fmix32(h ^ p_lo)
    h = _fmix32(h ^ p_hi)
    # A Python int stream stays on the host: no host-to-device copy inside a CUDA graph.
    if isinstance(stream, int):
        stream_word = ((stream + 1) * _STREAM_MUL) & _M32
    else:
        stream_word = _mul32(stream.to(torch.int64) + 1, _STREAM_MUL)
    k1 = _fmix32(h ^ stream_word)
    k2 = _fmix32(k1 ^ _LANE2)
    return k1, k2


def element_bits(k1: torch.Tensor, k2: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """32 random bits per (row key, index); uint32 in int64."""
    x = _fmix32(k1 ^ _mul32(index.to(torch.int64) & _M32, _GOLDEN))
    return _fmix32((x + k2) & _M32)


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """Top 24 bits -> float32 in (0, 1), never 0 or 1 (so log and log(-log) are finite)."""
    return ((bits >> 8).to(torch.float32) + 0.5) * _INV_2_24


def uniform(seed, position, stream, index) -> torch.Tensor:
    """Reference uniform(0, 1) for the key (seed, position, stream, index)."""
    k1, k2 = row_keys(seed, position, stream)
    return bits_to_uniform(element_bits(k1, k2, torch.as_tensor(index, device=k1.device)))


def gumbel(seed, position, stream, index) -> torch.Tensor:
    """Reference standard Gumbel noise -log(-log(u)) for the same keys."""
    return -torch.log(-torch.log(uniform(seed, position, stream, index)))


# ---------------------------------------------------------------- triton (uint32)


# fmix32 is written out inside static loops rather than called: every nested @triton.jit call
# costs a lot under TRITON_INTERPRET=1, and the loops keep the chain identical to the torch one.


@triton.jit
def tl_row_keys(seed, position, stream):
    """Triton twin of row_keys: seed, position int64; stream an int32 tensor."""
    words_s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    words_p_lo = (position & 0xFFFFFFFF).to(tl.uint32)
    words_p_hi = ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = (seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9
    k1 = h
    for step in tl.static_range(6):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        h = h ^ (h >> 16)
        if step == 0:
            h = h ^ words_s_hi
        elif step == 1:
            h = h ^ words_p_lo
        elif step == 2:
            h = h ^ words_p_hi
        elif step == 3:
            h = h ^ ((stream + 1).to(tl.uint32) * 0x27D4EB2F)
        elif step == 4:
            k1 = h
            h = h ^ 0x7F4A7C15
    return k1, h


@triton.jit
def tl_uniform(k1, k2, index):
    """Triton twin of element_bits + bits_to_uniform; index int32/int64 >= 0."""
    x = k1 ^ (index.to(tl.uint32) * 0x9E3779B9)
    for step in tl.static_range(2):
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        x = x ^ (x >> 16)
        if step == 0:
            x = x + k2
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def tl_gumbel(k1, k2, index):
    """-log(-log(u)) with u = tl_uniform(k1, k2, index) (inlined for the interpreter's sake)."""
    x = k1 ^ (index.to(tl.uint32) * 0x9E3779B9)
    for step in tl.static_range(2):
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        x = x ^ (x >> 16)
        if step == 0:
            x = x + k2
    return -tl.log(-tl.log(((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)))
