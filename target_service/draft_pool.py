"""The target's side of a pool of draft replicas: one Speculate stream per replica.

`--draft-address` names one or more drafts: a comma list, each entry `host:port` (or `dns:///host:port`).
A host resolves to all of its addresses, so the headless Service `specsplit-draft` yields every draft
pod; the pool re-resolves every `refresh_s`, opening streams to new pods and closing gone ones.

To the draft session the pool is one draft link (`connected`, `epoch`, `send`, `receive`): it splits
each step's SpeculateRequest by request, sends every replica its part on that replica's own DraftLink,
and merges the answers to that step. Placement and failure are per request:
- A request is placed when it starts (its DraftRequestStart) and stays on that replica while the
  replica's stream lives: the replica holds its draft KV (sticky).
- Placement is least-loaded by the drafts' own free KV slots (`free_slots` in every
  SpeculateResponse and in GetDraftInfo, so targets sharing a pool see each other's load), less the
  starts this target sent since that report.
- When a replica's stream breaks (or the replica leaves DNS), only its requests lose their proposals;
  the pool reports them in `unknown_request_ids`, so the scheduler re-sends them as starts and the
  pool places them on a live replica. A replica that answers late costs only its requests that step.
The pool's `epoch` never changes: there is no global resync.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2
from target_service.draft_link import DraftLink, OnBranches

log = logging.getLogger("specsplit.target")
Part = draft_pb2.SpeculateRequest  # one replica's share of a step's message


def split_host_port(entry: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `dns:///host:port` -> (host, port); ValueError naming the flag."""
    text = entry.strip().removeprefix("dns:///").removeprefix("dns:")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--draft-address: {entry!r} is not host:port")
    return host.strip("[]"), int(port)


def resolve(spec: str) -> list[str]:
    """Every draft address named by `spec` (comma list; each host resolved to all its addresses)."""
    found: list[str] = []
    for entry in (e for e in spec.split(",") if e.strip()):
        host, port = split_host_port(entry)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            log.warning("draft %s does not resolve (%s)", host, exc)
            continue
        for family, *_, sockaddr in infos:
            ip = sockaddr[0]
            address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
            if address not in found:
                found.append(address)
    return found


def default_server_name(spec: str) -> str | None:
    """The TLS name to check when addresses resolve to IPs: the (first) host the flag names."""
    host, _ = split_host_port(spec.split(",")[0])
    return None if host.replace(".", "").isdigit() or ":" in host else host


class _ConnectedHook:
    def __init__(self, on_change: Callable[[], None]):
        self.on_change = on_change

    def set(self, _value: float) -> None:
        self.on_change()


class _LinkMetrics:
    """The service's metrics as one link of the pool sees them: its `draft_connected` updates the
    pool's gauges (connected while any replica is) instead of overwriting the shared gauge."""

    def __init__(self, metrics: ServiceMetrics, on_change: Callable[[], None]):
        self._metrics = metrics
        self.draft_connected = _ConnectedHook(on_change)

    def __getattr__(self, name: str):
        return getattr(self._metrics, name)


@dataclass(eq=False)
class Replica:
    address: str
    link: DraftLink
    free_slots: int = -1  # the draft's last report (-1: none yet)
    placed_since_report: int = 0  # starts sent since that report
    requests: set[int] = field(default_factory=set)

    def estimated_free(self) -> int:
        if self.free_slots < 0:
            info = self.link.info
            return (info.max_batch_size if info is not None else 0) - len(self.requests)
        return self.free_slots - self.placed_since_report


