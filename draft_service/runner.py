"""Draft model execution, on every TP rank: the model shard, its KV cache and the draft rounds.

A draft round takes each request's pending tokens (committed tokens whose KV the
draft does not hold yet, at least one), runs them in one padded forward, then
drafts k tokens one position at a time for the whole batch. Greedy drafting
picks tokens with the local-argmax reduction (or a full-logit argmax), and with
branches on also the second choice at each position; sampled drafting samples
from the draft's own top-K truncated distribution, which is sent to the target
as q. Every rank runs the same round, so the token choices (and the collectives
inside) line up without extra traffic. Branch rows (draft_service/state.py) read
the KV they share with their request from its slot (attention's prefix slot).
"""

from __future__ import annotations

import logging

import torch

from common.batch import pack
from common.cuda_graphs import to_device, warm_eager_shapes
from common.distributed import Comm
from common.kernels.fused import eager_shapes
from common.kernels.sampling import sample_draft_topk
from common.kv_cache import KVCache
from common.layers.logits import second_choice
from common.loader import load_service_model
from common.tp_executor import TPExecutor
from draft_service.config import DraftConfig
from draft_service.feature_rounds import FeatureRounds
from draft_service.rounds import GreedyRounds, RoundOutput

__all__ = ["DraftRunner", "tp_worker"]

log = logging.getLogger("specsplit.draft")


