"""The draft service's one config object (flags and SPECSPLIT_* env vars, see common.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import ServiceConfig, flag


@dataclass
class DraftConfig(ServiceConfig):
    port: int = flag(50052, "gRPC port (0 = pick a free one)")
    metrics_port: int = flag(9401, "Prometheus /metrics port (0 = pick a free one, -1 = off)")
    draft_sampling: str = flag(
        "greedy", "greedy drafting, or sampled from the draft's top-K", ("greedy", "sampled")
    )
    use_local_argmax_reduction: bool = flag(
        True, "greedy drafting reduces argmax per vocab shard (no logit gather)"
    )
    markov_head_mode: str = flag(
        "replicated", "Markov head weights on every rank or sharded", ("replicated", "sharded")
    )
    max_speculative_tokens: int = flag(8, "largest k a target may ask for")
    num_speculative_tokens: int = flag(
        4, "k whose draft rounds are captured as CUDA graphs at start-up (larger k is captured on first use)"
    )
    sampled_top_k: int = flag(16, "K of the truncated draft distribution sent with sampled drafting")
    max_batch_size: int = flag(64, "draft KV slots (concurrent requests over all targets)")
    grpc_workers: int = flag(16, "gRPC server threads (one per open target stream)")
    draft_ahead: bool = flag(True, "draft round r+1 while the target verifies round r")
    draft_ahead_shared_gpu: bool = flag(
        False,
        "draft ahead also for a target that runs on one of the draft's GPUs (there the round competes with "
        "the target's verify for the GPU: at B=1, 1.24x instead of 1.29x over plain)",
    )
    draft_branches: bool = flag(
        True,
        "greedy drafting: draft ahead for every accepted length (not only all accepted) and send those "
        "branches to the target, which starts its next step on the one its verdict picks without waiting",
    )
    draft_branch_slots: int = flag(
        0,
        "KV slots for branches, which also caps the rows of a branch round (each request branching at k "
        "takes k + 1); 0 = 4 requests' worth at --num-speculative-tokens. Larger batches branch for "
        "that many requests: a bigger branch round outlasts the target's verify on this draft",
    )
    draft_ahead_min_hit_rate: float = flag(
        0.15,
        "pause draft-ahead while the chance that every request of the round hits (recent "
        "per-request hit rate to the power of the rows) is below this (it is re-tried every "
        "16 rounds); 0 = always draft ahead",
    )

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.max_speculative_tokens <= 64:
            raise ValueError("--max-speculative-tokens: must be in [1, 64]")
        if self.sampled_top_k < 1:
            raise ValueError("--sampled-top-k: must be >= 1")
        if self.draft_branch_slots < 0:
            raise ValueError("--draft-branch-slots: must be >= 0")

    @property
    def method(self) -> str:
        if self.draft_sampling == "sampled":
            return "sampled-topk"
        return "greedy-local-argmax" if self.use_local_argmax_reduction else "greedy"
