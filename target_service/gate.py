"""A mode on or off per batch bucket, chosen by measured output tokens per second (adaptive policy).

Whether to speculate at all is measured, not estimated: per batch bucket a `ModeGate` runs windows of
16 steps with speculation on (the model's best k >= 1) or off (k = 0), compares their output tokens per
second, keeps the better and tries the other now and then. The model alone misjudged both ways, as
whole steps in one mode cost what they cost only while the service stays in it: on the TP=2 H200 pair
it kept k = 3.9 at 0.65-0.78x plain (k = 0 was never timed; its estimate, the start-up verify plus the
host residue of speculative steps, stayed too high); once plain steps were timed, on one H200 at B=1 it
chose k = 0 at 0.86-0.91x (speculative steps timed between plain ones missed the pipelined steady state,
5.8 ms against 4.9, and the running acceptance read 0.51-0.65 against the 0.79 measured). The first
window of a bucket follows the model. The scheduler runs a second gate for the draft's branches.
"""

from __future__ import annotations

from dataclasses import dataclass

from target_service.step_costs import StepCosts

# A window whose rate after EARLY_STEPS counted steps is below EARLY_LOSS of the other mode's ends there:
# on the real SmolLM2 pair (a 1 ms plain step, a 1.9 ms round trip to the draft) speculation runs at
# ~0.65x plain, and the gate's 16-step windows with it on cost adaptive 0.64-0.79x plain in 128-token
# runs. Four steps of 0.7x against a rate measured over 14 are well outside step-to-step noise (~10 %).
# 0.75, not 0.7 (twentieth session): at B=64 on one H200 plain runs at ~0.65x speculation's raw rate, just
# above 0.7 of its handicapped one, so the gate's tries of plain ran whole 16-step windows
# (bench/gate_sim.py: 6 steps at 0.75). Adaptive / plain at B=64: 1.35-1.42 in the 6 repeats run with
# 0.75, 1.15-1.42 in 6 with 0.7 (runs differ about as much: docs/benchmarks.md, twentieth session).
EARLY_STEPS, EARLY_LOSS = 4, 0.75
# The mode held best stays so until its rate is this fraction below the other's (a try must beat it by as
# much). Window rates at B=64 on one H200 ranged 17.5-23.8 k tok/s with speculation off while the two
# modes' rates stood within 7 % of each other: every dip of one window below the other mode's rate
# switched (and a switch is tried back after one window), so speculation ran a fifth of the windows
# where it lost (the tenth session's run: adaptive 0.83-0.88x plain, mean k 0.76 of 4; docs/benchmarks.md).
HYSTERESIS = 0.05
# The first `settle` steps of a window stay uncounted in both modes, though the first speculative step
# after plain ones carries the draft's catch-up on every token since (5-19 ms at B=1, 9-28 ms at B=64 on
# one H200, against 2-10 ms steady): counting it (tried in the eleventh session) charged a whole switch
# to each 30-45 ms window, and at B=1 and 16 the gate then turned speculation off (0.99x and 0.94x plain)
# where fixed k = 4 ran 1.25x and 1.22x. A switch is a one-off cost; the margin above keeps them rare.
# Speculation's windows are rated at (1 - SPECULATION_HANDICAP) of their measure (the speculation gate's
# `on_handicap`): it must win by that much to be chosen. Its costs fall partly outside its windows: the
# draft's catch-up when it is turned back on, and the requests it puts out of step, which then finish
# over a tail of steps at a falling batch size where plain decoding finishes them together. One H200,
# B=64 (twelfth session): window rates 21.4-22.8 k tok/s on against 20.4-23.8 k off (a tie), so the
# gate held speculation for 98 of 151 steps, and the tail (17 steps at 13.8 k tok/s) left adaptive at
# 0.90x plain. At B=1-16 speculation's windows win by 16-40 %. In tests/test_policy.py's simulated
# B=64 windows (noise sigma 0.08) a tie then runs speculation 4-19 % of the time (42-76 % without), one
# that wins by 15 % 87-97 % (98-99 %), by 25 % 98-99 %.
SPECULATION_HANDICAP = 0.08
# A counted step's seconds are capped at STALL_CAP times its mode's mean step in the bucket: a single
# stalled step is not the mode's rate. One H200, B=64 (twelfth session): the two plain windows that read
# low (21.4 k and 19.5 k tok/s against 23-26 k) each held one step of 8.9-9.7 ms among ~2.6 ms ones; the
# first switched speculation on for 32 steps (that repeat ran 0.85x plain). A mode whose steps all slow
# down is followed within a window or two: the cap moves with its mean.
STALL_CAP = 2.0
WINDOW = 16  # steps per window (a mode's first window in a bucket is a half-window warm-up)