class DraftRunner:
    """The model shard and KV cache of one rank; `draft_round` runs on all ranks."""

    def __init__(self, comm: Comm, config: DraftConfig, target_features=None):
        """target_features: in the target's process, the target's FeatureStore (a feature draft reads it)."""
        self.config = config
        self.device, self.model = load_service_model(
            config,
            comm,
            markov_head_mode=config.markov_head_mode,
            use_local_argmax_reduction=config.use_local_argmax_reduction
            and config.draft_sampling == "greedy",
            draft_sampling=config.draft_sampling,
        )
        # Room for the drafted tokens and a draft-ahead round past the context limit.
        self.max_len = config.max_context_length + 2 * config.max_speculative_tokens + 4
        # A feature draft drafts from the target's features of committed tokens only: no branches, no
        # draft-ahead (both draft past a verdict the target has not computed features for).
        self.feature_layers = self.model.config.feature_layers
        if self.feature_layers and (config.draft_branches or config.draft_ahead):
            log.info("feature draft: no branches and no draft-ahead")
            config.draft_branches = config.draft_ahead = False
        # One slot per request, a scratch slot for the padded rows of static-shape steps, then the
        # branch slots.
        self.top2 = config.draft_branches and config.draft_sampling == "greedy"
        self.branch_slot_offset = config.max_batch_size + 1
        branch_slots = config.draft_branch_slots or 4 * (config.num_speculative_tokens + 1)
        self.num_branch_slots = branch_slots if self.top2 else 0
        num_slots = self.branch_slot_offset + self.num_branch_slots
        self.cache = KVCache.for_model(self.model, num_slots, self.max_len)
        self.executor = TPExecutor(
            comm, {"draft_round": self.draft_round, "copy_kv": self.copy_kv, "catch_up": self.catch_up}
        )
        # Branch rounds batch up to every branch slot: their batch buckets are captured too.
        max_rows = max(config.max_batch_size, self.num_branch_slots)
        if self.feature_layers:
            self.rounds: GreedyRounds = FeatureRounds(
                self, config.max_batch_size, max_rows, config.cuda_graphs, target_features
            )
            # The default k after any verdict (1..k + 1 tokens); a smaller k replays these (`_replay`).
            ks, widths = (
                [config.num_speculative_tokens],
                self.rounds.widths[: config.num_speculative_tokens + 1],
            )
        else:
            self.rounds = GreedyRounds(self, config.max_batch_size, max_rows, config.cuda_graphs)
            # Every round the default k produces (k + 1 for draft-ahead), catch-up of 1 or 2 tokens.
            ks, widths = list(range(1, config.num_speculative_tokens + 2)), (1, 2)
        # Sampled drafting never replays a greedy round: it only needs the eager warm-up round.
        self.graphs = self.rounds.warm_up(ks, widths, capture_graphs=config.draft_sampling == "greedy")
        # catch-ups and starts
        warm_eager_shapes(self.model, self.cache, config.max_batch_size, self.rounds.eager_forward)

    def pick_greedy(
        self, hidden: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H], prev [B] (the token just fed, for the Markov bias) -> greedy draft-vocab ids [B],
        and with branches on, the second choice [B] (the guess of the target's token where it rejects)."""
        if self.config.use_local_argmax_reduction:
            if self.top2:
                return self.model.get_top_tokens(hidden, prev, second=True)
            return self.model.get_top_tokens(hidden, prev), None
        logits = self.model.compute_logits(hidden, prev)
        best = logits.argmax(dim=-1)
        return best, second_choice(logits, best)[0] if self.top2 else None

    @torch.inference_mode()
    def copy_kv(
        self, src_slots: list[int], dst_slots: list[int], starts: list[int], lengths: list[int]
    ) -> None:
        """Copies positions [starts[i], starts[i] + lengths[i]) of slot src_slots[i] to dst_slots[i], every
        layer (a picked branch's KV into its request's slot)."""
        src, dst, pos = [], [], []
        for s, d, a, n in zip(src_slots, dst_slots, starts, lengths):
            src += [s] * n
            dst += [d] * n
            pos += range(a, a + n)
        idx = to_device(torch.tensor([src, dst, pos], dtype=torch.int64), self.device)
        for cache in (*self.cache.k, *self.cache.v):
            cache[idx[1], idx[2]] = cache[idx[0], idx[2]]

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [B, H], prev [B] (the token just fed, for the Markov bias) -> sampled draft-vocab ids [B]
        (greedy rows: the argmax) and each row's top-K ids and probabilities (its q)."""
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
    def catch_up(self, rows: list[list[int]], slots: list[int], feature_writes: list | tuple = ()) -> None:
        """Writes the KV of every token of rows[b] at positions 0.. of slots[b] (a feature draft's new
        requests, `DraftState.warm`); feature_writes as for `draft_round`."""
        if feature_writes:
            self.rounds.write(feature_writes)
        self.rounds.write_kv(rows, slots)

    @torch.inference_mode()
    def draft_round(
        self,
        rows: list[list[int]],
        starts: list[int],
        slots: list[int],
        k: int,
        temperatures: list[float],
        seeds: list[int],
        prefix_slots: list[int],
        prefix_len: list[int],
        feature_writes: list | tuple = (),
    ) -> RoundOutput:
        """rows[b]: pending target-vocab ids appended at starts[b]; returns k drafted tokens per row.
        Branch rows (greedy only) read positions < prefix_len[b] from slot prefix_slots[b]; empty lists:
        no branch rows. feature_writes (a feature draft): (slot, first position, rows [n, F]) to store
        before the round reads them."""
        if feature_writes:
            self.rounds.write(feature_writes)
        sampled_rows = self.config.draft_sampling == "sampled" and any(t > 0 for t in temperatures)
        if sampled_rows and self.feature_layers:
            return self.rounds.sampled(rows, starts, slots, k, temperatures, seeds)
        if not sampled_rows:
            tokens, seconds = self.rounds.run(rows, starts, slots, k, prefix_slots, prefix_len)
            return RoundOutput(tokens, seconds=seconds)
        with eager_shapes():
            return self._sampled_round(rows, starts, slots, k, temperatures, seeds)

    def _sampled_round(self, rows, starts, slots, k, temperatures, seeds) -> RoundOutput:
        """Sampled drafting: eager, one position at a time (each position samples from the draft's top-K)."""
        batch = pack(rows, starts, slots, self.device, self.max_len)
        hidden = self.model(batch.input_ids, batch.positions, batch.slots, self.cache, batch.ctx_len)
        rows_idx = torch.arange(len(rows), device=self.device)
        hidden = hidden[rows_idx, batch.last_index]
        prev = batch.input_ids[rows_idx, batch.last_index]
        positions = batch.positions[rows_idx, batch.last_index] + 1
        temperature = torch.tensor(temperatures, dtype=torch.float32, device=self.device)
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=self.device)
        drafted, all_ids, all_probs = [], [], []
        draft_ids, ids, probs = self._pick(hidden, prev, temperature, seed_t, positions)
        for j in range(k):
            token = self.model.map_to_target(draft_ids)
            drafted.append(token)
            all_ids.append(self.model.map_to_target(ids))
            all_probs.append(probs)
            if j == k - 1:
                break
            ctx = min(self.max_len, batch.ctx_len + j + 1)
            hidden = self.model(token[:, None], positions[:, None], batch.slots, self.cache, ctx)[:, 0]
            draft_ids, ids, probs = self._pick(hidden, token, temperature, seed_t, positions + 1)
            positions = positions + 1
        tokens = torch.stack(drafted, dim=1).tolist()
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
