"""The adaptive policy inside the real serving loop (Scheduler, DraftSession, streamer, event loop), with
the GPU step and the draft round trip simulated by sleeps (bench/host_path.py's SimulatedRunner and
SimulatedDraft): it must stop speculating where speculation loses and keep speculating where it wins.
The simulated costs are the ones measured on the H200 pair (docs/benchmarks.md, TP=2 mode 1: a 2.63 ms
plain step, +0.1 ms per verify position, a 3.1 ms draft round trip)."""

from __future__ import annotations

from bench.host_path import SimulatedDraft, SimulatedRunner, run

PLAIN_STEP, PER_POSITION, ROUND_TRIP = 2.63e-3, 0.1e-3, 3.1e-3


def speculative_share(alpha: float, per_position: float, tokens: int = 400) -> tuple[int, int]:
    """(speculative steps, all steps) of one greedy request of `tokens` under the adaptive policy."""
    runner = SimulatedRunner(alpha, PLAIN_STEP, per_position)
    run(1, tokens, None, 4, runner, SimulatedDraft(ROUND_TRIP), policy="adaptive")
    return sum(w > 1 for w in runner.widths), len(runner.widths)


def test_adaptive_stops_speculating_where_it_loses():
    # alpha 0.36: a width-5 step yields 1.55 tokens for 3.03 ms + a 3.1 ms wait; a plain step 1 per 2.63 ms.
    speculative, steps = speculative_share(alpha=0.36, per_position=PER_POSITION)
    assert speculative <= 0.1 * steps, (speculative, steps)


def test_adaptive_keeps_speculating_where_it_wins():
    # alpha 0.9 and nearly free extra positions: k = 4 yields 4.1 tokens per 6.2 ms against 2.63 ms each.
    speculative, steps = speculative_share(alpha=0.9, per_position=0.01e-3)
    assert speculative >= 0.8 * steps, (speculative, steps)
