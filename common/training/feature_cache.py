"""The target's features of the training sequences, computed once and read back every later epoch.

Under a one-layer feature draft the target's forward is most of a training step's arithmetic: for
Qwen2.5-Coder-1.5B and batches of 32 x 512 tokens about 38 TFLOP (2 x the 1.17 B weights of the 25
layers it runs x 16 384 tokens) against about 18 for the draft's training-time test over 4 positions,
forward and backward, with its 32768-row head. A training stage reads its data two to five times, so
every epoch after the first recomputes features it already had. The cache keeps each sequence's
features, as `target_features` returns them but in the target's own dtype (bf16 for a bf16 target: the
exact values, half the bytes of fp32), in one flat [tokens, F] tensor on the training device, until its
byte budget is spent; sequences past it are computed in every step as before. A batch's features are one
gather from the cache plus one target forward over the rows it lacks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.models.transformer import Transformer
from common.training.feature_train import target_features


def auto_budget(device: torch.device) -> int:
    """Bytes the cache may hold when --feature-cache-gb is not given: 40 % of the GPU memory free after
    the target and the draft are loaded (a step of 32 x 512 tokens peaks at about 25 GB for a 1.5B
    target's draft, and an out-of-memory error would lose the stage); none on the CPU, where the features
    of a few thousand sequences would compete with the process's own memory."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.4)


class FeatureCache:
    def __init__(self, target: Transformer, layers: tuple[int, ...], lengths: Tensor, max_len: int,
                 budget_bytes: int):  # fmt: skip
        """lengths [num_seqs]: each training sequence's tokens (Sequences.offsets.diff()); a step reads at
        most max_len of them (get_batch cuts the rest)."""
        self.target, self.layers = target, layers
        weight = target.model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.size = len(layers) * target.config.hidden_size
        self.lengths = lengths.clamp(max=max_len)
        row_bytes = self.size * self.dtype.itemsize
        capacity = min(int(self.lengths.sum()), max(0, budget_bytes) // row_bytes)
        # One row past the capacity stays zero: what padded positions gather.
        self.data = torch.zeros(capacity + 1, self.size, dtype=self.dtype, device=self.device)
        self.capacity = capacity
        self.used = 0
        self.offset: dict[int, int] = {}  # sequence -> its first row in `data`
        self.hits = self.misses = 0  # sequences of a batch read from the cache / computed by the target

    def features(self, rows: list[int], ids: Tensor) -> Tensor:
        """ids [B, L] of the sequences `rows` (get_batch's batch, padded past each one's length) ->
        [B, L, F] fp32: target_features(target, ids) at every position inside a sequence, zeros past it
        (padding, which the loss masks and the causal draft never reads)."""
        bsz, width = ids.shape
        lengths = self.lengths[rows].clamp(max=width)
        missing = [b for b, r in enumerate(rows) if r not in self.offset]
        self.misses += len(missing)
        self.hits += bsz - len(missing)
        computed = None
        if missing:
            # The rows it lacks in one forward, as wide as the longest of them (causal: the padding
            # after a sequence changes none of its positions).
            span = int(lengths[missing].max())
            computed = target_features(self.target, ids[missing, :span], self.layers, dtype=None)
            for b, feats in zip(missing, computed):
                n = int(lengths[b])
                if self.used + n <= self.capacity:
                    self.offset[rows[b]] = self.used
                    self.data[self.used : self.used + n] = feats[:n]
                    self.used += n
        # Every held row in one gather ([B, L] indices into `data`, the zero row where none).
        index = torch.full((bsz, width), self.capacity, dtype=torch.int64)
        steps = torch.arange(width)
        for b, r in enumerate(rows):
            first = self.offset.get(r)
            if first is not None:
                n = int(lengths[b])
                index[b, :n] = first + steps[:n]
        out = self.data[index.to(self.device)].float()
        if computed is not None:
            for i, b in enumerate(missing):
                if rows[b] not in self.offset:  # past the budget: this step's forward alone has them
                    n = int(lengths[b])
                    out[b, :n] = computed[i, :n].float()
        return out

    def close(self) -> None:
        """Frees the features (training is over); reads after this compute every row again."""
        self.data = torch.zeros(1, self.size, dtype=self.dtype, device=self.device)
        self.offset.clear()
        self.capacity = self.used = 0

    def stats(self) -> dict:
        return {"cached_sequences": len(self.offset), "cached_tokens": self.used,
                "capacity_tokens": self.capacity, "hits": self.hits, "misses": self.misses}  # fmt: skip
