"""How many draft tokens to ask for in a step: fixed, or the goodput-maximising k (SmartSpec-style).

Speculation pays when the tokens it adds per step outweigh what it costs: the wider verify forward and
the wait for the draft. At batch 1 the verify is memory-bound and k = 4 is nearly free; at batch 64 it is
compute-bound and a width-5 forward costs several plain steps. The adaptive policy picks, per step, the
k in [0, max k of the batch] that maximises

    goodput(k) = sum_r E_r(min(k, k_r)) / step_seconds(B, k)

with E_r(k) = (1 - a_r^(k+1)) / (1 - a_r) the expected tokens of request r at per-token acceptance a_r.

The costs: target_service/step_costs.py (whole steps timed, parts where a k was never timed). A timed k
the policy has stopped choosing is re-timed now and then (REFRESH_AGE), so a figure from the warm-up
does not hold it off. Whether to speculate at all is measured, not estimated (target_service/gate.py).
Greedy output never depends on k: verification is lossless for any k.
"""

from __future__ import annotations

from collections.abc import Sequence

from target_service.gate import SPECULATION_GATE, GateConfig, ModeGate
from target_service.request import Request, SpecStats
from target_service.step_costs import StepCosts

FIXED, ADAPTIVE = "fixed", "adaptive"
# A timed k within REFRESH_WITHIN of the best estimated goodput that has gone REFRESH_AGE steady steps at
# its bucket without a sample runs REFRESH_STEPS steps and drops its old samples: a median from the
# warm-up can hold the policy off the best k. An untimed k counts as old as the bucket.
REFRESH_AGE, REFRESH_STEPS, REFRESH_WITHIN = 64, 4, 0.6
# A refresh whose REFRESH_STEPS steps gave no cost sample runs on until one does, REFRESH_MAX_STEPS steps
# at most: steps that start or finish requests are none (StepAccounting), and a refresh through a run of
# starts would otherwise end on the stale median it was to replace, and count as lost.
REFRESH_MAX_STEPS = 4 * REFRESH_STEPS
# A k never timed at a bucket is tried after UNTIMED_AGE steady steps there: estimates from parts
# overestimate a k whose draft wait overlaps its verify, and knowing early pays for the bucket's life.
UNTIMED_AGE = 8
# A k that its refresh leaves behind waits twice as long for the next (up to REFRESH_AGE_MAX steps); one
# that wins starts over. Refreshes are tries of a worse k, so a clear loser is re-checked rarely.
REFRESH_AGE_MAX = 512
# After plain steps, a batch whose requests have all decoded at least SWITCH_ON_MIN_LEFT tokens and have
# fewer than that left stays plain: the draft's catch-up on every token since would cost more than the
# last few steps win back. Requests that have barely started are exempt (their prompt costs the same).
SWITCH_ON_MIN_LEFT = 32
# While the service's acceptance promises less than MIN_GAIN more tokens per step at every k, steps run
# plain without any try of speculation (no timing, refresh or gate window): no draft round and wider
# verify cost that little (the cheapest measured, Qwen2.5-Coder-1.5B's feature draft in the target, 7 % of
# a plain step per drafted position), and a SmolLM2-135M draft that is never right, accepted 2-4 % of
# the time by chance, cost 3 % at one stream while the gate held it off by measurement. One step in
# REPROBE_EVERY of such steps still speculates, so a draft that improves is seen.
MIN_GAIN, REPROBE_EVERY = 0.05, 1024
SERVICE_DECAY = 0.995  # per verdict, of the service's acceptance (SpecStats; a request's own: 0.98)
NO_DRAFT = "draft not connected"  # why a target with a draft drafts nothing while its link is down
# Why a step the batch allowed to speculate did not (policy.off_reason; GetModelInfo, the metrics, usage).
COST_MEASURED = "draft cost exceeds expected gain (measured: plain steps were faster at this batch size)"
COST_ESTIMATED = "draft cost exceeds expected gain (estimated from step costs and acceptance)"
LOW_ACCEPTANCE = f"draft acceptance too low: under {MIN_GAIN:.0%} more tokens per step at any k"
NEAR_END = "requests near their end: switching speculation on would not pay back its catch-up"


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits for one request drafting k tokens at per-token acceptance alpha."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpeculationPolicy:
    def __init__(
        self,
        mode: str,
        costs: StepCosts,
        prior_alpha: float = 0.7,
        gate: bool = True,
        gate_config: GateConfig = SPECULATION_GATE,
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
        self.gate = ModeGate(costs, gate_config) if gate and mode == ADAPTIVE else None
        self.gated = False
        self.refreshing: dict[int, tuple[int, int]] = {}  # bucket -> (k, steps run) of a refresh
        self.refresh_age: dict[tuple[int, int], int] = {}  # (bucket, k) -> its wait (default REFRESH_AGE)
        self.last_k: int | None = None  # the k chosen for the last step (None: none chosen yet)
        self.off_reason = ""  # why the last step chose k = 0 though the batch allowed more ("": it did not)
        self.allowed_k = 0  # the largest k a request of the last step's batch allowed
        self.hopeless_steps = 0  # steps in a row whose drafts promised less than MIN_GAIN

    @property
    def prior_alpha(self) -> float:
        return self.service.alpha(self.first_prior)

    @property
    def resting(self) -> bool:
        """The last choice was a step of a draft that promises less than MIN_GAIN (not a reprobe): the
        policy reads no cost sample or gate window before it tries speculation again."""
        return self.off_reason == LOW_ACCEPTANCE

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        """A step's verdicts, drafted and accepted tokens per request in batch order (the service-wide
        acceptance behind every request's prior)."""
        self.service.observe_all(drafted, accepted, decay=SERVICE_DECAY)

    def choose(self, batch: Sequence[Request]) -> int:
        """The step's k: each request r then drafts min(k, r.k) tokens."""
        self.off_reason = ""
        k = self._choose(batch)
        if k and self.last_k == 0 and self.mode == ADAPTIVE and self._ending(batch):
            self.gated = False  # a plain step outside the gate's windows (observe_step skips it)
            self.off_reason = NEAR_END
            k = 0
        self.last_k = k
        return k

    def why_not(self, k: int, connected: bool) -> str:
        """Why a step whose batch allowed drafts gets none: the draft is not connected (whatever k), or the
        policy chose k = 0 (`off_reason`); "" when it drafts."""
        if not connected and self.allowed_k:
            return NO_DRAFT  # whatever k the policy chose: nothing can be drafted
        return "" if k else self.off_reason

    def note(self, req: Request, reason: str) -> str:
        """A finished request's usage note: why nothing was drafted for it though it allowed drafts."""
        note = reason if req.k and not req.spec.drafted else ""
        return f"{self.mode} policy: {note}" if note and note != NO_DRAFT else note

    @staticmethod
    def _ending(batch: Sequence[Request]) -> bool:
        """Whether every request is past its start and within SWITCH_ON_MIN_LEFT tokens of its end."""
        return all(
            len(r.output) >= SWITCH_ON_MIN_LEFT and r.max_new_tokens - len(r.output) < SWITCH_ON_MIN_LEFT
            for r in batch
        )

    def _choose(self, batch: Sequence[Request]) -> int:
        max_k = self.allowed_k = max((r.k for r in batch), default=0)
        self.gated = False  # the step this chooses for is one of the gate's (observe_step)
        if self.mode == FIXED or max_k == 0:
            return max_k
        # O(1) on the service's acceptance, before any per-request pass: a plain step's host time.
        if expected_tokens(self.prior_alpha, max_k) < 1 + MIN_GAIN:
            self.hopeless_steps += 1
            if self.hopeless_steps % REPROBE_EVERY:
                self.off_reason = LOW_ACCEPTANCE
                return 0  # not one of the gate's steps either: nothing for speculation to win here
        else:
            self.hopeless_steps = 0
        if self.gate is not None and self.gate.mode(len(batch)) is False:
            self.gated = True  # off for this window: no estimate needed (a plain step's host time) ...
            if self.gate.unmeasured(len(batch)):  # ... but in plain's first windows the model may end them
                goodput = self._goodput(batch, max_k)
                if isinstance(goodput, list):
                    self._tell_gate(len(batch), goodput, self._best_on(goodput))
            self.off_reason = COST_ESTIMATED if self.gate.unmeasured(len(batch)) else COST_MEASURED
            return 0
        goodput = self._goodput(batch, max_k)
        if isinstance(goodput, int):
            return goodput  # no verify cost measured at or below this width for this batch: measure it
        best_k = max(range(max_k + 1), key=goodput.__getitem__)
        self.gated = self.gate is not None
        if self.gate is not None:
            # On: the model's best k >= 1 (measured windows may say speculation pays where the model says
            # not).
            best_on = self._best_on(goodput)
            self._tell_gate(len(batch), goodput, best_on)
            if not self.gate.want(len(batch), default=best_k > 0):
                self.off_reason = COST_ESTIMATED if self.gate.unmeasured(len(batch)) else COST_MEASURED
                return 0
            best_k = best_on
        if not best_k:
            self.off_reason = COST_ESTIMATED
            return 0
        if self.gate is not None and self.gate.trying(len(batch)):
            return best_k  # a try of speculation is rated at its best k: refreshes wait for its outcome
        return self._refresh(len(batch), best_k, goodput)

    def _goodput(self, batch: Sequence[Request], max_k: int) -> list[float] | int:
        """Expected output tokens per second of a step at each k in 0..max_k, or the first k with no
        cost to estimate it from."""
        tokens = self.batch_tokens(batch, max_k)
        goodput = []
        for k in range(max_k + 1):
            seconds = self.costs.step_seconds(len(batch), k)
            if seconds is None:
                return k
            goodput.append(tokens[k] / max(seconds, 1e-9))
        return goodput

    @staticmethod
    def _best_on(goodput: list[float]) -> int:
        """The best k >= 1."""
        return max(range(1, len(goodput)), key=goodput.__getitem__)

    def _tell_gate(self, batch: int, goodput: list[float], best_on: int) -> None:
        """The model's rates of both modes, when k = 0 and `best_on` are timed steps, not parts: in a mode's
        first windows the gate may end one the model clearly rates the loser (ModeGate.model_says)."""
        if self.costs.timed(batch, 0) and self.costs.timed(batch, best_on):
            self.gate.model_says(batch, goodput[best_on], goodput[0])

    def _refresh(self, batch: int, best: int, goodput: list[float]) -> int:
        """`best`, or a close rival k whose timing has gone stale (its refresh age, from REFRESH_AGE up to
        REFRESH_AGE_MAX), for REFRESH_STEPS steps (more while none of them was a cost sample)."""
        b = self.costs.bucket(batch)
        k, ran = self.refreshing.get(b, (0, 0))
        sampled = self.costs.samples(batch, k) if k else 0
        if k and k < len(goodput) and (ran < REFRESH_STEPS or (not sampled and ran < REFRESH_MAX_STEPS)):
            self.refreshing[b] = (k, ran + 1)
            return k
        if k:  # a refresh ended: its k waits twice as long for the next if it lost on samples of its own,
            del self.refreshing[b]  # starts over if it won
            if k != best and sampled:
                self.refresh_age[b, k] = min(2 * self.refresh_age.get((b, k), REFRESH_AGE), REFRESH_AGE_MAX)
        self.refresh_age.pop((b, best), None)
        stale = {
            k: age
            for k in range(1, len(goodput))
            if k != best
            and goodput[k] >= REFRESH_WITHIN * goodput[best]
            and (age := self.costs.age(batch, k)) > self.refresh_age.get((b, k), self._first_wait(batch, k))
        }
        if not stale:
            return best
        k = max(stale, key=stale.__getitem__)
        self.costs.restart(batch, k)
        self.refreshing[b] = (k, 1)
        return k

    def _first_wait(self, batch: int, k: int) -> int:
        """Steady steps before a refresh of k at this bucket, before any refresh of it there has ended."""
        return REFRESH_AGE if self.costs.timed(batch, k) else UNTIMED_AGE

    def observe_step(
        self, batch: int, tokens: int, seconds: float, expected: float | None = None, priced: bool = False
    ) -> None:
        """One step's output tokens, wall time and expected tokens (the gate's windows; not steps no request
        could speculate in); `priced`: as ModeGate.observe's."""
        if self.gated:
            self.gate.observe(batch, tokens, seconds, expected, priced)

    def explain(self, batch: Sequence[Request]) -> str:
        """Per k: the step seconds `choose` would use, the expected tokens and their ratio (the log)."""
        max_k = max((r.k for r in batch), default=0)
        tokens = self.batch_tokens(batch, max_k)
        out = []
        for k in range(max_k + 1):
            seconds = self.costs.step_seconds(len(batch), k)
            timed = "timed" if self.costs.timed(len(batch), k) else "parts"
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
