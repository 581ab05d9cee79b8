"""The TP step message: handler inputs packed into one int64 tensor, decoded exactly on the other ranks
(a real 2-rank gloo world), with a second broadcast past the capacity and a pickled fallback."""

from __future__ import annotations

import pytest

from common.distributed import Comm, comm_stats, reset_comm_stats, run_local_world
from common.tp_executor import _CAPACITY, _HEADER, TPExecutor, decode_inputs, encode_inputs

VERIFY = dict(rows=[[5, 1, 2, 3, 4], [9, 8], [7]], starts=[100, 3, 0], slots=[0, 2, 1], width=5)
DRAFT = dict(
    rows=[[1], [2, 3]], starts=[4, 0], slots=[1, 0], k=4, temperatures=[0.0, 0.7 + 1e-9], seeds=[3, -(2**62)]
)
LONG_PREFILL = dict(rows=[list(range(_CAPACITY)), list(range(7))], slots=[3, 4])  # past the capacity


def test_codec_round_trip_is_exact():
    values = [*VERIFY.values(), *DRAFT.values(), 1e-300, [], [[]]]
    arr = encode_inputs(values)
    got = decode_inputs(arr, len(values))
    assert got == values and [type(v) for v in got] == [type(v) for v in values]
    assert (
        encode_inputs([True]) is None and encode_inputs([{"a": 1}]) is None and encode_inputs(["s"]) is None
    )


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def verify_forward(self, rows, starts, slots, width):
        self.calls.append(("verify_forward", dict(rows=rows, starts=starts, slots=slots, width=width)))
        return "ran"

    def draft_round(self, rows, starts, slots, k, temperatures, seeds):
        self.calls.append(("draft_round", dict(rows=rows, starts=starts, slots=slots, k=k,
                                               temperatures=temperatures, seeds=seeds)))  # fmt: skip

    def prefill(self, rows, slots):
        self.calls.append(("prefill", dict(rows=rows, slots=slots)))

    def control(self, options):
        self.calls.append(("control", dict(options=options)))


def world(comm: Comm) -> dict:
    rec = Recorder()
    handlers = {n: getattr(rec, n) for n in ("verify_forward", "draft_round", "prefill", "control")}
    executor = TPExecutor(comm, handlers)
    reset_comm_stats()
    if comm.rank == 0:
        assert executor.run("verify_forward", **VERIFY) == "ran"
        step_stats = comm_stats()
        executor.run("draft_round", **DRAFT)
        executor.run("prefill", **LONG_PREFILL)
        executor.run("control", options={"drain": True})  # not packable: the pickled path
        executor.shutdown()
        executor.shutdown()  # a second shutdown sends nothing (the workers are gone)
        with pytest.raises(RuntimeError, match="control: the TP group has shut down"):
            executor.run("control", options={})
    else:
        executor.serve_forever()
        step_stats = None
    return {"calls": rec.calls, "step_stats": step_stats}


@pytest.mark.slow  # multi-process
def test_workers_receive_exactly_what_rank0_ran():
    rank0, rank1 = run_local_world(2, world)
    expected = [
        ("verify_forward", VERIFY),
        ("draft_round", DRAFT),
        ("prefill", LONG_PREFILL),
        ("control", {"options": {"drain": True}}),
    ]
    assert rank0["calls"] == expected
    assert rank1["calls"] == expected
    # One step = one broadcast of the fixed-size message, nothing else.
    assert rank0["step_stats"] == {("broadcast", "step_broadcast"): (1, 8 * (_HEADER + _CAPACITY))}