class DraftPool:
    def __init__(
        self,
        spec: str,
        make_link: Callable[[str, ServiceMetrics], DraftLink],
        metrics: ServiceMetrics,
        refresh_s: float = 10.0,
        resolver: Callable[[str], list[str]] = resolve,
    ):
        for entry in (e for e in spec.split(",") if e.strip()):
            split_host_port(entry)  # bad syntax fails at start-up, naming the flag
        if not spec.strip(","):
            raise ValueError("--draft-address: no address given")
        self.spec = spec
        self.make_link = make_link
        self.metrics = metrics
        self.refresh_s = refresh_s
        self.resolver = resolver
        self.epoch = 1
        self.replicas: dict[str, Replica] = {}
        self.placement: dict[int, tuple[Replica, int]] = {}  # request id -> (replica, its link epoch)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sent: dict[int, tuple[dict[Replica, int], set[int]]] = {}  # step -> (replica: epoch, lost)
        self._thread = threading.Thread(target=self._refresh_loop, name="draft-pool", daemon=True)

    # -- the DraftLink interface the scheduler uses --------------------------------
    @property
    def target_vocab_size(self) -> int:
        """The target's vocabulary (every link has the same): proposals are checked against it."""
        return next(iter(self.replicas.values())).link.target_vocab_size

    @property
    def connected(self) -> bool:
        return any(r.link.connected for r in list(self.replicas.values()))

    @property
    def info(self) -> draft_pb2.GetDraftInfoResponse | None:
        return next((r.link.info for r in list(self.replicas.values()) if r.link.info is not None), None)

    def start(self) -> None:
        self._refresh()
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        for replica in list(self.replicas.values()):
            replica.link.close()

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.connected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def send(self, msg: draft_pb2.SpeculateRequest, epoch: int) -> bool:
        """Split `msg` over the replicas and queue each part on its stream, without waiting.

        Each part goes to the stream its requests were placed on (the epoch read while splitting); a
        stream that has just gone refuses it, and its requests are reported unknown by `receive`.
        False when nothing could be sent and nothing needs reporting.
        """
        with self._lock:
            sole = self._sole_replica(msg)
            if sole is not None:  # one replica holds every request: the message goes as it is
                self._place_starts(msg, sole)
                parts, lost = {sole: (msg, sole.link.epoch)}, set()
            else:
                parts, lost = self._split(msg)
            sent: dict[Replica, int] = {}
            for replica, (part, link_epoch) in parts.items():
                if replica.link.send(part, link_epoch):
                    sent[replica] = link_epoch
                else:
                    lost.update(self._forget(replica, link_epoch))
            if not sent and not lost:
                return False
            self._sent[msg.step] = (sent, lost)
        return True

    def receive(
        self, step: int, epoch: int, deadline: float, on_branches: OnBranches | None = None
    ) -> draft_pb2.SpeculateResponse | None:
        """The merged answers to `step` (None: no replica answered and none lost a request).

        Requests of a replica whose stream ended are listed in `unknown_request_ids`: the scheduler
        starts them again and the pool places them on a live replica. A replica that misses the deadline
        costs only its own requests' proposals this step. Branches messages go to `on_branches`; when it
        returns True the caller needs no answer and the remaining replicas are not waited for.
        """
        with self._lock:
            sent, lost = self._sent.pop(step, ({}, set()))
            for old in [s for s in self._sent if s < step]:  # sends nobody waits for (releases only)
                del self._sent[old]
        responses: list[draft_pb2.SpeculateResponse] = []
        done = False

        def branches(response: draft_pb2.SpeculateResponse) -> bool:
            nonlocal done
            done = on_branches is not None and on_branches(response)
            return done

        for replica, link_epoch in sent.items():
            if done:
                break
            response = replica.link.receive(step, link_epoch, deadline, branches)
            with self._lock:
                if response is not None:
                    self._record(replica, response)
                    responses.append(response)
                elif not replica.link.connected or replica.link.epoch != link_epoch:
                    lost.update(self._forget(replica, link_epoch))
        self._update_gauges()
        if len(responses) == 1 and not lost:  # one replica answered for all: no merge copy
            return responses[0]
        if not responses and not lost:
            return None
        merged = draft_pb2.SpeculateResponse(step=step, unknown_request_ids=sorted(lost))
        for response in responses:
            merged.proposals.extend(response.proposals)
            merged.unknown_request_ids.extend(response.unknown_request_ids)
            merged.draft_seconds = max(merged.draft_seconds, response.draft_seconds)
        return merged

    # -- routing ---------------------------------------------------------------------
    def _split(self, msg: draft_pb2.SpeculateRequest) -> tuple[dict[Replica, tuple[Part, int]], set[int]]:
        """Per-replica messages with the stream epoch they are for, and the ids whose replica is gone
        (the scheduler must start them again)."""
        parts: dict[Replica, tuple[Part, int]] = {}
        lost: set[int] = set()

        def part(replica: Replica) -> Part:
            if replica not in parts:
                part = draft_pb2.SpeculateRequest(step=msg.step, protocol_version=msg.protocol_version)
                parts[replica] = (part, replica.link.epoch)
            return parts[replica][0]

        for rid in msg.releases:
            placed = self._live_placement(rid)
            self._drop(rid)
            if placed is not None:
                part(placed).releases.append(rid)
        for start in msg.starts:
            self._drop(start.request_id)
            replica = self._least_loaded()
            if replica is None:
                lost.add(start.request_id)
                continue
            self._place(start.request_id, replica)
            part(replica).starts.append(start)
        for verdict in msg.verdicts:
            replica = self._live_placement(verdict.request_id)
            if replica is None:
                lost.add(verdict.request_id)
            else:
                part(replica).verdicts.append(verdict)
        for i, rid in enumerate(msg.propose):
            replica = self._live_placement(rid)
            if replica is None:
                lost.add(rid)
                continue
            part(replica).propose.append(rid)
            if i < len(msg.propose_k):
                part(replica).propose_k.append(msg.propose_k[i])
        for rid in lost:
            self._drop(rid)
        return parts, lost

    def _sole_replica(self, msg: draft_pb2.SpeculateRequest) -> Replica | None:
        """The pool's only replica when it is live and already holds every request `msg` names (the
        common single-draft deployment): then no split or merge copies the step's messages."""
        if len(self.replicas) != 1:
            return None
        [replica] = self.replicas.values()
        if not replica.link.connected:
            return None
        if any(self._live_placement(rid) is not replica for rid in msg.releases):
            return None
        started = {s.request_id for s in msg.starts}
        for rids in ((v.request_id for v in msg.verdicts), msg.propose):
            if any(rid not in started and self._live_placement(rid) is not replica for rid in rids):
                return None
        return replica

    def _place_starts(self, msg: draft_pb2.SpeculateRequest, replica: Replica) -> None:
        """`_split`'s placement bookkeeping for a message sent whole to `replica`."""
        for rid in msg.releases:
            self._drop(rid)
        for start in msg.starts:
            self._place(start.request_id, replica)

    def _place(self, rid: int, replica: Replica) -> None:
        self._drop(rid)
        self.placement[rid] = (replica, replica.link.epoch)
        replica.requests.add(rid)
        replica.placed_since_report += 1

    def _live_placement(self, rid: int) -> Replica | None:
        """The request's replica if it still holds the request (same stream, still in the pool)."""
        placed = self.placement.get(rid)
        if placed is None:
            return None
        replica, link_epoch = placed
        alive = self.replicas.get(replica.address) is replica and replica.link.connected
        return replica if alive and replica.link.epoch == link_epoch else None

    def _least_loaded(self) -> Replica | None:
        live = [r for r in self.replicas.values() if r.link.connected]
        if not live:
            return None
        return max(live, key=lambda r: (r.estimated_free(), -len(r.requests)))

    def _record(self, replica: Replica, response: draft_pb2.SpeculateResponse) -> None:
        if response.HasField("free_slots"):
            replica.free_slots = response.free_slots
            replica.placed_since_report = 0
        for rid in response.unknown_request_ids:  # the draft had no slot: placed again next step
            self._drop(rid)

    def _drop(self, rid: int) -> None:
        placed = self.placement.pop(rid, None)
        if placed is not None:
            placed[0].requests.discard(rid)

    def _forget(self, replica: Replica, link_epoch: int | None = None) -> list[int]:
        """Drops the requests placed on `replica` (on stream `link_epoch`, or any); returns their ids."""
        gone = sorted(
            rid
            for rid in replica.requests
            if link_epoch is None or self.placement.get(rid, (None, link_epoch))[1] == link_epoch
        )
        for rid in gone:
            self.placement.pop(rid, None)
            replica.requests.discard(rid)
        replica.free_slots, replica.placed_since_report = -1, 0
        return gone

    # -- membership ------------------------------------------------------------------
    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.refresh_s):
            self._refresh()

    def _refresh(self) -> None:
        addresses = self.resolver(self.spec)
        if not addresses:
            return  # DNS hiccup or no pods yet: keep what we have
        with self._lock:
            for address in addresses:
                if address not in self.replicas:
                    link = self.make_link(address, _LinkMetrics(self.metrics, self._update_gauges))
                    self.replicas[address] = Replica(address, link)
                    link.start()
                    log.info("draft replica added: %s", address)
            for address in [a for a in self.replicas if a not in addresses]:
                replica = self.replicas.pop(address)
                self._forget(replica)
                replica.link.close()
                log.info("draft replica removed: %s", address)
        self._update_gauges()

    def _update_gauges(self) -> None:
        replicas = list(self.replicas.values())
        self.metrics.draft_replicas.set(len(replicas))
        self.metrics.draft_replicas_connected.set(sum(r.link.connected for r in replicas))
        self.metrics.draft_connected.set(1 if any(r.link.connected for r in replicas) else 0)
