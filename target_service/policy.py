"""How many draft tokens to ask for in a step: fixed, or the goodput-maximising k (SmartSpec-style).

Speculation pays when the tokens it adds per step outweigh what it costs: the wider verify forward and
the wait for the draft. At batch 1 the verify is memory-bound and k = 4 is nearly free; at batch 64 it is
compute-bound and a width-5 forward costs several plain steps. The adaptive policy picks, per step, the
k in [0, max k of the batch] that maximises

    goodput(k) = sum_r E_r(min(k, k_r)) / step_seconds(B, k)

with E_r(k) = (1 - a_r^(k+1)) / (1 - a_r) the expected tokens of request r at per-token acceptance a_r.

step_seconds is measured as whole steps: per (batch bucket, k), the median wall time of recent steady
steps, from the step's start to the end of its commit. Parts alone mislead: on two TP=2 services the
verify plus the draft wait said k = 4 paid at B=1 while whole steps ran 2.3x a plain step for 1.56
tokens. A k never timed at a bucket is estimated from its parts: the verify of its width (start-up
timing, then real steps; an unmeasured width counts as the nearest measured one below it, so the
policy tries it once), the draft wait at that k (steady exchanges only: an ask that starts a request
or catches the draft up costs a prefill, not a round) and the host residue (a timed step less those
two). Draft wait and residue come from the nearest k and the nearest bucket measured; with none at all
the draft counts as free, so a new service speculates and learns. A timed k the policy has stopped
choosing is re-timed now and then (REFRESH_AGE), so a figure from the warm-up does not hold it off.

Whether to speculate at all is measured, not estimated: per batch bucket a `ModeGate` runs windows of
16 steps with speculation on (the model's best k >= 1) or off (k = 0), compares their output tokens per
second, keeps the better and tries the other every 16 windows. The model alone misjudged both ways, as
whole steps in one mode cost what they cost only while the service stays in it: on the TP=2 H200 pair
it kept k = 3.9 at 0.65-0.78x plain (k = 0 was never timed; its estimate, the start-up verify plus the
host residue of speculative steps, stayed too high); once plain steps were timed, on one H200 at B=1 it
chose k = 0 at 0.86-0.91x (speculative steps timed between plain ones missed the pipelined steady state,
5.8 ms against 4.9, and the running acceptance read 0.51-0.65 against the 0.79 measured). The first
window of a bucket follows the model. Greedy output never depends on k: verification is lossless for
any k.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from target_service.request import Request, SpecStats

FIXED, ADAPTIVE = "fixed", "adaptive"
# Plain steps after a speculative one (or a fallback that waited for the draft) that are not timed as
# k = 0: the draft may still be running the round it started after its last answer (draft-ahead: 5.3 ms
# on GPUs it shared with the target at TP=2, against a 2.7 ms plain step).
PLAIN_SETTLE = 2
# A timed k that the policy stops choosing keeps its old median, which may date from the warm-up (on one
# H200 at B=1 the k = 4 entry said 7.0 ms while steady k = 4 steps took 5.0: the policy sat at k = 3, below
# fixed k = 4). So once a timed k within REFRESH_WITHIN of the best estimated goodput has gone REFRESH_AGE
# steady steps at its bucket without a sample, it runs REFRESH_STEPS steps and its old samples are dropped.
REFRESH_AGE, REFRESH_STEPS, REFRESH_WITHIN = 64, 4, 0.6


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits for one request drafting k tokens at per-token acceptance alpha."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Medians(dict):
    """key -> median of the last `window` observations of that key."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.recent: dict = {}

    def observe(self, key, seconds: float) -> None:
        recent = self.recent.setdefault(key, collections.deque(maxlen=self.window))
        recent.append(seconds)
        self[key] = statistics.median(recent)


