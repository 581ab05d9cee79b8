"""Triton kernels that verify draft tokens: greedy and sampled requests in one launch.

Algorithm (docs/kernels.md has the long form; rejection_ref.py is the readable reference):

1. ``_scan_rows_kernel``, grid (rows, vocab chunks): one read of each logits row chunk gives
   - the first-max argmax of the raw logits (greedy decisions, and the fallback token);
   - the online max / sum-exp of x = logits / T (the log-sum-exp, for sampled rows);
   - a Gumbel-max candidate argmax_v (x_v + g_v) over the ids NOT in the row's draft set
     (the draft token, or the K sparse draft ids). argmax is shift invariant, so this needs no
     normalisation: only the few draft ids have a residual different from p, and those are
     fixed up once the log-sum-exp is known;
   - a bad-row flag (NaN or +inf seen).
2. ``_dense_residual_kernel`` (dense q only): the residual depends on q at every id, so a second
   pass scores x_v + log1p(-q/p) + g_v once the log-sum-exp is known.
3. ``_decide_kernel``, grid (requests,): reduces the chunk partials, walks the k_b + 1 positions,
   accepts / rejects with the ACCEPT stream, fixes up the draft-set ids of the residual and
   writes the outputs (-1 in every unused slot).

Nothing synchronises with the host and every launch shape depends only on (B, max_k, V), so
``verify`` can be captured in a CUDA graph.
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
    logits, inv_temp = prepare_target(target_logits, temperature, top_k, top_p)
    rows, vocab = logits.shape
    device = logits.device
    if draft_probs is not None:
        q_mode, num_q, q_ids, q_probs = Q_DENSE, 1, draft_token_ids, draft_probs.float().contiguous()
    elif draft_topk_ids is not None:
        q_mode, num_q = Q_SPARSE, draft_topk_ids.shape[-1]
        q_ids, q_probs = draft_topk_ids.contiguous(), draft_topk_probs.float().contiguous()
    else:
        q_mode, num_q, q_ids, q_probs = Q_ONE_HOT, 1, draft_token_ids, inv_temp  # q_probs unused
    draft_token_ids = draft_token_ids.contiguous()
    num_draft_tokens = num_draft_tokens.to(torch.int32).contiguous()

    block, chunk, num_chunks, num_warps = launch_config(rows, vocab)
    partial = torch.empty(7, rows, num_chunks, dtype=torch.float32, device=device)
    max_p, sum_p, amax_v, gmax_v = partial[0], partial[1], partial[2], partial[3]
    # Indices and flags live in the same buffer, reinterpreted as int32 (one allocation).
    amax_i, gmax_i, bad = (partial[j].view(torch.int32) for j in (4, 5, 6))
    scan_args = (logits, logits.stride(0), temperature, inv_temp, seeds, positions, num_draft_tokens)
    _scan_rows_kernel[(rows, num_chunks)](
        *scan_args, q_ids, max_p, sum_p, amax_v, amax_i, gmax_v, gmax_i, bad,
        V=vocab, MAX_K=max_k, NUM_Q=num_q, Q_MODE=q_mode, CHUNK=chunk, BLOCK=block,
        NUM_CHUNKS=num_chunks, num_warps=num_warps,
    )  # fmt: skip
    if q_mode == Q_DENSE:
        _dense_residual_kernel[(rows, num_chunks)](
            *scan_args, q_probs, max_p, sum_p, gmax_v, gmax_i,
            V=vocab, MAX_K=max_k, CHUNK=chunk, BLOCK=block, NUM_CHUNKS=num_chunks,
            CHUNKS_P2=triton.next_power_of_2(num_chunks), num_warps=num_warps,
        )  # fmt: skip
    output_tokens = torch.empty(batch, max_k + 1, dtype=torch.int32, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    num_emitted = torch.empty(batch, dtype=torch.int32, device=device)
    _decide_kernel[(batch,)](
        *scan_args, draft_token_ids, q_ids, q_probs,
        max_p, sum_p, amax_v, amax_i, gmax_v, gmax_i, bad,
        output_tokens, num_accepted, num_emitted,
        V=vocab, MAX_K=max_k, NUM_Q=num_q, Q_P2=triton.next_power_of_2(num_q), Q_MODE=q_mode,
        NUM_CHUNKS=num_chunks, CHUNKS_P2=triton.next_power_of_2(num_chunks),
        OUT_P2=triton.next_power_of_2(max_k + 1),
    )  # fmt: skip
    return VerifyResult(output_tokens, num_accepted, num_emitted)


def launch_config(rows: int, vocab: int) -> tuple[int, int, int, int]:
    """(BLOCK, CHUNK, NUM_CHUNKS, num_warps): split V so that even B = 1 fills the GPU.

    Aim for ~2048 programs; a program reads at least one BLOCK and at most 16 of them.
    """
    block = min(1024, triton.next_power_of_2(vocab))
    chunks_wanted = triton.cdiv(2048, rows)
    chunk = triton.next_power_of_2(triton.cdiv(vocab, chunks_wanted))
    chunk = max(block, min(chunk, 16 * block))
    return block, chunk, triton.cdiv(vocab, chunk), 4 if block >= 1024 else 2


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
def _request_of_row(row, num_draft_ptr, MAX_K: tl.constexpr):
    """(request b, position i within it, k_b clamped to [0, MAX_K])."""
    b = row // (MAX_K + 1)
    i = row - b * (MAX_K + 1)
    k = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int32), 0), MAX_K)
    return b, i, k


@triton.jit
def _scan_rows_kernel(
    logits_ptr,  # [R, V] fp32/bf16, R = B * (MAX_K + 1)
    stride_row,
    temp_ptr,  # [B] fp32
    inv_temp_ptr,  # [B] fp32, 1 for greedy
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    num_draft_ptr,  # [B] int32
    q_ids_ptr,  # [B, MAX_K, NUM_Q] int64: ids excluded from the residual scan (draft token / top-K ids)
    max_ptr,  # [R, C] fp32 out: chunk max of x = logits / T
    sum_ptr,  # [R, C] fp32 out: chunk sum of exp(x - max)
    amax_v_ptr,  # [R, C] fp32 out: chunk max of raw logits (NaN -> -inf)
    amax_i_ptr,  # [R, C] int32 out: its first index
    gmax_v_ptr,  # [R, C] fp32 out: chunk max of x + gumbel over ids outside the draft set
    gmax_i_ptr,  # [R, C] int32 out: its first index
    bad_ptr,  # [R, C] int32 out: 1 if a NaN or +inf logit was seen
    V: tl.constexpr,
    MAX_K: tl.constexpr,
    NUM_Q: tl.constexpr,
    Q_MODE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b, i, k = _request_of_row(row, num_draft_ptr, MAX_K)
    if i <= k:  # rows past k_b are padding: never read
        sampled = tl.load(temp_ptr + b) > 0
        inv_temp = tl.load(inv_temp_ptr + b)
        is_residual_row = i < k
        stream = tl.where(is_residual_row, 2, 3)  # rng.STREAM_RESIDUAL / rng.STREAM_BONUS
        k1, k2 = rng.tl_row_keys(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + i, stream)
        # The residual scan skips the draft set; the dense kernel redoes residual rows anyway.
        exclude = is_residual_row & (Q_MODE != 2)
        do_gumbel = sampled & ((Q_MODE != 2) | ~is_residual_row)

        lanes = tl.arange(0, BLOCK)
        neg_inf = float("-inf")
        best_v = tl.full([BLOCK], neg_inf, tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        gbest_v = tl.full([BLOCK], neg_inf, tl.float32)
        gbest_i = tl.zeros([BLOCK], tl.int32)
        run_max = neg_inf
        run_sum = 0.0
        bad = 0
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + lanes
            in_vocab = offs < V
            raw = tl.load(row_ptr + offs, mask=in_vocab, other=neg_inf).to(tl.float32)
            is_nan = raw != raw
            bad = tl.maximum(bad, tl.max((is_nan | (raw == float("inf"))).to(tl.int32), 0))
            clean = tl.where(is_nan, neg_inf, raw)
            # Per-lane running argmax: a lane's ids grow, so strict > keeps the first maximum.
            better = clean > best_v
            best_v = tl.where(better, clean, best_v)
            best_i = tl.where(better, offs, best_i)
            if sampled:
                x = clean * inv_temp
                block_max = tl.max(x, 0)
                new_max = tl.maximum(run_max, block_max)
                safe_max = tl.where(new_max == neg_inf, 0.0, new_max)
                run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(x - safe_max), 0)
                run_max = new_max
                if do_gumbel:
                    score = x + rng.tl_gumbel(k1, k2, offs)
                    if exclude:
                        q_row = q_ids_ptr + (b * MAX_K + i) * NUM_Q
                        for j in tl.static_range(NUM_Q):
                            score = tl.where(offs == tl.load(q_row + j), neg_inf, score)
                    score = tl.where(in_vocab, score, neg_inf)
                    gbetter = score > gbest_v
                    gbest_v = tl.where(gbetter, score, gbest_v)
                    gbest_i = tl.where(gbetter, offs, gbest_i)
        out = row * NUM_CHUNKS + chunk
        top = tl.max(best_v, 0)
        tl.store(amax_v_ptr + out, top)
        tl.store(amax_i_ptr + out, tl.min(tl.where(best_v == top, best_i, 2147483647), 0))
        gtop = tl.max(gbest_v, 0)
        tl.store(gmax_v_ptr + out, gtop)
        tl.store(gmax_i_ptr + out, tl.min(tl.where(gbest_v == gtop, gbest_i, 2147483647), 0))
        tl.store(max_ptr + out, run_max)
        tl.store(sum_ptr + out, run_sum)
        tl.store(bad_ptr + out, bad)


@triton.jit
def _row_lse(max_ptr, sum_ptr, row, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """Merge the chunk (max, sum-exp) partials of one row into its log-sum-exp."""
    c = tl.arange(0, CHUNKS_P2)
    valid = c < NUM_CHUNKS
    m = tl.load(max_ptr + row * NUM_CHUNKS + c, mask=valid, other=float("-inf"))
    s = tl.load(sum_ptr + row * NUM_CHUNKS + c, mask=valid, other=0.0)
    top = tl.max(m, 0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    return safe_top + tl.log(tl.sum(s * tl.exp(m - safe_top), 0))


@triton.jit
def _row_argmax(val_ptr, idx_ptr, row, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """Merge chunk (max, first index) partials: the lowest index among the maxima wins."""
    c = tl.arange(0, CHUNKS_P2)
    valid = c < NUM_CHUNKS
    v = tl.load(val_ptr + row * NUM_CHUNKS + c, mask=valid, other=float("-inf"))
    idx = tl.load(idx_ptr + row * NUM_CHUNKS + c, mask=valid, other=2147483647)
    top = tl.max(v, 0)
    return top, tl.min(tl.where(v == top, idx, 2147483647), 0)


@triton.jit
def _dense_residual_kernel(
    logits_ptr,
    stride_row,
    temp_ptr,
    inv_temp_ptr,
    seed_ptr,
    pos_ptr,
    num_draft_ptr,
    q_ptr,  # [B, MAX_K, V] fp32 dense draft probabilities
    max_ptr,  # [R, C] fp32 in (from the scan)
    sum_ptr,  # [R, C] fp32 in
    gmax_v_ptr,  # [R, C] fp32 out: chunk max of x + log1p(-q/p) + gumbel
    gmax_i_ptr,  # [R, C] int32 out
    V: tl.constexpr,
    MAX_K: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b, i, k = _request_of_row(row, num_draft_ptr, MAX_K)
    if (i < k) & (tl.load(temp_ptr + b) > 0):
        inv_temp = tl.load(inv_temp_ptr + b)
        lse = _row_lse(max_ptr, sum_ptr, row, NUM_CHUNKS, CHUNKS_P2)
        k1, k2 = rng.tl_row_keys(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + i, tl.full([], 2, tl.int32))
        neg_inf = float("-inf")
        lanes = tl.arange(0, BLOCK)
        gbest_v = tl.full([BLOCK], neg_inf, tl.float32)
        gbest_i = tl.zeros([BLOCK], tl.int32)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        q_row = q_ptr + (b * MAX_K + i).to(tl.int64) * V
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + lanes
            in_vocab = offs < V
            raw = tl.load(row_ptr + offs, mask=in_vocab, other=neg_inf).to(tl.float32)
            x = tl.where(raw != raw, neg_inf, raw) * inv_temp
            log_p = x - lse
            log_q = tl.log(tl.load(q_row + offs, mask=in_vocab, other=0.0))
            adjust = tl.where(log_p > log_q, _log1p(-tl.exp(log_q - log_p)), neg_inf)
            score = (x + adjust) + rng.tl_gumbel(k1, k2, offs)
            score = tl.where(in_vocab, score, neg_inf)
            better = score > gbest_v
            gbest_v = tl.where(better, score, gbest_v)
            gbest_i = tl.where(better, offs, gbest_i)
        out = row * NUM_CHUNKS + chunk
        gtop = tl.max(gbest_v, 0)
        tl.store(gmax_v_ptr + out, gtop)
        tl.store(gmax_i_ptr + out, tl.min(tl.where(gbest_v == gtop, gbest_i, 2147483647), 0))


@triton.jit
def _log1p(x):
    """log(1 + x) accurate for tiny |x| (triton 3.6 has no log1p): log(u) * x / (u - 1), u = 1 + x."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / (u - 1.0))


