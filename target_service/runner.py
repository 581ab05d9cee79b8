"""Target model execution on every TP rank: prefill and the (k+1)-position verify forward."""

from __future__ import annotations

import torch

from common.batch import pack
from common.config import DTYPES
from common.cuda_graphs import StaticStep
from common.distributed import Comm
from common.kv_cache import KVCache
from common.loader import load_model
from common.tp_executor import TPExecutor, rank_device
from target_service.config import TargetConfig


class TargetRunner:
    def __init__(self, comm: Comm, config: TargetConfig):
        self.config = config
        self.device = rank_device(config.device, comm.rank)
        self.model = load_model(
            config.model,
            comm,
            device=self.device,
            dtype=DTYPES[config.dtype],
            progress=comm.rank == 0 and config.log_format == "text",
        )
        mc = self.model.config
        self.max_context = min(config.max_context_length, mc.max_position_embeddings)
        # Padding of a verify row may run k+1 positions past the longest allowed sequence.
        self.max_len = self.max_context + config.max_speculative_tokens + 2
        # One slot per request plus a scratch slot for the padded rows of static-shape steps.
        self.cache = KVCache.for_model(self.model, config.max_batch_size + 1, self.max_len)
        self.verify_step = StaticStep(
            self._logits,
            config.max_batch_size,
            self.max_len,
            scratch_slot=config.max_batch_size,
            device=self.device,
            use_graphs=config.cuda_graphs,
            copy_output=False,  # the logits are consumed by verify() before the next step
        )
        self.executor = TPExecutor(comm, {"prefill": self.prefill, "verify_forward": self.verify_forward})
        # Plain decoding (width 1) and the default k; other widths are captured on first use.
        self.graphs = self.verify_step.warm_up(sorted({1, config.num_speculative_tokens + 1}))

    @torch.inference_mode()
    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_len: int):
        hidden = self.model(input_ids, positions, slots, self.cache, ctx_len)
        return self.model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))

    @torch.inference_mode()
    def prefill(self, rows: list[list[int]], slots: list[int]) -> None:
        """Writes the KV of prompt tokens (all but the last, which the first verify step feeds)."""
        batch = pack(rows, [0] * len(rows), slots, self.device, self.max_len)
        self.model(batch.input_ids, batch.positions, batch.slots, self.cache, batch.ctx_len)

    @torch.inference_mode()
    def verify_forward(
        self, rows: list[list[int]], starts: list[int], slots: list[int], width: int
    ) -> torch.Tensor:
        """rows[b] = [t_n, d_1..d_k] at positions starts[b]...; returns fp32 logits [B * width, V]."""
        batch = pack(rows, starts, slots, self.device, self.max_len, width=width)
        return self.verify_step(batch.input_ids, batch.positions, batch.slots, batch.ctx_len)


def tp_worker(comm: Comm, config: TargetConfig) -> TPExecutor:
    """Entry of TP ranks > 0 (a module-level function so that spawn can pickle it)."""
    return TargetRunner(comm, config).executor