class StepCosts:
    """Recent step costs, keyed by (batch bucket, width) for the verify, (batch bucket, k) for the draft
    wait and the whole step, and batch bucket for the host residue: the median of the last `window`
    observations, so a one-off stall (a slow draft round, a GC pause) does not swing k."""

    def __init__(self, batch_buckets: Sequence[int], window: int = 16):
        self.batch_buckets = list(batch_buckets)
        self.verify = Medians(window)  # (bucket, width) -> the verify forward
        self.draft = Medians(window)  # (bucket, k) -> the wait for the draft's answer
        self.step = Medians(window)  # (bucket, k) -> a whole steady step
        self.residue = Medians(window)  # bucket -> a step's wall less its verify and draft wait
        self.steps_at: collections.Counter = collections.Counter()  # bucket -> steady steps timed
        self.timed_at: dict[tuple[int, int], int] = {}  # (bucket, k) -> steps_at[bucket] at its last

    def bucket(self, batch: int) -> int:
        i = bisect.bisect_left(self.batch_buckets, batch)
        return self.batch_buckets[min(i, len(self.batch_buckets) - 1)]

    def _distance(self, a: int, b: int) -> int:
        return abs(self.batch_buckets.index(a) - self.batch_buckets.index(b))

    def observe_verify(self, batch: int, width: int, seconds: float) -> None:
        self.verify.observe((self.bucket(batch), width), seconds)

    def observe_draft(self, batch: int, k: int, seconds: float) -> None:
        self.draft.observe((self.bucket(batch), k), seconds)

    def observe_step(self, batch: int, k: int, seconds: float, verify: float, draft_wait: float) -> None:
        """A steady step's wall time at k, and its parts (what the parts miss is the host residue)."""
        b = self.bucket(batch)
        self.step.observe((b, k), seconds)
        self.residue.observe(b, max(0.0, seconds - verify - draft_wait))
        self.steps_at[b] += 1
        self.timed_at[b, k] = self.steps_at[b]

    def age(self, batch: int, k: int) -> float:
        """Steady steps timed at this bucket since k's last sample there (inf: never timed)."""
        b = self.bucket(batch)
        last = self.timed_at.get((b, k))
        return math.inf if last is None else self.steps_at[b] - last

    def restart(self, batch: int, k: int) -> None:
        """k's next samples at this bucket replace its old ones (its median stays until the first)."""
        b = self.bucket(batch)
        self.step.recent.pop((b, k), None)
        self.timed_at[b, k] = self.steps_at[b]

    @staticmethod
    def _nearest_below(table: dict, b: int, n: int) -> float | None:
        known = [(m, s) for (bb, m), s in table.items() if bb == b and m <= n]
        return max(known)[1] if known else None

    def verify_seconds(self, batch: int, width: int) -> float | None:
        b = self.bucket(batch)
        seconds = self.verify.get((b, width))  # the common case: no scan of the table (every step)
        return seconds if seconds is not None else self._nearest_below(self.verify, b, width)

    def draft_seconds(self, batch: int, k: int) -> float:
        """The wait for a k-token proposal; an unmeasured k costs what the nearest measured k did (the
        wait is mostly the fixed round trip, not the k draft positions), at the nearest batch bucket
        measured (a bucket met for the first time would otherwise take the draft as free)."""
        b = self.bucket(batch)
        if k == 0:
            return 0.0
        if (b, k) in self.draft:
            return self.draft[b, k]
        known = [(self._distance(bb, b), abs(m - k), s) for (bb, m), s in self.draft.items()]
        return min(known)[2] if known else 0.0

    def residue_seconds(self, batch: int) -> float:
        """The host residue of a step at this bucket, or at the nearest bucket that has one."""
        b = self.bucket(batch)
        if b in self.residue:
            return self.residue[b]
        known = [(self._distance(bb, b), s) for bb, s in self.residue.items()]
        return min(known)[1] if known else 0.0

    def step_seconds(self, batch: int, k: int) -> float | None:
        """A whole step at k: timed, or its parts plus the bucket's host residue (None: no verify cost
        at or below width k + 1 is known for this batch)."""
        b = self.bucket(batch)
        if (b, k) in self.step:
            return self.step[b, k]
        verify = self.verify_seconds(batch, k + 1)
        if verify is None:
            return None
        return verify + self.draft_seconds(batch, k) + self.residue_seconds(batch)

    def describe(self) -> str:
        """Each timed (bucket, k): whole step ms, then verify + draft wait + residue ms (for the log)."""
        out = []
        for (b, k), seconds in sorted(self.step.items()):
            verify = self.verify_seconds(b, k + 1) or 0.0
            parts = (verify, self.draft_seconds(b, k), self.residue_seconds(b))
            out.append(f"({b},{k}) {seconds * 1e3:.2f} = " + " + ".join(f"{p * 1e3:.2f}" for p in parts))
        return "; ".join(out)


