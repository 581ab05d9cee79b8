"""What a step costs, as the adaptive policy sees it: whole steps and their parts, per batch bucket.

A step is measured whole: per (batch bucket, k), the median wall time of recent steady
steps, from the step's start to the end of its commit. Parts alone mislead: on two TP=2 services the
verify plus the draft wait said k = 4 paid at B=1 while whole steps ran 2.3x a plain step for 1.56
tokens. A k never timed at a bucket is interpolated between the buckets on either side that timed it,
else estimated from its parts: the verify of its width (start-up timing, then real steps; an unmeasured
width counts as the nearest measured one below it, so the policy tries it once), the draft wait at that
k (steady exchanges only: an ask that starts a request or catches the draft up costs a prefill, not a
round) and the host residue (a timed step less those two), scaled by whole / parts of the nearest timed
step. Draft wait and residue come from the nearest k and the nearest bucket measured; with none at all
the draft counts as free, so a new service speculates and learns.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from collections.abc import Sequence

# Plain steps after a speculative one (or a fallback that waited for the draft) that are not timed as
# k = 0: the draft may still be running the round it started after its last answer (draft-ahead: 5.3 ms
# on GPUs it shared with the target at TP=2, against a 2.7 ms plain step).
PLAIN_SETTLE = 2
# Whole steady steps per (bucket, k) in a median. Two k's can be a few per cent apart in goodput (k = 3
# and k = 4 of Qwen2.5-Coder-1.5B's feature draft at 16 streams: 3.5 %) while single steps spread by
# 10 % or more; the better k then ran a median 84 % of the steps with medians of 16 steps in the
# simulated policy, 93 % with 32 (tests/test_policy.py).
STEP_WINDOW = 32


class Medians(dict):
    """key -> median of the last `window` observations of that key (low: of an even count, the lower of
    the middle two rather than their mean)."""

    def __init__(self, window: int, low: bool = False):
        super().__init__()
        self.window = window
        self.recent: dict = {}
        self._median = statistics.median_low if low else statistics.median

    def observe(self, key, seconds: float) -> None:
        recent = self.recent.setdefault(key, collections.deque(maxlen=self.window))
        recent.append(seconds)
        self[key] = self._median(recent)


class StepCosts:
    """Recent step costs, keyed by (batch bucket, width) for the verify, (batch bucket, k) for the draft
    wait and the whole step, and batch bucket for the host residue: the median of the last `window`
    observations, so a one-off stall (a slow draft round, a GC pause) does not swing k."""

    def __init__(self, batch_buckets: Sequence[int], window: int = 16):
        self.batch_buckets = list(batch_buckets)
        self._index = {b: i for i, b in enumerate(self.batch_buckets)}
        # The verify's lower median: a width's start-up timing and one stalled served sample (107 ms beside
        # ~2) would average into a price that keeps the policy off that k, so no sample comes to replace
        # it; a price too low corrects itself (the k is chosen and its whole steps timed).
        self.verify = Medians(window, low=True)  # (bucket, width) -> the verify forward
        self.draft = Medians(window)  # (bucket, k) -> the wait for the draft's answer
        self.step = Medians(STEP_WINDOW)  # (bucket, k) -> a whole steady step
        self.residue = Medians(window)  # bucket -> a step's wall less its verify and draft wait
        self.startup: dict[tuple[int, int], float] = {}  # (bucket, width) -> verify timed at start-up
        self.served: set[tuple[int, int]] = set()  # (bucket, width) of verifies timed in served steps
        self.drift: dict[int, float] = {}  # bucket -> served / start-up verify, its latest served width
        self.steps_at: collections.Counter = collections.Counter()  # bucket -> steady steps timed
        self.timed_at: dict[tuple[int, int], int] = {}  # (bucket, k) -> steps_at[bucket] at its last
        self._nearest_draft: dict[tuple[int, int], tuple[int, int]] = {}  # (bucket, k) -> draft key used
        self._draft_keys = 0  # len(self.draft) when _nearest_draft was filled

    def bucket(self, batch: int) -> int:
        if batch in self._index:  # a bucket already (most calls inside this class)
            return batch
        i = bisect.bisect_left(self.batch_buckets, batch)
        return self.batch_buckets[min(i, len(self.batch_buckets) - 1)]

    def distance(self, a: int, b: int) -> int:
        """How many buckets apart two buckets are."""
        return abs(self._index[a] - self._index[b])

    def observe_startup_verify(self, batch: int, width: int, seconds: float) -> None:
        """A verify timed at start-up (TargetRunner.time_steps): its only sample until steps of that width
        are served, and then scaled by the drift the served widths show (`verify_seconds`)."""
        key = (self.bucket(batch), width)
        self.startup[key] = seconds
        self.verify.observe(key, seconds)

    def observe_verify(self, batch: int, width: int, seconds: float) -> None:
        key = (self.bucket(batch), width)
        self.verify.observe(key, seconds)
        self.served.add(key)
        if key in self.startup:
            self.drift[key[0]] = self.verify[key] / self.startup[key]

    def observe_draft(self, batch: int, k: int, seconds: float) -> None:
        self.draft.observe((self.bucket(batch), k), seconds)

    def observe_step(self, batch: int, k: int, seconds: float, verify: float, draft_wait: float) -> None:
        """A steady step's wall time at k, and its parts (what the parts miss is the host residue)."""
        b = self.bucket(batch)
        self.step.observe((b, k), seconds)
        self.residue.observe(b, max(0.0, seconds - verify - draft_wait))
        self.steps_at[b] += 1
        self.timed_at[b, k] = self.steps_at[b]

    def age(self, batch: int, k: int) -> int:
        """Steady steps timed at this bucket since k's last sample there (never timed: since the first)."""
        b = self.bucket(batch)
        return self.steps_at[b] - self.timed_at.get((b, k), 0)

    def timed(self, batch: int, k: int) -> bool:
        """Whether whole steady steps at k were timed at this bucket (else its cost is its parts)."""
        return (self.bucket(batch), k) in self.step

    def samples(self, batch: int, k: int) -> int:
        """Whole steady steps at k timed at this bucket since its last restart (at most the window)."""
        return len(self.step.recent.get((self.bucket(batch), k), ()))

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
        if seconds is None:
            return self._nearest_below(self.verify, b, width)
        if (b, width) not in self.served and b in self.drift:
            # Start-up timings can be off by a factor (taken while a draft on the same GPU captures its own
            # graphs). A width never served takes the ratio a served one shows.
            return seconds * self.drift[b]
        return seconds

    def draft_seconds(self, batch: int, k: int) -> float:
        """The wait for a k-token proposal; an unmeasured k costs what the nearest measured k did (the
        wait is mostly the fixed round trip, not the k draft positions), at the nearest batch bucket
        measured (a bucket met for the first time would otherwise take the draft as free)."""
        b = self.bucket(batch)
        if k == 0:
            return 0.0
        if (b, k) in self.draft:
            return self.draft[b, k]
        if len(self.draft) != self._draft_keys:  # a (bucket, k) measured for the first time: the nearest
            self._nearest_draft.clear()  # ones may change (keys are never dropped)
            self._draft_keys = len(self.draft)
        key = self._nearest_draft.get((b, k))
        if key is None:
            known = [(self.distance(bb, b), abs(m - k), (bb, m)) for bb, m in self.draft]
            if not known:
                return 0.0
            key = self._nearest_draft[b, k] = min(known)[2]
        return self.draft[key]

    def nearest(self, by_bucket: dict[int, float], batch: int) -> float | None:
        """A value of `by_bucket` at this batch's bucket, else at the nearest one (None: it is empty)."""
        b = self.bucket(batch)
        if b in by_bucket:
            return by_bucket[b]
        known = [(self.distance(bb, b), s) for bb, s in by_bucket.items()]
        return min(known)[1] if known else None

    def residue_seconds(self, batch: int) -> float:
        """The host residue of a step at this bucket, or at the nearest bucket that has one."""
        return self.nearest(self.residue, batch) or 0.0

    def step_seconds(self, batch: int, k: int) -> float | None:
        """A whole step at k: timed; else between the buckets on either side that timed k (linear in the
        batch); else its parts (`parts_seconds`) scaled by whole / parts of the nearest timed step (None:
        no verify cost at or below width k + 1 is known for this batch).

        The parts alone run 1.4-2.9x the timed steps (1.5B preset, colocated): the draft wait of a steady
        exchange is a whole round trip, which draft-ahead hides in most steps. Unscaled, a batch draining
        through a bucket sits at the one k it timed there and never tries an untimed one."""
        b = self.bucket(batch)
        if (b, k) in self.step:
            return self.step[b, k]
        between = self._between(b, k)
        if between is not None:
            return between
        parts = self.parts_seconds(b, k)
        if parts is None:
            return None
        # The nearest timed step: the nearest bucket first, then the nearest k; speculative steps calibrate
        # speculative estimates, plain steps plain ones (no draft wait). A timed step always has a verify
        # (the scheduler times it first), so its parts are known.
        nearest = min(
            ((self.distance(bb, b), bb, abs(kk - k), kk) for bb, kk in self.step if (kk > 0) == (k > 0)),
            default=None,
        )
        if nearest is not None:
            _, bb, _, kk = nearest
            its_parts = self.parts_seconds(bb, kk)
            if its_parts:
                return parts * self.step[bb, kk] / its_parts
        return parts

    def parts_seconds(self, batch: int, k: int) -> float | None:
        """A step at k from its parts: the verify of its width, the draft wait and the bucket's host
        residue (None: no verify cost at or below width k + 1 is known for this batch)."""
        verify = self.verify_seconds(batch, k + 1)
        if verify is None:
            return None
        return verify + self.draft_seconds(batch, k) + self.residue_seconds(batch)

    def _between(self, b: int, k: int) -> float | None:
        """k's timed step at the nearest buckets below and above b, interpolated at b's batch size."""
        timed = [bb for bb, kk in self.step if kk == k]
        lo = max((bb for bb in timed if bb < b), default=None)
        hi = min((bb for bb in timed if bb > b), default=None)
        if lo is None or hi is None:
            return None
        low, high = self.step[lo, k], self.step[hi, k]
        return low + (high - low) * (b - lo) / (hi - lo)

    def describe(self) -> str:
        """Each timed (bucket, k): whole step ms, then verify + draft wait + residue ms (for the log)."""
        out = []
        for (b, k), seconds in sorted(self.step.items()):
            verify = self.verify_seconds(b, k + 1) or 0.0
            parts = (verify, self.draft_seconds(b, k), self.residue_seconds(b))
            out.append(f"({b},{k}) {seconds * 1e3:.2f} = " + " + ".join(f"{p * 1e3:.2f}" for p in parts))
        return "; ".join(out)


