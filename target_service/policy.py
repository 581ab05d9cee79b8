"""How many draft tokens to ask for in a step: fixed, or the goodput-maximising k (SmartSpec-style).

Speculation pays when the tokens it adds per step outweigh what it costs: the wider verify forward and
the wait for the draft. At batch 1 the verify is memory-bound and k = 4 is nearly free; at batch 64 it is
compute-bound and a width-5 forward costs several plain steps. The adaptive policy picks, per step, the
k in [0, max k of the batch] that maximises

    goodput(k) = sum_r E_r(min(k, k_r)) / (verify_seconds(B, k + 1) + draft_wait_seconds(B, k))

with E_r(k) = (1 - a_r^(k+1)) / (1 - a_r) the expected tokens of request r at per-token acceptance a_r.
Step costs are measured: verify times per (batch bucket, width) from the runner's start-up timing, then
the median of the recent real steps; draft waits per (batch bucket, k) from real exchanges in steady
state (an ask that starts a request, or catches the draft up after plain steps, costs a prefill rather
than a round: it is not a sample). A width that has never been measured is assumed as cheap as the
nearest measured one below it (optimism makes the policy try it once); an unmeasured draft wait is
taken from the nearest measured k, and none measured counts as free, so the policy speculates and
learns. While k = 0 wins, a probe still speculates now and then, so that the estimates stay fresh (a
probe is two steps: the first catches the draft up, the second is a steady sample). Probes cost: with a
draft that loses (low acceptance, or a target step too cheap to hide a round trip) a probe every 16
steps cost 15% of plain throughput on the real 135M pair. So the gap between probes starts at
`probe_every` steps and doubles after every probe that still leaves k = 0 the winner, up to
`max_probe_every`; it falls back to `probe_every` as soon as speculation wins again. Greedy output
never depends on k: verification is lossless for any k.
"""

from __future__ import annotations

import bisect
import collections
import statistics
from collections.abc import Sequence

from target_service.request import Request, SpecStats

FIXED, ADAPTIVE = "fixed", "adaptive"


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits for one request drafting k tokens at per-token acceptance alpha."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class StepCosts:
    """Recent step costs, keyed by (batch bucket, width) and (batch bucket, k): the median of the last
    `window` observations, so a one-off stall (a slow draft round, a GC pause) does not swing k."""

    def __init__(self, batch_buckets: Sequence[int], window: int = 16):
        self.batch_buckets = list(batch_buckets)
        self.window = window
        self._verify: dict[tuple[int, int], collections.deque[float]] = {}
        self._draft: dict[tuple[int, int], collections.deque[float]] = {}
        self.verify: dict[tuple[int, int], float] = {}  # medians, updated on every observation
        self.draft: dict[tuple[int, int], float] = {}

    def bucket(self, batch: int) -> int:
        i = bisect.bisect_left(self.batch_buckets, batch)
        return self.batch_buckets[min(i, len(self.batch_buckets) - 1)]

    def _update(self, recent: dict, medians: dict, key: tuple[int, int], seconds: float) -> None:
        window = recent.setdefault(key, collections.deque(maxlen=self.window))
        window.append(seconds)
        medians[key] = statistics.median(window)

    def observe_verify(self, batch: int, width: int, seconds: float) -> None:
        self._update(self._verify, self.verify, (self.bucket(batch), width), seconds)

    def observe_draft(self, batch: int, k: int, seconds: float) -> None:
        self._update(self._draft, self.draft, (self.bucket(batch), k), seconds)

    @staticmethod
    def _nearest_below(table: dict, b: int, n: int) -> float | None:
        known = [(m, s) for (bb, m), s in table.items() if bb == b and m <= n]
        return max(known)[1] if known else None

    def verify_seconds(self, batch: int, width: int) -> float | None:
        b = self.bucket(batch)
        return self.verify.get((b, width), self._nearest_below(self.verify, b, width))

    def draft_seconds(self, batch: int, k: int) -> float:
        """The wait for a k-token proposal; an unmeasured k costs what the nearest measured k did (the
        wait is mostly the fixed round trip, not the k draft positions)."""
        b = self.bucket(batch)
        if k == 0:
            return 0.0
        if (b, k) in self.draft:
            return self.draft[b, k]
        known = [(abs(m - k), m, s) for (bb, m), s in self.draft.items() if bb == b]
        return min(known)[2] if known else 0.0


class SpeculationPolicy:
    def __init__(
        self,
        mode: str,
        costs: StepCosts,
        prior_alpha: float = 0.7,
        probe_every: int = 16,
        max_probe_every: int = 1024,
    ):
        if mode not in (FIXED, ADAPTIVE):
            raise ValueError(f"--speculation-policy: {mode!r} is not one of fixed, adaptive")
        self.mode = mode
        self.costs = costs
        # A new request's acceptance starts from the service's recent acceptance (all requests), which
        # starts from `prior_alpha`: short requests then do not each re-learn a bad draft.
        self.first_prior = prior_alpha
        self.service = SpecStats()
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_gap = probe_every  # steps between probes now (doubles while probes keep losing)
        self.steps_without_spec = 0
        self.probing = False

    @property
    def prior_alpha(self) -> float:
        return self.service.alpha(self.first_prior)

    def observe(self, drafted: int, accepted: int) -> None:
        """One request's verdict in a step (the service-wide acceptance behind every request's prior)."""
        self.service.observe(drafted, accepted, decay=0.995)

    def choose(self, batch: Sequence[Request]) -> int:
        """The step's k: each request r then drafts min(k, r.k) tokens."""
        max_k = max((r.k for r in batch), default=0)
        if self.mode == FIXED or max_k == 0:
            return max_k
        best_k, best = 0, -1.0
        for k in range(max_k + 1):
            goodput = self.goodput(batch, k)
            if goodput is None:
                return k  # no verify cost measured at or below this width for this batch: measure it
            if goodput > best:
                best_k, best = k, goodput
        if best_k == 0:
            self.steps_without_spec += 1
            # A probe is two speculative steps: the first one catches the draft up (not a cost sample),
            # the second one measures a steady round.
            if self.steps_without_spec >= self.probe_gap or self.probing:
                self.probing = not self.probing
                if not self.probing:  # the probe's second step: plain still won after the first
                    self.probe_gap = min(2 * self.probe_gap, self.max_probe_every)
                self.steps_without_spec = 0
                return max_k
        else:
            self.steps_without_spec = 0
            self.probing = False
            self.probe_gap = self.probe_every
        return best_k

    def goodput(self, batch: Sequence[Request], k: int) -> float | None:
        seconds = self.costs.verify_seconds(len(batch), k + 1)
        if seconds is None:
            return None
        seconds += self.costs.draft_seconds(len(batch), k)
        prior = self.prior_alpha
        tokens = sum(expected_tokens(r.spec.alpha(prior), min(k, r.k)) for r in batch)
        return tokens / max(seconds, 1e-9)