class SpeculationPolicy:
    def __init__(
        self,
        mode: str,
        costs: StepCosts,
        prior_alpha: float = 0.7,
        gate: bool = True,
    ):
        if mode not in (FIXED, ADAPTIVE):
            raise ValueError(f"--speculation-policy: {mode!r} is not one of fixed, adaptive")
        self.mode = mode
        self.costs = costs
        # A new request's acceptance starts from the service's recent acceptance (all requests), which
        # starts from `prior_alpha`: short requests then do not each re-learn a bad draft.
        self.first_prior = prior_alpha
        self.service = SpecStats()
        # Speculation on or off per batch bucket, by measured throughput (None: the model decides).
        self.gate = ModeGate(costs) if gate and mode == ADAPTIVE else None
        self.gated = False
        self.refreshing: dict[int, tuple[int, int]] = {}  # bucket -> (k, steps left) of a refresh

    @property
    def prior_alpha(self) -> float:
        return self.service.alpha(self.first_prior)

    def observe(self, drafted: int, accepted: int) -> None:
        """One request's verdict in a step (the service-wide acceptance behind every request's prior)."""
        self.service.observe(drafted, accepted, decay=0.995)

    def choose(self, batch: Sequence[Request]) -> int:
        """The step's k: each request r then drafts min(k, r.k) tokens."""
        max_k = max((r.k for r in batch), default=0)
        self.gated = False  # the step this chooses for is one of the gate's (observe_step)
        if self.mode == FIXED or max_k == 0:
            return max_k
        if self.gate is not None and self.gate.mode(len(batch)) is False:
            self.gated = True  # off for this window: no estimate needed (a plain step's host time)
            return 0
        tokens = self.batch_tokens(batch, max_k)
        goodput = []
        for k in range(max_k + 1):
            seconds = self.costs.step_seconds(len(batch), k)
            if seconds is None:
                return k  # no verify cost measured at or below this width for this batch: measure it
            goodput.append(tokens[k] / max(seconds, 1e-9))
        best_k = max(range(max_k + 1), key=goodput.__getitem__)
        self.gated = self.gate is not None
        if self.gate is not None:
            if not self.gate.want(len(batch), default=best_k > 0):
                return 0
            # On: the model's best k >= 1 (measured windows may say speculation pays where the model says
            # not).
            best_k = max(range(1, max_k + 1), key=goodput.__getitem__)
        return self._refresh(len(batch), best_k, goodput) if best_k else 0

    def _refresh(self, batch: int, best: int, goodput: list[float]) -> int:
        """`best`, or a close rival k whose timing has gone stale (REFRESH_AGE), for REFRESH_STEPS steps."""
        b = self.costs.bucket(batch)
        k, left = self.refreshing.get(b, (0, 0))
        if left > 0 and k < len(goodput):
            self.refreshing[b] = (k, left - 1)
            return k
        stale = [
            k
            for k in range(1, len(goodput))
            if k != best
            and goodput[k] >= REFRESH_WITHIN * goodput[best]
            and REFRESH_AGE < self.costs.age(batch, k) < math.inf  # untimed: the parts estimate it
        ]
        if not stale:
            return best
        k = max(stale, key=lambda k: self.costs.age(batch, k))
        self.costs.restart(batch, k)
        self.refreshing[b] = (k, REFRESH_STEPS - 1)
        return k

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        """One step's output tokens and wall time (the gate's windows; not steps no request could
        speculate in)."""
        if self.gated:
            self.gate.observe(batch, tokens, seconds)

    def explain(self, batch: Sequence[Request]) -> str:
        """Per k: the step seconds `choose` would use, the expected tokens and their ratio (the log)."""
        max_k = max((r.k for r in batch), default=0)
        tokens = self.batch_tokens(batch, max_k)
        out = []
        for k in range(max_k + 1):
            seconds = self.costs.step_seconds(len(batch), k)
            timed = "timed" if (self.costs.bucket(len(batch)), k) in self.costs.step else "parts"
            rate = f"{tokens[k] / seconds:.0f} tok/s" if seconds else "?"
            ms = f"{seconds * 1e3:.2f} ms" if seconds else "?"
            out.append(f"k={k} {ms} ({timed}) x {tokens[k]:.2f} tok = {rate}")
        return "; ".join(out)

    def batch_tokens(self, batch: Sequence[Request], max_k: int) -> list[float]:
        """Expected tokens of the whole batch for a step at each k in 0..max_k (request r drafts
        min(k, r.k)): one pass over the batch, since this runs every step."""
        prior = self.prior_alpha
        totals = [0.0] * (max_k + 1)
        for r in batch:
            a, tokens, power = r.spec.alpha(prior), 1.0, 1.0
            for k in range(max_k + 1):
                if 0 < k <= r.k:
                    power *= a
                    tokens += power
                totals[k] += tokens
        return totals


