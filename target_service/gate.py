"""A mode on or off per batch bucket, chosen by measured output tokens per second (adaptive policy).

Whether to speculate at all is measured, not estimated: per batch bucket a `ModeGate` runs windows of
16 steps with speculation on (the model's best k >= 1) or off (k = 0), compares their output tokens per
second, keeps the better and tries the other now and then. The cost model alone misjudges both ways:
whole steps in one mode cost what they cost only while the service stays in it, and speculative steps
timed between plain ones miss the pipelined steady state. The first window of a bucket follows the
model. The scheduler runs a second gate for the draft's branches.
"""

from __future__ import annotations

from dataclasses import dataclass

from target_service.step_costs import StepCosts


@dataclass(frozen=True)
class GateConfig:
    """A mode gate's tuned constants."""

    window: int = 16  # steps per window (a mode's first window in a bucket is a half-window warm-up)
    settle: int = 2  # first steps of a window left uncounted: a switch takes a step to show
    explore_every: int = 16  # windows before the worse mode is tried again
    max_explore_every: int = 64  # each try the worse mode loses doubles the wait, up to this many windows
    early_steps: int = 4  # counted steps after which a clearly losing window may end early ...
    early_loss: float = 0.75  # ... below this fraction of the other mode's rate (0.7 ran plain's tries whole)
    hysteresis: float = 0.05  # the mode held best stays so until its rate is this fraction below the other's
    stall_cap: float = 2.0  # a counted step's seconds are capped at this times its mode's mean step
    on_handicap: float = 0.0  # the mode on is rated at (1 - on_handicap) of its measured rate ...
    handicap_from: int = 2  # ... in buckets of at least this many requests


BRANCH_GATE = GateConfig()  # the draft's branches: both modes rated alike
# Speculation must win by 8 %: the requests it puts out of step cost outside its windows (their starts come
# a few at a time, not in waves). Only while those starts are not priced: once AdmissionCosts has measured
# them at the bucket, each steady speculative step carries their surcharge, and the handicap would count
# them twice (ModeGate.observe's `priced`; architecture.md, "Why the speculation gate has its margins").
# Not at one stream, where no request is put out of step and a catch-up comes only with a switch (in the
# settle steps): with the handicap and the hysteresis a draft there had to win by 14 % to be switched on,
# and SmolLM2-135M's feature draft, 1.12x plain at k = 4, ran plain.
SPECULATION_GATE = GateConfig(on_handicap=0.08)


@dataclass
class _Window:
    on: bool
    steps: int = 0
    tokens: float = 0.0  # expected tokens, scaled to the bucket's whole batch (observe)
    emitted: float = 0.0  # emitted tokens, scaled alike: a try's rate
    seconds: float = 0.0
    windows: int = 0
    since: int = 0  # windows since the other mode was last tried
    every: int = 0  # windows between tries of the other mode (0: not yet set)
    trying: bool = False  # this window tries the other mode
    unpriced: bool = False  # a counted step came without its starts priced (observe's `priced`)