class AdmissionCosts:
    """What starting requests adds to a step beyond a steady one, per batch bucket and mode (plain or
    speculative), and how many requests start per output token (the workload's, whatever the mode).

    The speculation gate rates steady steps only (steps that start requests would decide a window by
    their bursts), so it does not see what speculation adds to a start: the draft's prefill of the
    prompt before the verify, and, because speculative requests finish at scattered steps, starts a few
    at a time where plain decoding starts them in waves and prices a prefill over many. `surcharge`
    charges that extra to the gate's speculative steps, at the rate requests start: with the 0.5B as a
    classic draft of Qwen2.5-Coder-1.5B at 64 streams, steady speculative steps ran 1.21x plain's rate
    while 31 % of speculative steps started a request at 14.5 ms against 8.4, and adaptive ran 0.89x."""

    # The start rate's horizon in output tokens: several requests' lives at any batch (64 streams of
    # 192-token requests emit 12 288 tokens a wave), so waves of plain starts do not swing it.
    HORIZON_TOKENS = 65536.0

    def __init__(self, costs: StepCosts, window: int = 32):
        self.costs = costs
        # speculative -> bucket -> seconds a step spent beyond its steady median, per request it started
        self.per_start = {True: Medians(window), False: Medians(window)}
        self.starts = self.tokens = 0.0  # requests started and tokens emitted, decayed per token
        # A start's sample waits for the next step, which its work still slows (START_SETTLE):
        # (speculative, bucket, extra seconds so far, requests started), or None.
        self.open: tuple[bool, int, float, int] | None = None

    def observe(self, batch: int, k: int, started: int, emitted: int, wall: float, sample: bool) -> None:
        """One step at k: its starts and tokens, and, when it started requests, `sample` (a step of its
        mode's steady state: no catch-up of the draft after plain steps in it, no draft round after
        speculative ones under it) and k's steady step is timed at its bucket, its extra per start: its
        own wall beyond the steady median and the next step's, unless that one starts requests too or
        runs the other mode."""
        keep = math.exp(-emitted / self.HORIZON_TOKENS)
        self.starts = self.starts * keep + started
        self.tokens = self.tokens * keep + emitted
        b = self.costs.bucket(batch)
        steady = self.costs.step.get((b, k))
        if self.open is not None:
            speculative, bucket, extra, count = self.open
            if not started and steady is not None and (k > 0) == speculative:
                extra += max(0.0, wall - steady)
            self.per_start[speculative].observe(bucket, extra / count)
            self.open = None
        if started and sample and steady is not None:
            self.open = (k > 0, b, max(0.0, wall - steady), started)

    def surcharge(self, batch: int, emitted: int) -> float | None:
        """Seconds to add to a steady speculative step of `emitted` tokens: speculation's extra per start
        over plain's times the starts those tokens bring; None while speculation's starts are not measured
        at this bucket. Plain's extra is this bucket's, else the nearest bucket's, else taken as none (while
        speculation is held on, plain starts are rare)."""
        speculative = self.per_start[True].get(self.costs.bucket(batch))
        if speculative is None or self.tokens <= 0.0:
            return None
        plain = self.costs.nearest(self.per_start[False], batch) or 0.0
        return max(0.0, speculative - plain) * emitted * self.starts / self.tokens