@dataclass
class _Window:
    on: bool
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    windows: int = 0
    since: int = 0  # windows since the other mode was last tried
    every: int = 0  # windows between tries of the other mode (0: not yet set)
    trying: bool = False  # this window tries the other mode


class ModeGate:
    """A mode on or off per batch bucket, chosen by measured output (adaptive policy): speculation
    itself (SpeculationPolicy.gate), and the draft's branches.

    Branches move the draft's round off the target's critical path, but the branch round (k + 1 rows per
    request) can outlast the target's step, or share its GPUs and slow its verify: on two H200s with the
    draft and the target both TP=2 on both, a branch round took 5.6 ms against a 2.7 ms plain step. So
    the target runs windows of `window` steps with the mode on or off, compares output tokens per second
    of each (the first `settle` steps of a window are not counted: a switch takes a step to show), keeps
    the better and tries the other after `explore_every` windows. A bucket's first window is `default`.
    Each try the other mode loses doubles the wait before the next (up to `max_explore_every` windows): a
    try costs a window in the worse mode, and a clear loser need not be re-checked every 16 windows. The
    mode in use is measured in every window, so a drop in its own rate switches at once (and the waits
    start over); only a rise of the other waits for a try.
    """

    def __init__(
        self,
        costs: StepCosts,
        window: int = 16,
        settle: int = 2,
        explore_every: int = 16,
        max_explore_every: int = 64,
    ):
        self.costs = costs
        self.window, self.settle = window, settle
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, on) -> tokens per second, smoothed
        self.state: dict[int, _Window] = {}

    def describe(self) -> str:
        """Per bucket: the current mode and the measured rates on / off, tokens per second (the log)."""
        out = []
        for b, w in sorted(self.state.items()):
            on, off = (self.rate.get((b, m)) for m in (True, False))
            rates = "/".join("?" if r is None else f"{r:.0f}" for r in (on, off))
            out.append(f"B<={b} {'on' if w.on else 'off'} (on/off {rates} tok/s, window {w.windows})")
        return ", ".join(out)

    def mode(self, batch: int) -> bool | None:
        """The bucket's mode now (None: no window there yet)."""
        w = self.state.get(self.costs.bucket(batch))
        return None if w is None else w.on

    def want(self, batch: int, default: bool = True) -> bool:
        return self.state.setdefault(self.costs.bucket(batch), _Window(default)).on

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One step's output tokens and wall time."""
        bucket = self.costs.bucket(batch)
        w = self.state.setdefault(bucket, _Window(True))
        w.steps += 1
        if w.steps > self.settle:
            w.tokens += tokens
            w.seconds += seconds
        if w.steps < self.window or w.seconds <= 0:
            return
        key = (bucket, w.on)
        rate = w.tokens / w.seconds
        self.rate[key] = rate if key not in self.rate else 0.5 * self.rate[key] + 0.5 * rate
        on, off = self.rate.get((bucket, True)), self.rate.get((bucket, False))
        every = w.every or self.explore_every
        if on is None or off is None:
            self.state[bucket] = _Window(on is None, windows=w.windows + 1, every=every)
            return
        best = on >= off
        if best != (w.on != w.trying):  # the better mode changed (a try runs the other one): start over
            every, since = self.explore_every, 0
        else:  # the same: a try that lost again waits twice as long for the next
            every = min(2 * every, self.max_explore_every) if w.trying else every
            since = w.since + 1
        trying = since >= every
        self.state[bucket] = _Window(
            (not best) if trying else best,
            windows=w.windows + 1,
            since=0 if trying else since,
            every=every,
            trying=trying,
        )