class ModeGate:
    """A mode on or off per batch bucket, chosen by measured output (adaptive policy): speculation
    itself (SpeculationPolicy.gate), and the draft's branches.

    Branches move the draft's round off the target's critical path, but the branch round (k + 1 rows per
    request) can outlast the target's step, or share its GPUs and slow its verify. So the target runs windows
    of `window` steps with the mode on or off, compares output tokens per second of each (the first `settle`
    steps of a window are not counted), keeps the better (the mode on handicapped by `on_handicap` from bucket
    `handicap_from` up) and tries the other after `explore_every` windows. A bucket's first window is
    `default`. Each try the other mode loses doubles the wait before the next (up to `max_explore_every`
    windows): a try costs a window in the worse mode, and a clear loser need not be re-checked every 16
    windows. The mode in use is measured in every window, so a drop in its own rate switches at once (and the
    waits start over); only a rise of the other waits for a try.

    Two things keep a first impression (taken while the policy still times its k's) from sticking: the
    first window of each mode in a bucket is a warm-up (half a window), not counted; and a rate last
    measured windows ago is replaced by a new window's, not averaged with it (smoothing only joins
    consecutive windows of one mode). A window that is clearly losing ends early (`early_steps`,
    `early_loss`), and a new bucket starts from its nearest measured neighbour's better mode instead of
    measuring both (`_first_window`).
    """

    def __init__(self, costs: StepCosts, config: GateConfig = BRANCH_GATE):
        self.costs = costs
        self.config = config
        self.on_handicap = config.on_handicap
        self.window, self.settle = config.window, config.settle
        self.explore_every, self.max_explore_every = config.explore_every, config.max_explore_every
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

    def trying(self, batch: int) -> bool:
        """Whether the bucket's window is a try of its worse mode."""
        w = self.state.get(self.costs.bucket(batch))
        return w is not None and w.trying

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
        """Whether a window may end early: after `early_steps` counted steps its rate is below
        `early_loss` of the other mode's (a try of a clear loser then costs 6 steps, not 16)."""
        c, counted = self.config, w.steps - self.settle
        return other is not None and counted >= c.early_steps and w.tokens < c.early_loss * other * w.seconds

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
        measured window), the model rating it below `early_loss` of the other ends that window after
        `early_steps` steps: the model's ratio stands in for its rate (an estimate, from the other mode's
        measured rate once there is one) and it is tried after a quarter of the usual wait, as a nearest
        bucket's estimate is: otherwise a mode's first windows run their full length with nothing
        measured to lose against."""
        if not self.unmeasured(batch):
            return
        bucket = self.costs.bucket(batch)
        w = self.state[bucket]
        if w.steps < self.settle + self.config.early_steps:
            return
        mine, other = (on, off) if w.on else (off, on)
        if mine >= self.config.early_loss * other:
            return
        measured = self.rate.get((bucket, not w.on))
        if measured is None:  # nothing measured here yet: the other mode's first window fills it in
            self.ratio[bucket] = mine / other
        else:
            self._estimate((bucket, w.on), measured * mine / other)
        every = max(1, self.explore_every // 4)
        self.state[bucket] = _Window(not w.on, windows=w.windows + 1, every=every)

    def observe(
        self, batch: int, tokens: float, seconds: float, expected: float | None = None, priced: bool = False
    ) -> None:
        """One step's output tokens and wall time, and the tokens it was expected to emit at the service's
        acceptance (given at one stream only: StepAccounting._feed_gates). `priced`: the seconds include
        what the requests the mode puts out of step cost (the admission surcharge): a window of the mode on
        whose counted steps all were is rated without `on_handicap`. A window of the mode held is rated
        by the expected tokens; a try, by the emitted ones (its early end, by the expected). At one stream the
        draws of acceptance spread a 16-step window's emitted tokens by ~15 % (alpha 0.5, k = 4), more than a
        1.14x gain, and switched it off for half its steps; the expected ones have no such spread while
        speculation runs (each step renews the acceptance), but after long off they are as stale as the
        acceptance, so a try is rated by what it emits.
        Rates are of the bucket's whole batch (tokens scaled
        by bucket / batch): a batch draining within its bucket lowers both modes' tokens per step alike,
        and unscaled, a mode then measured against the other's rate from a fuller batch looks worse.
        A counted step's seconds are capped at `stall_cap` times its mode's mean step: a single stalled
        step is not the mode's rate, while a mode whose steps all slow down moves its own mean."""
        bucket = self.costs.bucket(batch)
        w = self._window(bucket, True)
        w.steps += 1
        if w.steps > self.settle:
            w.tokens += (tokens if expected is None else expected) * bucket / batch
            w.emitted += tokens * bucket / batch
            w.seconds += min(seconds, self.config.stall_cap * self.step_seconds.get((bucket, w.on), seconds))
            w.unpriced = w.unpriced or not priced
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
        margin = self.config.hysteresis if compared else 0.0
        self.state[bucket] = self._next_window(bucket, w, fell=was_best, margin=margin)

    def _window_done(self, bucket: int, w: _Window) -> bool:
        """A window lasts `window` steps, or, in the mode with the longer steps, as long as `window` steps
        of the other mode (at least `early_steps` counted): windows are balanced in time, not steps, or a
        try of 16 long speculative steps costs several plain windows' time."""
        if w.steps >= self.window:
            return True
        other = self.step_seconds.get((bucket, not w.on))
        counted = w.steps - self.settle
        return other is not None and counted >= self.config.early_steps and w.seconds >= self.window * other

    def exploring(self, batch: int) -> bool:
        """Whether the bucket's window runs a mode that is not (known to be) its better one: a try, or the
        first windows of a mode once the other is measured. Another gate's rates taken meanwhile would be
        of a mode this gate is about to leave. So one gate explores at a time: while the speculation gate
        explores, branches stay at their best mode and the branch gate counts nothing; otherwise the
        speculation gate skips speculative steps while the branch gate explores (else the branch gate's
        windows without branches drag down speculation's rate and turn it off)."""
        bucket = self.costs.bucket(batch)
        w = self.state.get(bucket)
        if w is None:
            return False
        if w.trying:
            return True
        if (bucket, not w.on) not in self.rate:
            return False
        return (bucket, w.on) not in self.rate or self._held_best(bucket, w, self.config.hysteresis) != w.on

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
        return self._held_best(bucket, w, self.config.hysteresis)

    def _held_best(self, bucket: int, w: _Window, margin: float) -> bool:
        """The better mode with both rated: the one held best during `w` (its mode, or the other during a
        try) stays so unless its rate is below (1 - margin) of the other's (`hysteresis`)."""
        held = w.on != w.trying
        held_rate, other_rate = self.rate[bucket, held], self.rate[bucket, not held]
        return held if held_rate >= (1.0 - margin) * other_rate else not held

    def _record(self, bucket: int, w: _Window) -> None:
        """The ended window's rate (the mode on's handicapped unless its steps were priced): replaces one
        measured windows ago, else smooths the last one's."""
        handicap = self.on_handicap if w.on and w.unpriced and bucket >= self.config.handicap_from else 0.0
        key, rate = (bucket, w.on), (w.emitted if w.trying else w.tokens) / w.seconds * (1.0 - handicap)
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
        during `w` stays best unless its rate is below (1 - margin) of the other's (`hysteresis`)."""
        every = w.every or self.explore_every
        on, off = self.rate.get((bucket, True)), self.rate.get((bucket, False))
        if on is None or off is None:
            return _Window(on is None, windows=w.windows + 1, every=every)
        best = self._held_best(bucket, w, margin)
        if best != w.on and fell:  # the mode in use fell below the other's last rate: switch, and try
            # it again after one window (then 2, 4, ...), for one slow window can do that.
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