@dataclass
class _Window:
    on: bool
    steps: int = 0
    tokens: float = 0.0  # scaled to the bucket's whole batch (observe)
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
    the better (the mode on handicapped by `on_handicap`) and tries the other after `explore_every`
    windows. A bucket's first window is `default`.
    Each try the other mode loses doubles the wait before the next (up to `max_explore_every` windows): a
    try costs a window in the worse mode, and a clear loser need not be re-checked every 16 windows. The
    mode in use is measured in every window, so a drop in its own rate switches at once (and the waits
    start over); only a rise of the other waits for a try.

    Two things keep a first impression from sticking (one H200, B=1: the first window with speculation
    on ran 413 tok/s while the policy was still timing its k's, against 580 for fixed k = 4; off won,
    the try 16 windows later averaged its 577 with that 413 and lost again, and the back-off then held
    speculation off for the rest of the run at 0.95x plain): the first window of each mode in a bucket
    is a warm-up (half a window), not counted; and a rate last measured windows ago is replaced by a new
    window's, not averaged with it (smoothing only joins consecutive windows of one mode). A window that
    is clearly losing ends early (EARLY_STEPS, EARLY_LOSS), and a new bucket starts from its nearest
    measured neighbour's better mode instead of measuring both (`_first_window`).
    """

    def __init__(
        self,
        costs: StepCosts,
        window: int = WINDOW,
        settle: int = 2,
        explore_every: int = 16,
        max_explore_every: int = 64,
        on_handicap: float = 0.0,
    ):
        self.costs = costs
        self.on_handicap = on_handicap  # the mode on is rated at (1 - on_handicap) of its measured rate
        self.window, self.settle = window, settle
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, on) -> tokens per second, smoothed
        self.step_seconds: dict[tuple[int, bool], float] = {}  # (bucket, on) -> mean step wall time
        self.rated_at: dict[tuple[int, bool], int] = {}  # (bucket, on) -> the window that last measured it
        self.ratio: dict[int, float] = {}  # bucket -> other / better mode's rate, from the nearest bucket
        self.state: dict[int, _Window] = {}

    def describe(self) -> str:
        """Per bucket: the current mode and the rates on / off, tokens per second (the log; ~: estimated
        from the nearest bucket's ratio, ?: not known yet)."""
        out = []
        for b, w in sorted(self.state.items()):
            rates = "/".join(self._rate_text((b, m)) for m in (True, False))
            out.append(f"B<={b} {'on' if w.on else 'off'} (on/off {rates} tok/s, window {w.windows})")
        return ", ".join(out)

    def _rate_text(self, key: tuple[int, bool]) -> str:
        rate = self.rate.get(key)
        if rate is None:
            return "?"
        return f"{'~' if self.rated_at.get(key, 0) < 0 else ''}{rate:.0f}"

    def mode(self, batch: int) -> bool | None:
        """The bucket's mode now (None: no window there yet)."""
        w = self.state.get(self.costs.bucket(batch))
        return None if w is None else w.on

    def _window(self, bucket: int, default: bool) -> _Window:
        w = self.state.get(bucket)  # not setdefault: that would build a _Window every step
        if w is None:
            w = self.state[bucket] = self._first_window(bucket, default)
        return w

    def _first_window(self, bucket: int, default: bool) -> _Window:
        """A bucket's first window: in the better mode of the nearest bucket that measured both (its
        ratio then estimates the other mode here, which waits for a try like any loser, the first one
        sooner), else `default`.
        A batch that drains through the buckets (16, 8, 4, 2, 1 as requests finish) would otherwise pay
        a window of the worse mode in each."""
        # Both modes measured there: a rate, not an estimate (rated_at -1). A mode whose warm-up ended has a
        # rated_at but no rate yet (a KeyError here failed a draining batch's running requests).
        decided = [
            (self.costs.distance(b, bucket), b)
            for b in {b for b, _ in self.rate}
            if all((b, m) in self.rate and self.rated_at[b, m] >= 0 for m in (True, False))
        ]
        if not decided:
            return _Window(default)
        near = min(decided)[1]
        on, off = self.rate[near, True], self.rate[near, False]
        self.ratio[bucket] = min(on, off) / max(on, off)  # the other mode's rate / the better one's
        # The first try comes after a quarter of the usual wait: the estimate is not a measurement here.
        return _Window(on >= off, every=max(1, self.explore_every // 4))

    def _clear_loss(self, w: _Window, other: float | None) -> bool:
        """Whether a window may end early: after EARLY_STEPS counted steps its rate is below EARLY_LOSS
        of the other mode's (a try of a clear loser then costs 6 steps, not 16)."""
        counted = w.steps - self.settle
        return other is not None and counted >= EARLY_STEPS and w.tokens < EARLY_LOSS * other * w.seconds

    def want(self, batch: int, default: bool = True) -> bool:
        return self._window(self.costs.bucket(batch), default).on

    def unmeasured(self, batch: int) -> bool:
        """Whether the bucket's current mode has never completed a measured window there (and this window
        is no try): the windows `model_says` may end."""
        bucket = self.costs.bucket(batch)
        w = self.state.get(bucket)
        return w is not None and not w.trying and (bucket, w.on) not in self.rate

    def model_says(self, batch: int, on: float, off: float) -> None:
        """The policy's model, from timed steps, rates the two modes at `on` and `off` tokens per second.
        While a mode has never completed a measured window in this bucket (its warm-up or its first
        measured window), the model rating it below EARLY_LOSS of the other ends that window after
        EARLY_STEPS steps: the model's ratio stands in for its rate (an estimate, from the other mode's
        measured rate once there is one) and it is tried after a quarter of the usual wait, as a nearest
        bucket's estimate is. Before, a mode's first windows ran their full length with nothing measured
        to lose against: on the real SmolLM2 pair's costs (1 ms step, 2 ms round trip, α 0.52) that was
        24 speculative steps at 0.6x plain, 20 % of a 128-token request (bench/host_path.py)."""
        if not self.unmeasured(batch):
            return
        bucket = self.costs.bucket(batch)
        w = self.state[bucket]
        if w.steps < self.settle + EARLY_STEPS:
            return
        mine, other = (on, off) if w.on else (off, on)
        if mine >= EARLY_LOSS * other:
            return
        measured = self.rate.get((bucket, not w.on))
        if measured is None:  # nothing measured here yet: the other mode's first window fills it in
            self.ratio[bucket] = mine / other
        else:
            self._estimate((bucket, w.on), measured * mine / other)
        every = max(1, self.explore_every // 4)
        self.state[bucket] = _Window(not w.on, windows=w.windows + 1, every=every)

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One step's output tokens and wall time. Rates are of the bucket's whole batch (tokens scaled
        by bucket / batch): a batch draining within its bucket lowers both modes' tokens per step alike,
        and unscaled, a mode then measured against the other's rate from a fuller batch looked worse.
        One H200, B=64 (twelfth session): as requests finished, plain windows at B=38-47 fell below
        speculation's rate from B=64 and switched it on for the last 8-15 steps of every run, and the
        bucket was still on when the next run's 64 requests came."""
        bucket = self.costs.bucket(batch)
        w = self._window(bucket, True)
        w.steps += 1
        if w.steps > self.settle:
            w.tokens += tokens * bucket / batch
            w.seconds += min(seconds, STALL_CAP * self.step_seconds.get((bucket, w.on), seconds))
        if w.seconds <= 0:
            return
        key = (bucket, w.on)
        if key not in self.rated_at:  # this mode's first (half) window here: a warm-up; then a measured one
            if w.steps >= self.window // 2:
                self.rated_at[key] = w.windows
                self.state[bucket] = _Window(w.on, windows=w.windows + 1, every=w.every or self.explore_every)
            return
        if not self._window_done(bucket, w) and not self._clear_loss(w, self.rate.get((bucket, not w.on))):
            return
        mine, other = self.rate.get(key), self.rate.get((bucket, not w.on))
        compared = mine is not None and other is not None  # both rated before: the margin applies
        was_best = not w.trying and compared and mine >= other
        self._record(bucket, w)
        self.state[bucket] = self._next_window(
            bucket, w, fell=was_best, margin=HYSTERESIS if compared else 0.0
        )

    def _window_done(self, bucket: int, w: _Window) -> bool:
        """A window lasts `window` steps, or, in the mode with the longer steps, as long as `window` steps
        of the other mode (at least EARLY_STEPS counted): windows are balanced in time, not steps. A
        16-step try of speculation at B=64 took 16 speculative steps of ~11 ms against 2.7 ms plain ones
        (one H200): four plain windows' time at 0.8x, and the adaptive target ran 0.85x plain there."""
        if w.steps >= self.window:
            return True
        other = self.step_seconds.get((bucket, not w.on))
        counted = w.steps - self.settle
        return other is not None and counted >= EARLY_STEPS and w.seconds >= self.window * other

    def exploring(self, batch: int) -> bool:
        """Whether the bucket's window runs a mode that is not (known to be) its better one: a try, or the
        first windows of a mode once the other is measured. Another gate's rates taken meanwhile would be
        of a mode this gate is about to leave. So one gate explores at a time: while the speculation gate
        explores, branches stay at their best mode and the branch gate counts nothing; otherwise the
        speculation gate skips speculative steps while the branch gate explores. One H200, B=1: the
        branch gate's windows without branches (385 tok/s against 755 with them) fell in the speculation
        gate's windows with speculation on, which then rated it 537 against 561 off and turned it off,
        while fixed k = 4 ran 664 against plain's 555."""
        bucket = self.costs.bucket(batch)
        w = self.state.get(bucket)
        if w is None:
            return False
        if w.trying:
            return True
        if (bucket, not w.on) not in self.rate:
            return False
        return (bucket, w.on) not in self.rate or self._held_best(bucket, w, HYSTERESIS) != w.on

    def best(self, batch: int, default: bool = True) -> bool:
        """The bucket's better mode by its rates (the one measured, while the other is not; the current
        mode while neither is), without moving its windows: what another gate's tries run beside."""
        bucket = self.costs.bucket(batch)
        on, off = self.rate.get((bucket, True)), self.rate.get((bucket, False))
        w = self.state.get(bucket)
        if on is None and off is None:
            return default if w is None else w.on
        if on is None or off is None or w is None:
            return off is None or (on is not None and on >= off)
        return self._held_best(bucket, w, HYSTERESIS)

    def _held_best(self, bucket: int, w: _Window, margin: float) -> bool:
        """The better mode with both rated: the one held best during `w` (its mode, or the other during a
        try) stays so unless its rate is below (1 - margin) of the other's (HYSTERESIS)."""
        held = w.on != w.trying
        held_rate, other_rate = self.rate[bucket, held], self.rate[bucket, not held]
        return held if held_rate >= (1.0 - margin) * other_rate else not held

    def _record(self, bucket: int, w: _Window) -> None:
        """The ended window's rate (the mode on's handicapped): replaces one measured windows ago, else
        smooths the last one's."""
        key, rate = (bucket, w.on), w.tokens / w.seconds * (1.0 - self.on_handicap if w.on else 1.0)
        step = w.seconds / max(1, w.steps - self.settle)
        fresh = key not in self.rate or self.rated_at[key] < w.windows - 1
        self.rate[key] = rate if fresh else 0.5 * self.rate[key] + 0.5 * rate
        self.step_seconds[key] = step if fresh else 0.5 * self.step_seconds[key] + 0.5 * step
        self.rated_at[key] = w.windows
        other = (bucket, not w.on)
        if other not in self.rate and bucket in self.ratio:
            self._estimate(other, rate * self.ratio[bucket])

    def _estimate(self, key: tuple[int, bool], rate: float) -> None:
        """A rate not measured here (rated_at -1): `describe` marks it, a try's measurement replaces it."""
        self.rate[key], self.rated_at[key] = rate, -1

    def _next_window(self, bucket: int, w: _Window, fell: bool = False, margin: float = 0.0) -> _Window:
        """The window after `w`: the other mode if it is still unmeasured, else the better one, or a try
        of the worse one once `every` windows have passed (doubling after each try it loses). `fell`: `w`
        ran the better mode (no try) and its rate fell below the other's. `margin`: the mode held best
        during `w` stays best unless its rate is below (1 - margin) of the other's (HYSTERESIS)."""
        every = w.every or self.explore_every
        on, off = self.rate.get((bucket, True)), self.rate.get((bucket, False))
        if on is None or off is None:
            return _Window(on is None, windows=w.windows + 1, every=every)
        best = self._held_best(bucket, w, margin)
        if best != w.on and fell:  # the mode in use fell below the other's last rate: switch, and try
            # it again after one window (then 2, 4, ...), for one slow window can do that. One H200, B=1:
            # branches ran 650 tok/s on, 446 off, until one window at ~270 (smoothed to 460) switched them
            # off for the rest of the run, at 0.92x fixed k = 4's throughput.
            every, since = 1, 0
        elif best != (w.on != w.trying):  # the better mode changed (a try won, a first measure): restart
            every, since = self.explore_every, 0
        else:  # the same: a try that lost again waits twice as long for the next
            every = min(2 * every, self.max_explore_every) if w.trying else every
            since = w.since + 1
        trying = since >= every
        return _Window(
            (not best) if trying else best,
            windows=w.windows + 1,
            since=0 if trying else since,
            every=every,
            trying=trying,
        )
