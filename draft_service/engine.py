"""Draft model execution (every TP rank) and per-request draft state (rank 0).

A draft round takes each request's pending tokens (committed tokens whose KV the
draft does not hold yet, at least one), runs them in one padded forward, then
drafts k tokens one position at a time for the whole batch. Greedy drafting
picks tokens with the local-argmax reduction (or a full-logit argmax); sampled
drafting samples from the draft's own top-K truncated distribution, which is
sent to the target as q. Every rank runs the same round, so the token choices
(and the collectives inside) line up without extra traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.batch import pack
from common.config import DTYPES
from common.cuda_graphs import StaticStep
from common.distributed import Comm
from common.kernels.sampling import sample_draft_topk
from common.kv_cache import KVCache, SlotTable
from common.loader import load_model
from common.tp_executor import TPExecutor, rank_device
from draft_service.config import DraftConfig


@dataclass
class RoundOutput:
    tokens: list[list[int]]  # [B][k] target-vocab ids
    topk_ids: list[list[int]] | None = None  # [B][k*K] (sampled rows only, else empty)
    topk_probs: list[list[float]] | None = None


class DraftRunner:
    """The model shard and KV cache of one rank; `draft_round` runs on all ranks."""

    def __init__(self, comm: Comm, config: DraftConfig):
        self.config = config
        self.device = rank_device(config.device, comm.rank)
        self.model = load_model(
            config.model,
            comm,
            device=self.device,
            dtype=DTYPES[config.dtype],
            markov_head_mode=config.markov_head_mode,
            use_local_argmax_reduction=config.use_local_argmax_reduction
            and config.draft_sampling == "greedy",
            draft_sampling=config.draft_sampling,
            progress=comm.rank == 0 and config.log_format == "text",
        )
        # Room for the drafted tokens and a draft-ahead round past the context limit.
        self.max_len = config.max_context_length + 2 * config.max_speculative_tokens + 4
        # One slot per request plus a scratch slot for the padded rows of static-shape steps.
        self.cache = KVCache.for_model(self.model, config.max_batch_size + 1, self.max_len)
        self.greedy_step = StaticStep(
            self._greedy_next,
            config.max_batch_size,
            self.max_len,
            scratch_slot=config.max_batch_size,
            device=self.device,
            use_graphs=config.cuda_graphs,
        )
        self.executor = TPExecutor(comm, {"draft_round": self.draft_round})
        # Sampled drafting never replays the greedy step, so it only needs the warm-up forward.
        self.graphs = self.greedy_step.warm_up([1], capture=config.draft_sampling == "greedy")

    @torch.inference_mode()
    def _greedy_next(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_len: int
    ) -> torch.Tensor:
        """One greedy draft position: feed [B, 1] tokens, return the next draft-vocab ids [B]."""
        hidden = self.model(input_ids, positions, slots, self.cache, ctx_len)[:, 0]
        zeros = torch.zeros_like(input_ids[:, 0], dtype=torch.float32)
        return self._pick(hidden, input_ids[:, 0], zeros, zeros.long(), positions[:, 0], False)[0]

    def max_target_id(self) -> int:
        mc = self.model.config
        draft_vocab = torch.arange(mc.draft_vocab_size or mc.vocab_size, device=self.device)
        return int(self.model.map_to_target(draft_vocab).max())

    def _pick(
        self,
        hidden: torch.Tensor,
        prev: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        sampled_rows: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """hidden [B, H], prev [B] (the token just fed, for the Markov bias) -> draft-vocab ids [B]."""
        if not sampled_rows:
            if self.config.use_local_argmax_reduction:
                return self.model.get_top_tokens(hidden, prev), None, None
            return self.model.compute_logits(hidden, prev).argmax(dim=-1), None, None
        logits = self.model.compute_logits(hidden, prev)
        greedy = temperature <= 0
        token, ids, probs = sample_draft_topk(
            logits,
            torch.where(greedy, torch.ones_like(temperature), temperature),
            seeds,
            positions,
            self.config.sampled_top_k,
        )
        token = torch.where(greedy, logits.argmax(dim=-1), token)
        return token, ids, probs

    @torch.inference_mode()
    def draft_round(
        self,
        rows: list[list[int]],
        starts: list[int],
        slots: list[int],
        k: int,
        temperatures: list[float],
        seeds: list[int],
    ) -> RoundOutput:
        """rows[b]: pending target-vocab ids appended at starts[b]; returns k drafted tokens per row."""
        batch = pack(rows, starts, slots, self.device, self.max_len)
        hidden = self.model(batch.input_ids, batch.positions, batch.slots, self.cache, batch.ctx_len)
        rows_idx = torch.arange(len(rows), device=self.device)
        hidden = hidden[rows_idx, batch.last_index]
        prev = batch.input_ids[rows_idx, batch.last_index]
        positions = batch.positions[rows_idx, batch.last_index] + 1
        temperature = torch.tensor(temperatures, dtype=torch.float32, device=self.device)
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=self.device)
        sampled_rows = self.config.draft_sampling == "sampled" and any(t > 0 for t in temperatures)
        drafted, all_ids, all_probs = [], [], []
        draft_ids, ids, probs = self._pick(hidden, prev, temperature, seed_t, positions, sampled_rows)
        for j in range(k):
            token = self.model.map_to_target(draft_ids)
            drafted.append(token)
            if ids is not None:
                all_ids.append(self.model.map_to_target(ids))
                all_probs.append(probs)
            if j == k - 1:
                break
            ctx = min(self.max_len, batch.ctx_len + j + 1)
            if sampled_rows:
                hidden = self.model(token[:, None], positions[:, None], batch.slots, self.cache, ctx)[:, 0]
                draft_ids, ids, probs = self._pick(hidden, token, temperature, seed_t, positions + 1, True)
            else:  # static shapes: replayed from a CUDA graph on the GPU
                draft_ids = self.greedy_step(token[:, None], positions[:, None], batch.slots, ctx)
            positions = positions + 1
        tokens = torch.stack(drafted, dim=1).tolist()
        if not all_ids:
            return RoundOutput(tokens)
        ids = torch.stack(all_ids, dim=1).flatten(1)
        probs = torch.stack(all_probs, dim=1).flatten(1)
        greedy = [t <= 0 for t in temperatures]
        return RoundOutput(
            tokens,
            [[] if g else row for g, row in zip(greedy, ids.tolist())],
            [[] if g else row for g, row in zip(greedy, probs.tolist())],
        )


def tp_worker(comm: Comm, config: DraftConfig) -> TPExecutor:
    """Entry of TP ranks > 0 (a module-level function so that spawn can pickle it)."""
    return DraftRunner(comm, config).executor


@dataclass
class Proposal:
    tokens: list[int]
    topk_ids: list[int] = field(default_factory=list)
    topk_probs: list[float] = field(default_factory=list)
    ahead_hit: bool = False


@dataclass
class DraftRequest:
    """Rank-0 view of one request on one target stream."""

    request_id: int
    slot: int
    committed: list[int]  # target-vocab ids the target has committed
    kv_tokens: list[int]  # tokens whose KV the slot holds, in order
    k: int
    temperature: float
    seed: int
    ready: Proposal | None = None  # a proposal computed before it was asked for
    ahead_expect: list[int] | None = None  # committed sequence under which `ahead` is valid
    ahead: Proposal | None = None


def common_prefix(a: list[int], b: list[int], known: int = 0) -> int:
    """Length of the common prefix of a and b, given that their first `known` items agree."""
    n = min(len(a), len(b))
    for i in range(known, n):
        if a[i] != b[i]:
            return i
    return n


class DraftState:
    """Rank 0's bookkeeping for all requests of all streams over one shared runner."""

    def __init__(self, runner: DraftRunner, slots: SlotTable):
        self.runner = runner
        self.slots = slots
        self.ahead_hits = 0
        # Draft-ahead pays off only when whole rounds plus the bonus guess are right; on shared hardware a
        # miss costs the target time. Track the recent hit rate and pause below the threshold.
        self.ahead_hit_rate = 1.0
        self.rounds_without_ahead = 0
        self.ahead_misses = 0
        self.draft_tokens = 0

    def start(
        self, request_id: int, tokens: list[int], k: int, temperature: float, seed: int
    ) -> DraftRequest:
        slot = self.slots.alloc()
        return DraftRequest(request_id, slot, list(tokens), [], k, temperature, seed)

    def release(self, req: DraftRequest) -> None:
        self.slots.free(req.slot)

    def apply_verdict(self, req: DraftRequest, start: int, tokens: list[int]) -> bool | None:
        """Commit the target's tokens; returns whether a draft-ahead guess hit (None: none was made)."""
        # The KV tokens always extend an older committed sequence, so they agree with it up to `start`:
        # only the few tokens after it are compared (no walk over the whole context every step).
        agreed = min(start, len(req.kv_tokens))
        del req.committed[start:]
        req.committed.extend(tokens)
        req.ready = None  # drafted for an older context (e.g. a step that asked this request for nothing)
        hit = None
        if req.ahead is not None:
            hit = req.ahead_expect == req.committed
            if hit:
                req.ready = req.ahead
                req.ready.ahead_hit = True
                self.ahead_hits += 1
            else:
                self.ahead_misses += 1
            self.ahead_hit_rate = 0.9 * self.ahead_hit_rate + 0.1 * float(hit)
        req.ahead, req.ahead_expect = None, None
        # Keep the KV that still matches; at least one committed token stays pending so
        # the next round has a hidden state to draft from.
        valid = min(common_prefix(req.kv_tokens, req.committed, agreed), len(req.committed) - 1)
        del req.kv_tokens[valid:]
        return hit

    def fits(self, req: DraftRequest, extra: int) -> bool:
        return len(req.committed) + extra <= self.runner.max_len

    def _run(self, reqs: list[DraftRequest], rows: list[list[int]], k: int) -> RoundOutput:
        return self.runner.executor.run(
            "draft_round",
            rows=rows,
            starts=[len(r.kv_tokens) for r in reqs],
            slots=[r.slot for r in reqs],
            k=k,
            temperatures=[r.temperature for r in reqs],
            seeds=[r.seed for r in reqs],
        )

    def propose(self, reqs: list[DraftRequest]) -> dict[int, Proposal]:
        """Proposals for `reqs` (k each); ready draft-ahead proposals are used as they are."""
        out: dict[int, Proposal] = {}
        todo = []
        for req in reqs:
            if req.ready is not None and len(req.ready.tokens) == req.k:
                out[req.request_id] = req.ready
            elif req.k > 0 and self.fits(req, 2 * req.k + 2):
                todo.append(req)
            else:
                out[req.request_id] = Proposal([])
            req.ready = None
        if todo:
            k = max(r.k for r in todo)
            result = self._run(todo, [r.committed[len(r.kv_tokens) :] for r in todo], k)
            for b, req in enumerate(todo):
                K = self.runner.config.sampled_top_k
                tokens = result.tokens[b][: req.k]
                ids = result.topk_ids[b][: req.k * K] if result.topk_ids else []
                probs = result.topk_probs[b][: req.k * K] if result.topk_probs else []
                req.kv_tokens = req.committed + result.tokens[b][: k - 1]
                out[req.request_id] = Proposal(tokens, ids, probs)
        self.draft_tokens += sum(len(p.tokens) for p in out.values())
        return out

    AHEAD_PROBE_EVERY = 16

    def ahead_worthwhile(self, min_hit_rate: float) -> bool:
        """Draft ahead while the recent hit rate is at least `min_hit_rate`; otherwise only every 16th
        round, to notice when it would pay again."""
        if self.ahead_hit_rate >= min_hit_rate or self.rounds_without_ahead >= self.AHEAD_PROBE_EVERY:
            self.rounds_without_ahead = 0
            return True
        self.rounds_without_ahead += 1
        return False

    def draft_ahead(self, reqs: list[DraftRequest], proposals: dict[int, Proposal]) -> None:
        """Assume every proposal is accepted plus the draft's own bonus guess; draft the next round."""
        todo = []
        for req in reqs:
            prop = proposals.get(req.request_id)
            if prop is None or not prop.tokens or len(prop.tokens) != req.k:
                continue
            if req.kv_tokens != req.committed + prop.tokens[:-1] or not self.fits(req, 3 * req.k + 4):
                continue
            todo.append(req)
        if not todo:
            return
        k = max(r.k for r in todo) + 1
        result = self._run(todo, [[proposals[r.request_id].tokens[-1]] for r in todo], k)
        K = self.runner.config.sampled_top_k
        for b, req in enumerate(todo):
            prop = proposals[req.request_id]
            guess, *nxt = result.tokens[b][: req.k + 1]
            req.kv_tokens = [*req.kv_tokens, prop.tokens[-1], *result.tokens[b][: k - 1]]
            req.ahead_expect = req.committed + prop.tokens + [guess]
            ids = result.topk_ids[b][K : (req.k + 1) * K] if result.topk_ids else []
            probs = result.topk_probs[b][K : (req.k + 1) * K] if result.topk_probs else []
            req.ahead = Proposal(nxt, ids, probs)