@triton.jit
def _decide_kernel(
    logits_ptr,
    stride_row,
    temp_ptr,
    inv_temp_ptr,
    seed_ptr,
    pos_ptr,
    num_draft_ptr,
    draft_ptr,  # [B, MAX_K] int64 draft tokens
    q_ids_ptr,  # sparse: [B, MAX_K, NUM_Q] int64 top-K ids
    q_probs_ptr,  # sparse: [B, MAX_K, NUM_Q] fp32; dense: [B, MAX_K, V] fp32
    max_ptr,
    sum_ptr,
    amax_v_ptr,
    amax_i_ptr,
    gmax_v_ptr,
    gmax_i_ptr,
    bad_ptr,
    out_tokens_ptr,  # [B, MAX_K + 1] int32 out
    out_accepted_ptr,  # [B] int32 out
    out_emitted_ptr,  # [B] int32 out
    V: tl.constexpr,
    MAX_K: tl.constexpr,
    NUM_Q: tl.constexpr,
    Q_P2: tl.constexpr,
    Q_MODE: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    OUT_P2: tl.constexpr,
):
    b = tl.program_id(0)
    k = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int32), 0), MAX_K)
    sampled = tl.load(temp_ptr + b) > 0
    inv_temp = tl.load(inv_temp_ptr + b)
    seed = tl.load(seed_ptr + b)
    position = tl.load(pos_ptr + b)
    neg_inf = float("-inf")
    slots = tl.arange(0, OUT_P2)
    out = tl.full([OUT_P2], -1, tl.int32)
    num_accepted = 0
    done = 0
    for i in tl.static_range(MAX_K + 1):
        row = b * (MAX_K + 1) + i
        if done == 0:
            top_logit, argmax_token = _row_argmax(amax_v_ptr, amax_i_ptr, row, NUM_CHUNKS, CHUNKS_P2)
            c = tl.arange(0, CHUNKS_P2)
            bad_flag = tl.max(tl.load(bad_ptr + row * NUM_CHUNKS + c, mask=c < NUM_CHUNKS, other=0), 0)
            bad_row = (bad_flag > 0) | (top_logit == neg_inf)
            lse = _row_lse(max_ptr, sum_ptr, row, NUM_CHUNKS, CHUNKS_P2)
            row_ptr = logits_ptr + row.to(tl.int64) * stride_row
            gumbel_v, gumbel_i = _row_argmax(gmax_v_ptr, gmax_i_ptr, row, NUM_CHUNKS, CHUNKS_P2)
            if i < MAX_K:
                d = tl.load(draft_ptr + b * MAX_K + i).to(tl.int32)
                d_in_range = (i < k) & (d >= 0) & (d < V)
            else:
                d = tl.full([], -1, tl.int32)
                d_in_range = tl.full([], 0, tl.int1)
            d_valid = d_in_range & ~bad_row
            d_safe = tl.where(d_in_range, d, 0)
            log_p_d = tl.load(row_ptr + d_safe).to(tl.float32) * inv_temp - lse
            if (Q_MODE == 0) or (i == MAX_K):  # one-hot q, or the bonus row (no draft token)
                log_q_d = 0.0
            elif Q_MODE == 1:
                qj = tl.arange(0, Q_P2)
                q_off = (b * MAX_K + i) * NUM_Q + qj
                ids = tl.load(q_ids_ptr + q_off, mask=qj < NUM_Q, other=-1)
                probs = tl.load(q_probs_ptr + q_off, mask=qj < NUM_Q, other=0.0)
                ids_ok = (ids >= 0) & (ids < V)
                log_q_d = tl.log(tl.sum(tl.where(ids_ok & (ids == d), probs, 0.0), 0))
            else:
                log_q_d = tl.log(tl.load(q_probs_ptr + (b * MAX_K + i).to(tl.int64) * V + d_safe))
            k1, k2 = rng.tl_row_keys(seed, position + i, tl.full([], 1, tl.int32))  # STREAM_ACCEPT
            log_u = tl.log(rng.tl_uniform(k1, k2, tl.full([], 0, tl.int32)))
            accept_sampled = (log_q_d > neg_inf) & (log_u < log_p_d - log_q_d)
            accept = d_valid & tl.where(sampled, accept_sampled, d == argmax_token)

            sampled_token = gumbel_i
            if (Q_MODE == 1) and (i < MAX_K):
                if i < k:  # fix up the K draft-set ids the scan skipped
                    g1, g2 = rng.tl_row_keys(seed, position + i, tl.full([], 2, tl.int32))  # RESIDUAL
                    x_ids = tl.load(row_ptr + tl.where(ids_ok, ids, 0)).to(tl.float32) * inv_temp
                    # q at each id, adding up duplicated ids (as the reference does)
                    q_at = tl.sum(
                        tl.where((ids[:, None] == ids[None, :]) & ids_ok[None, :], probs[None, :], 0.0), 1
                    )
                    log_p = x_ids - lse
                    log_q = tl.log(q_at)
                    adjust = tl.where(log_p > log_q, _log1p(-tl.exp(log_q - log_p)), neg_inf)
                    score = (tl.where(x_ids != x_ids, neg_inf, x_ids) + adjust) + rng.tl_gumbel(
                        g1, g2, tl.where(ids_ok, ids, 0)
                    )
                    score = tl.where(ids_ok, score, neg_inf)
                    fix_v = tl.max(score, 0)
                    fix_i = tl.min(tl.where(score == fix_v, ids, 2147483647), 0).to(tl.int32)
                    take = (fix_v > gumbel_v) | ((fix_v == gumbel_v) & (fix_i < gumbel_i))
                    sampled_token = tl.where(take, fix_i, gumbel_i)
                    gumbel_v = tl.maximum(fix_v, gumbel_v)
            empty_residual = gumbel_v == neg_inf
            sampled_token = tl.where(empty_residual, tl.where(d_valid, d, argmax_token), sampled_token)
            emitted = tl.where(sampled & ~bad_row, sampled_token, argmax_token)
            out = tl.where(slots == i, tl.where(accept, d, emitted), out)
            num_accepted += accept.to(tl.int32)
            done = 1 - accept.to(tl.int32)
    tl.store(out_tokens_ptr + b * (MAX_K + 1) + slots, out, mask=slots < MAX_K + 1)
    tl.store(out_accepted_ptr + b, num_accepted)
    tl.store(out_emitted_ptr + b, num_accepted + 1)
