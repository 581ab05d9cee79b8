"""Draft rounds of a feature draft (common/models/feature_draft.py), on every TP rank.

A round is the layer draft's (draft_service/runner.py, `GreedyRounds`) with features: the pending
committed tokens are fed with the target's features of the position before each (read from this rank's
`FeatureStore` inside the round, so a CUDA graph replays it), then k - 1 drafted positions each read the
draft's own stream from the position before. Every committed token is fed once with target features:
the KV of drafted positions (written from the draft's own streams) is never kept, so after a verdict the
round re-feeds the accepted drafts and the bonus token (width up to k + 1, one graph per width).
"""

from __future__ import annotations

import torch

from common.batch import pack
from common.cuda_graphs import to_device
from common.features import FeatureStore
from common.kernels.fused import eager_shapes
from common.kernels.sampling import sample_draft_topk
from draft_service.rounds import GreedyRounds, RoundOutput


class FeatureRounds(GreedyRounds):
    def __init__(self, runner, max_batch: int, max_rows: int, use_graphs: bool, target_store=None):
        """target_store: in the target's process, its FeatureStore, read in place (the graphs captured
        here read whichever store is set now)."""
        super().__init__(runner, max_batch, max_rows, use_graphs)
        model = runner.model
        # A verdict appends up to k + 1 tokens; longer catch-ups (starts, after plain steps) run first.
        self.widths = tuple(range(1, runner.config.max_speculative_tokens + 2))
        layers = model.config.feature_layers
        # Draft slot -> the store's slot of its features: itself for the draft's own store; the request's
        # target slot when the rounds read the target's store (`map_slot`; 0, a valid row, until then).
        self.slot_map = torch.arange(runner.cache.num_slots, device=runner.device)
        if target_store is None:
            dtype = model.model.embed_tokens.weight.dtype
            self.features = FeatureStore(layers, model.config.hidden_size, runner.cache.num_slots,
                                         runner.max_len, dtype, runner.device)  # fmt: skip
        elif target_store.layers != tuple(layers) or target_store.size != model.config.feature_size:
            raise ValueError(f"the target captures features of layers {list(target_store.layers)}, the "
                             f"draft reads {list(layers)}")  # fmt: skip
        else:
            self.features = target_store
            self.slot_map.zero_()

    def map_slot(self, slot: int, store_slot: int) -> None:
        self.slot_map[slot] = store_slot

    def write(self, writes) -> None:
        """writes: (slot, first position, rows [n, F] of wire features on the CPU) in arrival order."""
        self.features.put_many(writes)

    def _feed(self, ids, pos, slots, ctx):
        """ids/pos [B, W], slots [B]: the committed tokens with the target's features -> (hidden, aux)."""
        model = self.runner.model
        fused = model.fuse(self.features.previous(self.slot_map[slots], pos))
        return model(ids, pos, slots, self.runner.cache, ctx, fused)

    @torch.inference_mode()
    def launch_chained(self, packed, width, index, bases, extras, slots, k):
        """As GreedyRounds.launch_chained, for a feature draft: the round feeds every token the verify
        emitted (the accepted drafts and the bonus, width up to the verify's) at the request's committed
        length on, with the features that verify wrote. Its row: [k drafted | the fed tokens | base]."""
        n = len(index)
        events = self._start_timing()
        padded = next(b for b in self.batch_buckets if b >= n)
        max_len = self.runner.max_len
        needed = max(bases) + width + k + 1
        ctx = next((c for c in self.ctx_buckets if c >= needed), self.ctx_buckets[-1])
        static = self._static(padded, width)
        info = torch.tensor([index, bases, slots], dtype=torch.int64)
        idx, base, slot = to_device(info, self.device)
        rows = packed[idx]  # [n, width + 2]: emitted tokens (-1 past them), accepted, emitted
        fed = rows[:, :width].clamp(min=0).to(torch.int64)
        span = torch.arange(width, device=self.device)
        static["input_ids"][:n] = fed
        static["input_ids"][n:] = 0
        static["positions"][:n] = (base[:, None] + span).clamp(max=max_len - 1)
        static["positions"][n:] = span
        static["last_index"][:n] = rows[:, width]
        static["last_index"][n:] = 0
        static["slots"][:n] = slot
        static["slots"][n:] = self.scratch_slot
        result = self._replay(static, padded, width, k, ctx, needed)[:n, :k]
        return self._chained_result(torch.cat([result, fed, base[:, None]], dim=1), events, k)

    def _catch_up_forward(self, ids, pos, slots, ctx):
        return self._feed(ids, pos, slots, ctx)[1]

    def round(self, x: dict[str, torch.Tensor], k: int, ctx: int) -> torch.Tensor:
        """As GreedyRounds.round (no branches: [B, k] drafted target-vocab ids)."""
        r, model = self.runner, self.runner.model
        hidden, aux = self._feed(x["input_ids"], x["positions"], x["slots"], ctx)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = x["last_index"]
        hidden, aux = hidden[rows, last], aux[rows, last]
        prev, pos = x["input_ids"][rows, last], x["positions"][rows, last]
        drafted = []
        for j in range(k):
            token = model.map_to_target(r.pick_greedy(hidden, prev)[0])
            drafted.append(token)
            if j == k - 1:
                break
            pos = pos + 1
            hidden, aux = model(token[:, None], pos[:, None], x["slots"], r.cache, ctx, aux[:, None])
            hidden, aux, prev = hidden[:, 0], aux[:, 0], token
        return torch.stack(drafted, dim=1)

    @torch.inference_mode()
    def sampled(self, rows, starts, slots, k, temperatures, seeds) -> RoundOutput:
        """Sampled drafting, eager: each position samples from the draft's top-K (its q travels along)."""
        r, model = self.runner, self.runner.model
        with eager_shapes():
            batch = pack(rows, starts, slots, r.device, r.max_len)
            hidden, aux = self._feed(batch.input_ids, batch.positions, batch.slots, batch.ctx_len)
            idx = torch.arange(len(rows), device=r.device)
            hidden, aux = hidden[idx, batch.last_index], aux[idx, batch.last_index]
            prev = batch.input_ids[idx, batch.last_index]
            positions = batch.positions[idx, batch.last_index] + 1
            temperature = torch.tensor(temperatures, dtype=torch.float32, device=r.device)
            seed_t = torch.tensor(seeds, dtype=torch.int64, device=r.device)
            tokens, all_ids, all_probs = [], [], []
            for j in range(k):
                logits = model.compute_logits(hidden, prev)
                greedy = temperature <= 0
                temp = torch.where(greedy, torch.ones_like(temperature), temperature)
                token, ids, probs = sample_draft_topk(logits, temp, seed_t, positions, r.config.sampled_top_k)
                token = model.map_to_target(torch.where(greedy, logits.argmax(dim=-1), token))
                tokens.append(token)
                all_ids.append(model.map_to_target(ids))
                all_probs.append(probs)
                if j == k - 1:
                    break
                ctx = min(r.max_len, batch.ctx_len + j + 1)
                hidden, aux = model(
                    token[:, None], positions[:, None], batch.slots, r.cache, ctx, aux[:, None]
                )
                hidden, aux, prev = hidden[:, 0], aux[:, 0], token
                positions = positions + 1
        greedy_rows = [t <= 0 for t in temperatures]
        ids = torch.stack(all_ids, dim=1).flatten(1).tolist()
        probs = torch.stack(all_probs, dim=1).flatten(1).tolist()
        return RoundOutput(
            torch.stack(tokens, dim=1).tolist(),
            [[] if g else row for g, row in zip(greedy_rows, ids)],
            [[] if g else row for g, row in zip(greedy_rows, probs)],
        )
