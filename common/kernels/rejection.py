"""Triton kernels that verify draft tokens: greedy and sampled requests in one launch.

Algorithm (docs/kernels.md has the long form; rejection_ref.py is the readable reference).
Four launches, each shape a function of (B, max_k, V) only, no host synchronisation, no torch
ops between them (``verify`` can be captured in a CUDA graph):

1. ``_row_stats_kernel``, grid (rows, vocab chunks): the one bandwidth-bound read of the logits.
   Per chunk: first-max argmax of the raw logits, per-lane online (max, sum-exp) of x = L / T
   (one exp per element, no cross-lane reduction inside the loop) and a NaN / +inf flag. No
   random numbers here.
2. ``_decide_kernel``, grid (requests,): merges the chunk partials of all k_b + 1 rows at once,
   computes p(d_i) = exp(x[d_i] - lse_i), makes every accept decision in parallel (ACCEPT stream),
   finds the first rejection a, writes the outputs with a provisional token in slot a, and marks
   the ONE row per request that needs a sample (residual of row a, or the bonus row).
3. ``_sample_kernel``, grid (requests, vocab chunks): Gumbel-max over that single row, skipping
   the draft set (one-hot / sparse) or with the dense residual log1p(-q/p). Extra read: 1/(k+1)
   of the logits; Gumbel variates: one row per request instead of k + 1.
4. ``_finish_kernel``, grid (requests,): merges the sample partials, fixes up the K sparse
   draft-set ids, and writes the sampled token (an empty residual keeps the provisional token).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from common.kernels import rng
from common.kernels.sampling import apply_top_k_top_p

Q_ONE_HOT = 0
Q_SPARSE = 1
Q_DENSE = 2


@dataclass
class VerifyResult:
    output_tokens: Tensor  # [B, max_k + 1] int32, -1 in unused slots
    num_accepted: Tensor  # [B] int32
    num_emitted: Tensor  # [B] int32 (= num_accepted + 1)


def verify(
    target_logits: Tensor,  # [B * (max_k + 1), V] fp32 / bf16; row b*(max_k+1)+i = request b, position i
    draft_token_ids: Tensor,  # [B, max_k] int64 target vocab ids (padding arbitrary)
    num_draft_tokens: Tensor,  # [B] int32, k_b in [0, max_k]
    temperature: Tensor,  # [B] fp32, <= 0 means greedy
    seeds: Tensor,  # [B] int64
    positions: Tensor,  # [B] int64: committed length n_b = absolute position of draft token 1
    top_k: Tensor | None = None,  # [B] int32, 0 = off (applied to the target distribution)
    top_p: Tensor | None = None,  # [B] fp32, 1.0 = off
    draft_probs: Tensor | None = None,  # dense q: [B, max_k, V] fp32
    draft_topk_ids: Tensor | None = None,  # sparse q: [B, max_k, K] int64
    draft_topk_probs: Tensor | None = None,  # sparse q: [B, max_k, K] fp32, renormalised
) -> VerifyResult:
    """Verify every request's draft tokens against the target logits in one batch.

    With no q (draft_probs and draft_topk_* all None) the draft is greedy: q is one-hot at the
    drafted token. Rows past a request's k_b are padding and are never read.
    """
    batch, max_k = check_verify_inputs(
        target_logits, draft_token_ids, num_draft_tokens, temperature, seeds, positions,
        top_k, top_p, draft_probs, draft_topk_ids, draft_topk_probs,
    )  # fmt: skip
    prescaled = top_k is not None or top_p is not None
    # Without masking the kernels read the logits as given and compute 1/T themselves.
    logits = prepare_target(target_logits, temperature, top_k, top_p)[0] if prescaled else target_logits
    rows, vocab = logits.shape
    device = logits.device
    if draft_probs is not None:
        q_mode, num_q, q_ids, q_probs = Q_DENSE, 1, draft_token_ids, draft_probs.float().contiguous()
    elif draft_topk_ids is not None:
        q_mode, num_q = Q_SPARSE, draft_topk_ids.shape[-1]
        q_ids, q_probs = draft_topk_ids.contiguous(), draft_topk_probs.float().contiguous()
    else:
        q_mode, num_q, q_ids, q_probs = Q_ONE_HOT, 1, draft_token_ids, temperature  # q unused
    draft_token_ids = draft_token_ids.contiguous()
    num_draft_tokens = num_draft_tokens.contiguous()
    common = dict(V=vocab, MAX_K=max_k, PRESCALED=prescaled)

    block, chunk, num_chunks, num_warps = stats_config(rows, vocab, logits.element_size())
    stats = torch.empty(5, rows, num_chunks, dtype=torch.float32, device=device)
    max_x, sum_x, amax_v = stats[0], stats[1], stats[2]
    amax_i, bad = stats[3].view(torch.int32), stats[4].view(torch.int32)
    _row_stats_kernel[(rows, num_chunks)](
        logits, logits.stride(0), temperature, num_draft_tokens, max_x, sum_x, amax_v, amax_i, bad,
        CHUNK=chunk, BLOCK=block, NUM_CHUNKS=num_chunks, num_warps=num_warps, **common,
    )  # fmt: skip

    output_tokens = torch.empty(batch, max_k + 1, dtype=torch.int32, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    num_emitted = torch.empty(batch, dtype=torch.int32, device=device)
    sample_state = torch.empty(2, batch, dtype=torch.float32, device=device)
    sample_pos, sample_lse = sample_state[0].view(torch.int32), sample_state[1]
    request_args = (logits, logits.stride(0), temperature, seeds, positions, num_draft_tokens)
    q_args = (draft_token_ids, q_ids, q_probs)
    q_consts = dict(NUM_Q=num_q, Q_P2=triton.next_power_of_2(num_q), Q_MODE=q_mode)
    _decide_kernel[(batch,)](
        *request_args, *q_args, max_x, sum_x, amax_v, amax_i, bad,
        output_tokens, num_accepted, num_emitted, sample_pos, sample_lse,
        NUM_CHUNKS=num_chunks, CHUNKS_P2=triton.next_power_of_2(num_chunks),
        OUT_P2=triton.next_power_of_2(max_k + 1), **q_consts, **common,
    )  # fmt: skip

    s_block, s_chunk, s_chunks, s_warps = sample_config(batch, vocab, logits.element_size())
    partial = torch.empty(2, batch, s_chunks, dtype=torch.float32, device=device)
    gmax_v, gmax_i = partial[0], partial[1].view(torch.int32)
    _sample_kernel[(batch, s_chunks)](
        *request_args, *q_args, sample_pos, sample_lse, gmax_v, gmax_i,
        CHUNK=s_chunk, BLOCK=s_block, NUM_CHUNKS=s_chunks, num_warps=s_warps, **q_consts, **common,
    )  # fmt: skip
    _finish_kernel[(batch,)](
        *request_args, *q_args, sample_pos, sample_lse, gmax_v, gmax_i, output_tokens,
        NUM_CHUNKS=s_chunks, CHUNKS_P2=triton.next_power_of_2(s_chunks), **q_consts, **common,
    )  # fmt: skip
    return VerifyResult(output_tokens, num_accepted, num_emitted)


def _split(vocab: int, programs_per_row: int, block: int, max_blocks: int) -> tuple[int, int]:
    """(CHUNK, NUM_CHUNKS): about programs_per_row chunks, each 1..max_blocks whole BLOCKs."""
    chunk = triton.cdiv(triton.cdiv(vocab, max(programs_per_row, 1)), block) * block
    chunk = max(block, min(chunk, max_blocks * block))
    return chunk, triton.cdiv(vocab, chunk)


# Launch parameters (bench/bench_rejection.py --tune sweeps them on the GPU; docs/kernels.md).
# The stats pass aims for ~STATS_PROGRAMS programs so that B = 1 still fills the GPU; each
# program streams whole BLOCKs of 4 KiB (the GPU sweep in docs/kernels.md picked these).
STATS_PROGRAMS = 4096
STATS_BLOCK_BYTES = 4096
STATS_MAX_BLOCKS = 32
STATS_WARPS = 4
SAMPLE_PROGRAMS = 2048
SAMPLE_BLOCK = 1024
SAMPLE_MAX_BLOCKS = 16
SAMPLE_WARPS = 4


def stats_config(rows: int, vocab: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK, CHUNK, NUM_CHUNKS, num_warps) of the stats pass over [rows, vocab] logits."""
    block = min(STATS_BLOCK_BYTES // elem_bytes, triton.next_power_of_2(vocab))
    chunk, num_chunks = _split(vocab, triton.cdiv(STATS_PROGRAMS, rows), block, STATS_MAX_BLOCKS)
    return block, chunk, num_chunks, STATS_WARPS if block >= 512 else 2


def sample_config(batch: int, vocab: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK, CHUNK, NUM_CHUNKS, num_warps) of the Gumbel pass over one row per request."""
    block = min(SAMPLE_BLOCK, triton.next_power_of_2(vocab))
    chunk, num_chunks = _split(vocab, triton.cdiv(SAMPLE_PROGRAMS, batch), block, SAMPLE_MAX_BLOCKS)
    return block, chunk, num_chunks, SAMPLE_WARPS if block >= 1024 else 2


def prepare_target(
    target_logits: Tensor, temperature: Tensor, top_k: Tensor | None, top_p: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(logits the kernels read, per-request 1/T with 1 for greedy rows).

    Without top-k/top-p the logits are read as given (bf16 stays bf16). With them, sampled rows
    are scaled by 1/T and masked here (top-p is defined on the tempered distribution) and the
    kernels then see T = 1; greedy rows are left unmasked (masking cannot change an argmax).
    """
    inv_temp = torch.where(temperature > 0, 1.0 / temperature.float(), 1.0).float().contiguous()
    if top_k is None and top_p is None:
        return target_logits, inv_temp
    batch = temperature.shape[0]
    rows_per_request = target_logits.shape[0] // batch
    greedy = temperature <= 0
    inv_temp_rows = inv_temp.repeat_interleave(rows_per_request)
    scaled = target_logits.float() * inv_temp_rows[:, None]
    if top_k is not None:
        top_k = torch.where(greedy, 0, top_k).repeat_interleave(rows_per_request)
    if top_p is not None:
        top_p = torch.where(greedy, 1.0, top_p).repeat_interleave(rows_per_request)
    masked = apply_top_k_top_p(scaled, top_k, top_p).contiguous()
    return masked, torch.ones_like(inv_temp)


def check_verify_inputs(
    target_logits, draft_token_ids, num_draft_tokens, temperature, seeds, positions,
    top_k, top_p, draft_probs, draft_topk_ids, draft_topk_probs,
) -> tuple[int, int]:  # fmt: skip
    """Shape / dtype / device checks (metadata only: no host synchronisation). Returns (B, max_k)."""
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, max_k], got shape {tuple(draft_token_ids.shape)}")
    batch, max_k = draft_token_ids.shape
    if target_logits.dim() != 2 or target_logits.shape[0] != batch * (max_k + 1):
        raise ValueError(
            f"target_logits must be [B * (max_k + 1), V] = [{batch * (max_k + 1)}, V], "
            f"got shape {tuple(target_logits.shape)}"
        )
    if target_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"target_logits must be fp32, bf16 or fp16, got {target_logits.dtype}")
    if target_logits.stride(-1) != 1:
        raise ValueError("target_logits must be contiguous along the vocabulary")
    vocab = target_logits.shape[1]
    expected = {
        "draft_token_ids": (draft_token_ids, (batch, max_k), (torch.int64, torch.int32)),
        "num_draft_tokens": (num_draft_tokens, (batch,), (torch.int32, torch.int64)),
        "temperature": (temperature, (batch,), (torch.float32,)),
        "seeds": (seeds, (batch,), (torch.int64,)),
        "positions": (positions, (batch,), (torch.int64,)),
        "top_k": (top_k, (batch,), (torch.int32, torch.int64)),
        "top_p": (top_p, (batch,), (torch.float32,)),
        "draft_probs": (draft_probs, (batch, max_k, vocab), (torch.float32,)),
    }
    if draft_topk_ids is not None or draft_topk_probs is not None:
        if draft_topk_ids is None or draft_topk_probs is None:
            raise ValueError("draft_topk_ids and draft_topk_probs must be given together")
        if draft_probs is not None:
            raise ValueError("give either draft_probs (dense q) or draft_topk_ids/probs (sparse q), not both")
        num_q = draft_topk_ids.shape[-1]
        expected["draft_topk_ids"] = (draft_topk_ids, (batch, max_k, num_q), (torch.int64,))
        expected["draft_topk_probs"] = (draft_topk_probs, (batch, max_k, num_q), (torch.float32,))
    for name, (t, shape, dtypes) in expected.items():
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
        if t.device != target_logits.device:
            raise ValueError(f"{name} is on {t.device}, target_logits on {target_logits.device}")
    return batch, max_k


# ---------------------------------------------------------------------------------- kernels


@triton.jit
def _inv_temperature(temp, PRESCALED: tl.constexpr):
    """1/T rounded as torch rounds it (1 for greedy rows, and when the logits are prescaled)."""
    if PRESCALED:
        return tl.full([], 1.0, tl.float32)
    else:
        one = tl.full([], 1.0, tl.float32)
        return tl.where(temp > 0, tl.math.div_rn(one, tl.where(temp > 0, temp, one)), one)


@triton.jit
def _num_draft(num_draft_ptr, b, MAX_K: tl.constexpr):
    """k_b clamped to [0, MAX_K]."""
    return tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int32), 0), MAX_K)


@triton.jit
def _first_max(val, idx):
    """(max, lowest index among the maxima) of a 1D (value, index) pair of tensors."""
    top = tl.max(val, 0)
    return top, tl.min(tl.where(val == top, idx, 2147483647), 0)


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # [R, V] fp32/bf16, R = B * (MAX_K + 1)
    stride_row,
    temp_ptr,  # [B] fp32, <= 0 = greedy
    num_draft_ptr,  # [B] int32/int64
    max_ptr,  # [R, C] fp32 out: chunk max of x = logits / T (-inf for greedy rows)
    sum_ptr,  # [R, C] fp32 out: chunk sum of exp(x - max) (0 for greedy rows)
    amax_v_ptr,  # [R, C] fp32 out: chunk max of raw logits (NaN -> -inf)
    amax_i_ptr,  # [R, C] int32 out: its first index
    bad_ptr,  # [R, C] int32 out: 1 if a NaN or +inf logit was seen
    V: tl.constexpr,
    MAX_K: tl.constexpr,
    PRESCALED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // (MAX_K + 1)
    i = row - b * (MAX_K + 1)
    if i <= _num_draft(num_draft_ptr, b, MAX_K):  # rows past k_b are padding: never read
        temp = tl.load(temp_ptr + b)
        inv_temp = _inv_temperature(temp, PRESCALED)
        neg_inf = float("-inf")
        lanes = tl.arange(0, BLOCK)
        # Per-lane accumulators: the only cross-lane reductions are after the loop.
        best_v = tl.full([BLOCK], neg_inf, tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        bad = tl.zeros([BLOCK], tl.int32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        begin = chunk * CHUNK
        end = tl.minimum(begin + CHUNK, V)
        if temp > 0:
            scale = inv_temp * 1.4426950408889634  # exp(y * inv_temp) = exp2(y * scale)
            for start in range(begin, end, BLOCK):
                offs = start + lanes
                raw = tl.load(row_ptr + offs, mask=offs < end, other=neg_inf).to(tl.float32)
                bad = tl.where(raw != raw, 1, bad)  # NaN (+inf shows up as the max)
                # Online sum-exp relative to the lane max, one exp per element: the smaller
                # of (new, old max) is exponentiated against the larger. NaN is never
                # `better`, so the argmax reads it as -inf.
                better = raw > best_v
                hi = tl.where(better, raw, best_v)
                lo = tl.where(better, best_v, raw)
                e = tl.exp2((lo - hi) * scale)
                e = tl.where(hi == neg_inf, 0.0, e)
                run_sum = tl.where(better, run_sum * e + 1.0, run_sum + e)
                best_v = hi
                best_i = tl.where(better, offs, best_i)
            top, top_i = _first_max(best_v, best_i)
            safe_top = tl.where(top == neg_inf, 0.0, top)
            chunk_sum = tl.sum(run_sum * tl.exp2((best_v - safe_top) * scale), 0)
            chunk_max = top * inv_temp  # max(L) / T = max(L / T): T > 0
        else:
            for start in range(begin, end, BLOCK):
                offs = start + lanes
                raw = tl.load(row_ptr + offs, mask=offs < end, other=neg_inf).to(tl.float32)
                bad = tl.where(raw != raw, 1, bad)  # NaN (+inf shows up as the max)
                # A lane's ids grow, so strict > keeps the first maximum; NaN is never better.
                better = raw > best_v
                best_v = tl.where(better, raw, best_v)
                best_i = tl.where(better, offs, best_i)
            top, top_i = _first_max(best_v, best_i)
            chunk_sum = 0.0
            chunk_max = neg_inf
        out = row * NUM_CHUNKS + chunk
        tl.store(amax_v_ptr + out, top)
        tl.store(amax_i_ptr + out, top_i)
        tl.store(max_ptr + out, chunk_max)
        tl.store(sum_ptr + out, chunk_sum)
        tl.store(bad_ptr + out, tl.maximum(tl.max(bad, 0), (top == float("inf")).to(tl.int32)))


@triton.jit
def _log1p(x):
    """log(1 + x) accurate for tiny |x| (triton 3.6 has no log1p): log(u) * x / (u - 1), u = 1 + x."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / (u - 1.0))


@triton.jit
def _decide_kernel(
    logits_ptr,  # [R, V] fp32/bf16
    stride_row,
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    num_draft_ptr,  # [B] int32/int64
    draft_ptr,  # [B, MAX_K] int64/int32 draft tokens
    q_ids_ptr,  # sparse: [B, MAX_K, NUM_Q] int64 top-K ids (unused otherwise)
    q_probs_ptr,  # sparse: [B, MAX_K, NUM_Q] fp32; dense: [B, MAX_K, V] fp32
    max_ptr,  # [R, C] fp32 chunk partials from _row_stats_kernel
    sum_ptr,  # [R, C] fp32
    amax_v_ptr,  # [R, C] fp32
    amax_i_ptr,  # [R, C] int32
    bad_ptr,  # [R, C] int32
    out_tokens_ptr,  # [B, MAX_K + 1] int32 out
    out_accepted_ptr,  # [B] int32 out
    out_emitted_ptr,  # [B] int32 out
    sample_pos_ptr,  # [B] int32 out: position a whose row needs a Gumbel sample, -1 if none
    sample_lse_ptr,  # [B] fp32 out: log-sum-exp of x at that row
    V: tl.constexpr,
    MAX_K: tl.constexpr,
    PRESCALED: tl.constexpr,
    NUM_Q: tl.constexpr,
    Q_P2: tl.constexpr,
    Q_MODE: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    OUT_P2: tl.constexpr,
):
    b = tl.program_id(0)
    k = _num_draft(num_draft_ptr, b, MAX_K)
    temp = tl.load(temp_ptr + b)
    sampled = temp > 0
    inv_temp = _inv_temperature(temp, PRESCALED)
    neg_inf = float("-inf")
    # All k_b + 1 positions at once: axis 0 = position i, axis 1 = vocab chunk. Partials of
    # rows past k_b are unwritten and never selected (no load depends on k: one round trip).
    pos_i = tl.arange(0, OUT_P2)
    row = b * (MAX_K + 1) + pos_i
    c = tl.arange(0, CHUNKS_P2)
    part = row[:, None] * NUM_CHUNKS + c[None, :]
    pmask = (pos_i[:, None] <= MAX_K) & (c[None, :] < NUM_CHUNKS)
    av = tl.load(amax_v_ptr + part, mask=pmask, other=neg_inf)
    ai = tl.load(amax_i_ptr + part, mask=pmask, other=2147483647)
    top_logit = tl.max(av, 1)
    argmax_token = tl.min(tl.where(av == top_logit[:, None], ai, 2147483647), 1)
    bad_flag = tl.max(tl.load(bad_ptr + part, mask=pmask, other=0), 1)
    bad_row = (bad_flag > 0) | (top_logit == neg_inf)
    m = tl.load(max_ptr + part, mask=pmask, other=neg_inf)
    s = tl.load(sum_ptr + part, mask=pmask, other=0.0)
    m_top = tl.max(m, 1)
    m_safe = tl.where(m_top == neg_inf, 0.0, m_top)
    lse = m_safe + tl.log(tl.sum(s * tl.exp(m - m_safe[:, None]), 1))

    has_draft = pos_i < k
    d = tl.load(draft_ptr + b * MAX_K + pos_i, mask=pos_i < MAX_K, other=-1).to(tl.int32)
    d_in_range = has_draft & (d >= 0) & (d < V)
    d_valid = d_in_range & ~bad_row
    d_safe = tl.where(d_in_range, d, 0)
    x_d = tl.load(logits_ptr + row.to(tl.int64) * stride_row + d_safe, mask=has_draft, other=0.0)
    log_p_d = x_d.to(tl.float32) * inv_temp - lse
    if Q_MODE == 0:  # one-hot q at the draft token
        log_q_d = tl.zeros([OUT_P2], tl.float32)
    elif Q_MODE == 1:
        qj = tl.arange(0, Q_P2)
        q_off = (b * MAX_K + pos_i)[:, None] * NUM_Q + qj[None, :]
        q_mask = has_draft[:, None] & (qj[None, :] < NUM_Q)
        ids = tl.load(q_ids_ptr + q_off, mask=q_mask, other=-1)
        probs = tl.load(q_probs_ptr + q_off, mask=q_mask, other=0.0)
        ids_ok = (ids >= 0) & (ids < V)
        log_q_d = tl.log(tl.sum(tl.where(ids_ok & (ids == d[:, None]), probs, 0.0), 1))
    else:
        q_off = (b * MAX_K + pos_i).to(tl.int64) * V + d_safe
        log_q_d = tl.log(tl.load(q_probs_ptr + q_off, mask=has_draft, other=0.0))
    k1, k2 = rng.tl_row_keys(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + pos_i, tl.full([], 1, tl.int32))
    log_u = tl.log(rng.tl_uniform(k1, k2, tl.zeros([OUT_P2], tl.int32)))  # STREAM_ACCEPT, index 0
    accept_sampled = (log_q_d > neg_inf) & (log_u < log_p_d - log_q_d)
    accept = d_valid & tl.where(sampled, accept_sampled, d == argmax_token)

    # a = first rejected position (position k_b always rejects: it has no draft token).
    a = tl.min(tl.where(accept, OUT_P2, pos_i), 0)
    at_a = pos_i == a
    argmax_a = tl.sum(tl.where(at_a, argmax_token, 0), 0)
    d_a = tl.sum(tl.where(at_a, d, 0), 0)
    d_valid_a = tl.sum(tl.where(at_a, d_valid.to(tl.int32), 0), 0) > 0
    bad_a = tl.sum(tl.where(at_a, bad_row.to(tl.int32), 0), 0) > 0
    lse_a = tl.sum(tl.where(at_a, lse, 0.0), 0)
    needs_sample = sampled & ~bad_a
    # Provisional token of slot a: the argmax (greedy / bad row), or what an empty residual
    # emits (the draft token if valid, else the argmax); _finish_kernel overwrites it with a sample.
    emitted = tl.where(needs_sample & d_valid_a, d_a, argmax_a)
    out = tl.where(pos_i < a, d, tl.where(at_a, emitted, -1))
    tl.store(out_tokens_ptr + b * (MAX_K + 1) + pos_i, out, mask=pos_i <= MAX_K)
    tl.store(out_accepted_ptr + b, a)
    tl.store(out_emitted_ptr + b, a + 1)
    tl.store(sample_pos_ptr + b, tl.where(needs_sample, a, -1))
    tl.store(sample_lse_ptr + b, lse_a)


@triton.jit
def _sample_kernel(
    logits_ptr,  # [R, V] fp32/bf16
    stride_row,
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    num_draft_ptr,  # [B] int32/int64
    draft_ptr,  # [B, MAX_K] int64/int32 draft tokens
    q_ids_ptr,  # sparse: [B, MAX_K, NUM_Q] int64
    q_probs_ptr,  # dense: [B, MAX_K, V] fp32 (sparse: unused here)
    sample_pos_ptr,  # [B] int32 from _decide_kernel
    sample_lse_ptr,  # [B] fp32
    gmax_v_ptr,  # [B, C] fp32 out: chunk max of the residual score + gumbel
    gmax_i_ptr,  # [B, C] int32 out: its first index
    V: tl.constexpr,
    MAX_K: tl.constexpr,
    PRESCALED: tl.constexpr,
    NUM_Q: tl.constexpr,
    Q_P2: tl.constexpr,
    Q_MODE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    a = tl.load(sample_pos_ptr + b)
    if a >= 0:
        k = _num_draft(num_draft_ptr, b, MAX_K)
        residual = a < k
        inv_temp = _inv_temperature(tl.load(temp_ptr + b), PRESCALED)
        stream = tl.where(residual, 2, 3)  # rng.STREAM_RESIDUAL / rng.STREAM_BONUS
        k1, k2 = rng.tl_row_keys(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + a, stream)
        neg_inf = float("-inf")
        lanes = tl.arange(0, BLOCK)
        gbest_v = tl.full([BLOCK], neg_inf, tl.float32)
        gbest_i = tl.zeros([BLOCK], tl.int32)
        row_ptr = logits_ptr + (b * (MAX_K + 1) + a).to(tl.int64) * stride_row
        begin = chunk * CHUNK
        end = tl.minimum(begin + CHUNK, V)
        if residual & (Q_MODE == 2):
            # Dense q: log residual = x + log1p(-q/p), -inf where p <= q.
            lse = tl.load(sample_lse_ptr + b)
            q_row = q_probs_ptr + (b * MAX_K + a).to(tl.int64) * V
            for start in range(begin, end, BLOCK):
                offs = start + lanes
                in_vocab = offs < end
                x = tl.load(row_ptr + offs, mask=in_vocab, other=neg_inf).to(tl.float32) * inv_temp
                log_p = x - lse
                log_q = tl.log(tl.load(q_row + offs, mask=in_vocab, other=0.0))
                adjust = tl.where(log_p > log_q, _log1p(-tl.exp(log_q - log_p)), neg_inf)
                score = (x + adjust) + rng.tl_gumbel(k1, k2, offs)
                score = tl.where(in_vocab, score, neg_inf)
                better = score > gbest_v
                gbest_v = tl.where(better, score, gbest_v)
                gbest_i = tl.where(better, offs, gbest_i)
        else:
            # One-hot / sparse q, or the bonus row: the residual equals p outside the draft
            # set, so the score is x + gumbel; the draft set is skipped here (for sparse q
            # _finish_kernel scores it with its exact residual).
            exclude = residual  # (dense q with a residual row took the branch above)
            if Q_MODE == 1:
                qj = tl.arange(0, Q_P2)
                q_set = tl.load(
                    q_ids_ptr + (b * MAX_K + a) * NUM_Q + qj, mask=(qj < NUM_Q) & (a + qj * 0 < k), other=-1
                )
            else:
                pos_a = a + tl.arange(0, 1)
                q_set = tl.load(draft_ptr + b * MAX_K + pos_a, mask=pos_a < k, other=-1)
            for start in range(begin, end, BLOCK):
                offs = start + lanes
                in_vocab = offs < end
                x = tl.load(row_ptr + offs, mask=in_vocab, other=neg_inf).to(tl.float32) * inv_temp
                score = x + rng.tl_gumbel(k1, k2, offs)
                score = tl.where(in_vocab, score, neg_inf)
                if exclude:
                    hit = tl.sum((offs[:, None] == q_set[None, :]).to(tl.int32), 1) > 0
                    score = tl.where(hit, neg_inf, score)
                better = score > gbest_v
                gbest_v = tl.where(better, score, gbest_v)
                gbest_i = tl.where(better, offs, gbest_i)
        top, top_i = _first_max(gbest_v, gbest_i)
        tl.store(gmax_v_ptr + b * NUM_CHUNKS + chunk, top)
        tl.store(gmax_i_ptr + b * NUM_CHUNKS + chunk, top_i)


@triton.jit
def _finish_kernel(
    logits_ptr,  # [R, V] fp32/bf16
    stride_row,
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    num_draft_ptr,  # [B] int32/int64
    draft_ptr,  # [B, MAX_K] draft tokens (unused)
    q_ids_ptr,  # sparse: [B, MAX_K, NUM_Q] int64
    q_probs_ptr,  # sparse: [B, MAX_K, NUM_Q] fp32
    sample_pos_ptr,  # [B] int32 from _decide_kernel
    sample_lse_ptr,  # [B] fp32
    gmax_v_ptr,  # [B, C] fp32 from _sample_kernel
    gmax_i_ptr,  # [B, C] int32
    out_tokens_ptr,  # [B, MAX_K + 1] int32 in/out: slot a gets the sample
    V: tl.constexpr,
    MAX_K: tl.constexpr,
    PRESCALED: tl.constexpr,
    NUM_Q: tl.constexpr,
    Q_P2: tl.constexpr,
    Q_MODE: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
):
    b = tl.program_id(0)
    a = tl.load(sample_pos_ptr + b)
    if a >= 0:
        c = tl.arange(0, CHUNKS_P2)
        v = tl.load(gmax_v_ptr + b * NUM_CHUNKS + c, mask=c < NUM_CHUNKS, other=float("-inf"))
        idx = tl.load(gmax_i_ptr + b * NUM_CHUNKS + c, mask=c < NUM_CHUNKS, other=2147483647)
        gumbel_v, gumbel_i = _first_max(v, idx)
        if Q_MODE == 1:
            if a < _num_draft(num_draft_ptr, b, MAX_K):  # score the K draft-set ids the scan skipped
                inv_temp = _inv_temperature(tl.load(temp_ptr + b), PRESCALED)
                lse = tl.load(sample_lse_ptr + b)
                qj = tl.arange(0, Q_P2)
                q_off = (b * MAX_K + a) * NUM_Q + qj
                ids = tl.load(q_ids_ptr + q_off, mask=qj < NUM_Q, other=-1)
                probs = tl.load(q_probs_ptr + q_off, mask=qj < NUM_Q, other=0.0)
                ids_ok = (ids >= 0) & (ids < V)
                row_ptr = logits_ptr + (b * (MAX_K + 1) + a).to(tl.int64) * stride_row
                x_ids = tl.load(row_ptr + tl.where(ids_ok, ids, 0)).to(tl.float32) * inv_temp
                # q at each id, adding up duplicated ids (as the reference does)
                q_at = tl.sum(
                    tl.where((ids[:, None] == ids[None, :]) & ids_ok[None, :], probs[None, :], 0.0), 1
                )
                log_p = x_ids - lse
                log_q = tl.log(q_at)
                adjust = tl.where(log_p > log_q, _log1p(-tl.exp(log_q - log_p)), float("-inf"))
                g1, g2 = rng.tl_row_keys(
                    tl.load(seed_ptr + b), tl.load(pos_ptr + b) + a, tl.full([], 2, tl.int32)
                )
                score = (x_ids + adjust) + rng.tl_gumbel(g1, g2, tl.where(ids_ok, ids, 0))
                score = tl.where(ids_ok, score, float("-inf"))
                fix_v = tl.max(score, 0)
                fix_i = tl.min(tl.where(score == fix_v, ids, 2147483647), 0).to(tl.int32)
                take = (fix_v > gumbel_v) | ((fix_v == gumbel_v) & (fix_i < gumbel_i))
                gumbel_i = tl.where(take, fix_i, gumbel_i)
                gumbel_v = tl.maximum(fix_v, gumbel_v)
        if gumbel_v > float("-inf"):  # else: empty residual, keep the provisional token
            tl.store(out_tokens_ptr + b * (MAX_K + 1) + a, gumbel_i)
