"""Rank 0's per-request draft state: committed tokens, the slot's KV tokens, proposals, draft-ahead
and branches, over one shared DraftRunner.

Branches (greedy drafting): while the target verifies a proposal d_1..d_k, the draft drafts the next
proposal for each likely outcome of that verification: for every accepted length j < k the target's
token is guessed as the draft's second choice at position j + 1, and for j = k as its own next token.
Each branch is one row of a batched round. Its KV up to the branch point stays in the request's own
slot and is read from there (attention's prefix slot); its new KV goes to a branch slot, and is copied
into the request's slot only for the branch that the verdict picks. The branches travel to the target,
which can then start its next step without waiting for the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_cache import SlotTable
from draft_service.rounds import ChainedRound, RoundOutput
from draft_service.runner import DraftRunner


@dataclass
class Proposal:
    tokens: list[int]
    topk_ids: list[int] = field(default_factory=list)
    topk_probs: list[float] = field(default_factory=list)
    ahead_hit: bool = False
    seconds: list[int] = field(default_factory=list)  # the draft's second choice at each position


@dataclass
class Branch:
    """The next proposal for one outcome of verifying the current one (see the module docstring)."""

    key: list[int]  # the tokens the verdict appends to the committed sequence for this branch to apply
    proposal: Proposal
    slot: int  # branch KV slot
    split: int  # positions < split: the request's own slot; from split on: this slot
    kv: list[int]  # tokens whose KV this slot holds from `split` on


@dataclass
class DraftRequest:
    """Rank-0 view of one request on one target stream."""

    request_id: int
    slot: int
    committed: list[int]  # target-vocab ids the target has committed
    kv_tokens: list[int]  # tokens whose KV the slot holds, in order
    k: int  # the most tokens this request drafts per round
    temperature: float
    seed: int
    round_k: int = 0  # tokens asked in the current round (the target's step k, at most k)
    ready: Proposal | None = None  # a proposal computed before it was asked for
    ahead_expect: list[int] | None = None  # committed sequence under which `ahead` is valid
    ahead: Proposal | None = None
    branch_base: int = 0  # committed length the branches extend
    branches: list[Branch] = field(default_factory=list)
    # A round launched from the target's verify output before its verdict arrived (DraftState.chain):
    # (the round, this request's row in it, committed length at launch, drafted KV past it at launch).
    chained: tuple[ChainedRound, int, int, int] | None = None
    target_slot: int = -1  # in the target's process: its slot, whose features the draft reads in place


def common_prefix(a: list[int], b: list[int], known: int = 0) -> int:
    """Length of the common prefix of a and b, given that their first `known` items agree."""
    n = min(len(a), len(b))
    for i in range(known, n):
        if a[i] != b[i]:
            return i
    return n


class DraftState:
    """Rank 0's bookkeeping for all requests of all streams over one shared runner."""

    def __init__(self, runner: DraftRunner, slots: SlotTable):
        self.runner = runner
        self.slots = slots
        self.branch_slots = SlotTable(runner.num_branch_slots)
        self.branch_slot_offset = runner.branch_slot_offset
        self._copies: list[tuple[int, int, int, int]] = []  # (branch slot, request slot, start, length)
        self.ahead_hits = 0
        # Draft-ahead pays off only when whole rounds plus the bonus guess are right; on shared hardware a
        # miss costs the target time. Track the recent hit rate and pause below the threshold.
        self.ahead_hit_rate = 1.0
        self.rounds_without_ahead = 0
        self.ahead_misses = 0
        self.draft_tokens = 0
        self.round_ran = False  # whether the last propose() ran the model (not only ready proposals)
        self.chained_seconds: list[float] = []  # GPU times of chained rounds taken since last read
        # A feature draft: the target's features that came with starts and verdicts, (slot, first
        # position, rows [n, F]), stored by the next round on every rank (lazily: plain steps add none).
        self.feature_writes: list[tuple[int, int, object]] = []

    @property
    def reads_features(self) -> bool:
        return bool(self.runner.feature_layers)

    def add_features(self, req: DraftRequest, start: int, rows) -> None:
        """rows [n, F]: the target's features at positions start..start + n - 1 of the request."""
        if len(rows):
            self.feature_writes.append((req.slot, start, rows))

    def map_features(self, req: DraftRequest, store_slot: int) -> None:
        """In the target's process: the request's features are read from the target's slot `store_slot`."""
        self.runner.rounds.map_slot(req.slot, store_slot)

    def start(
        self, request_id: int, tokens: list[int], k: int, temperature: float, seed: int
    ) -> DraftRequest:
        slot = self.slots.alloc()
        return DraftRequest(request_id, slot, list(tokens), [], k, temperature, seed)

    def warm(self, reqs: list[DraftRequest]) -> None:
        """A feature draft's new greedy requests that were not asked for proposals: the KV of their
        committed tokens (the prompt) is written now, with no round and no wait, so the round chained to
        their first verify (`chain`) drafts for them."""
        todo = [r for r in reqs if r.k > 0 and r.temperature <= 0 and not r.kv_tokens
                and self.fits(r, 2 * r.k + 4)]  # fmt: skip
        if not todo:
            return
        writes, self.feature_writes = self.feature_writes, []
        self.runner.executor.run("catch_up", rows=[r.committed for r in todo], slots=[r.slot for r in todo],
                                 feature_writes=writes)  # fmt: skip
        for r in todo:
            r.kv_tokens = list(r.committed)
            r.round_k = r.k

    def release(self, req: DraftRequest) -> None:
        self._drop_branches(req)
        self.slots.free(req.slot)

    @property
    def branching(self) -> bool:
        return self.branch_slots.num_slots > 0

    def _drop_branches(self, req: DraftRequest) -> None:
        for slot in {b.slot for b in req.branches}:  # the plain-step branch shares the all-accepted one's
            self.branch_slots.free(slot - self.branch_slot_offset)
        req.branches = []

    def _pick_branch(self, req: DraftRequest, start: int) -> bool | None:
        """After a verdict: the branch whose key the committed sequence now ends with becomes the ready
        proposal and its KV is queued for copying into the request's slot. None: there were no branches."""
        if not req.branches:
            return None
        base = req.branch_base
        appended = req.committed[base:] if start >= base else None
        branch = next((b for b in req.branches if b.key == appended), None)
        if branch is not None:
            self._copies.append((branch.slot, req.slot, branch.split, len(branch.kv)))
            del req.kv_tokens[branch.split :]
            req.kv_tokens.extend(branch.kv)
            req.ready = branch.proposal
            req.ready.ahead_hit = True
        self._drop_branches(req)  # slots are free for reuse: copies run before any later round
        return branch is not None

    def apply_verdict(self, req: DraftRequest, start: int, tokens: list[int]) -> bool | None:
        """Commit the target's tokens; returns whether a draft-ahead guess hit (None: none was made)."""
        # The KV tokens always extend an older committed sequence, so they agree with it up to `start`:
        # only the few tokens after it are compared (no walk over the whole context every step).
        agreed = min(start, len(req.kv_tokens))
        del req.committed[start:]
        req.committed.extend(tokens)
        req.ready = None  # drafted for an older context (e.g. a step that asked this request for nothing)
        if req.chained is not None and self._take_chained(req, start, tokens):
            return None
        hit = self._pick_branch(req, start)
        if hit:  # the slot holds the committed sequence and the ready proposal's first tokens
            self._count_ahead(hit)
            return hit
        if req.ahead is not None:
            hit = req.ahead_expect == req.committed
            if hit:
                req.ready = req.ahead
                req.ready.ahead_hit = True
        if hit is not None:
            self._count_ahead(hit)
        req.ahead, req.ahead_expect = None, None
        # Keep the KV that still matches; at least one committed token stays pending so
        # the next round has a hidden state to draft from.
        valid = min(common_prefix(req.kv_tokens, req.committed, agreed), len(req.committed) - 1)
        del req.kv_tokens[valid:]
        return hit

    def chain(
        self, reqs: dict[int, DraftRequest], rows: list[tuple[int, int, list[int]]], packed, width: int
    ) -> ChainedRound | None:
        """Launches the next round of greedy requests from the target's verify output on the device
        (`GreedyRounds.launch_chained`), before the verdict arrives; `apply_verdict` then takes it as the
        ready proposal. rows: (row in `packed`, request id, the drafts verified there). A request takes
        part when its slot holds its committed tokens and the verified drafts' KV as a round left it
        (its drafts came from its last round), it has no branches or draft-ahead (the caller's stream
        drafts none ahead), and its next round fits. Returns the round launched (None: no request could
        take part); its `index` names the requests in it."""
        todo = []
        for i, rid, drafts in rows:
            req = reqs.get(rid)
            if req is None or req.temperature > 0 or req.round_k <= 0:
                continue
            if not drafts and not self.reads_features:  # a feature draft re-feeds what the verify emitted
                continue
            if req.ahead is not None or req.branches:
                continue
            if self.reads_features:  # it re-feeds every emitted token: the slot must hold the committed ones
                if len(req.kv_tokens) == len(req.committed) and self.fits(req, len(drafts) + 2 * req.k + 4):
                    todo.append((i, req, len(req.committed), 0))
                continue
            base, n = len(req.committed), len(drafts)
            extra = len(req.kv_tokens) - base
            held = min(extra, n)
            if extra < n - 1 or req.kv_tokens[base - 1 : base + held] != req.committed[-1:] + drafts[:held]:
                continue
            if not self.fits(req, n + 2 * req.k + 4):
                continue
            todo.append((i, req, base, extra))
        if not todo:
            return None
        # Each request's own k, not the last round's: the target's next step may ask any k up to it (the
        # adaptive policy), and a ready proposal shorter than that is dropped for a round of its own, which
        # then counts against the larger k in the policy's step timings.
        k = max(req.k for _, req, _, _ in todo)
        index, members, bases, extras = (list(c) for c in zip(*todo))
        launched = self.runner.rounds.launch_chained(
            packed, width, index, bases, extras, [r.slot for r in members], k
        )
        for b, (_, req, base, extra) in enumerate(todo):
            req.chained = (launched, b, base, extra)
            launched.index[req.request_id] = b
        return launched

    def _take_chained(self, req: DraftRequest, start: int, tokens: list[int]) -> bool:
        """After a verdict: the chained round becomes the ready proposal if it was fed what the verdict
        says (it always is, unless the target re-sent an older context); either way its KV writes are
        accounted for."""
        launched, b, base, extra = req.chained
        req.chained = None
        row = launched.row(b)
        if not launched.timed and launched.gpu_seconds is not None:
            launched.timed = True
            self.chained_seconds.append(launched.gpu_seconds)
        k = launched.k
        if self.reads_features:  # row: [k drafted | the emitted tokens it fed | base]
            if start != base or row[-1] != base or row[k : k + len(tokens)] != tokens:
                del req.kv_tokens[base:]  # it wrote KV from base on
                return False
            del req.kv_tokens[base:]
            req.kv_tokens += tokens
            req.ready = Proposal(row[:k])
            return True
        drafted, fed, first = row[:k], row[k : k + 2], row[k + 2]
        accepted = len(tokens) - 1
        m = min(accepted, extra)
        width = accepted - m + 1
        if start != base or first != base + m or fed[:width] != tokens[m:]:
            # The round wrote KV from `first` on (before it, the slot is as kv_tokens says).
            del req.kv_tokens[first:]
            return False
        del req.kv_tokens[base:]
        req.kv_tokens += tokens
        req.kv_tokens += drafted[: k - 1]
        req.ready = Proposal(drafted)
        return True

    def _count_ahead(self, hit: bool) -> None:
        self.ahead_hits += hit
        self.ahead_misses += not hit
        self.ahead_hit_rate = 0.9 * self.ahead_hit_rate + 0.1 * float(hit)

    @staticmethod
    def _holds(req: DraftRequest, tokens: list[int]) -> bool:
        """Whether the request's slot holds its committed tokens and all but the last of `tokens`. Its KV
        tokens agree with the committed ones wherever both exist, so only the tail is compared."""
        base = len(req.committed)
        return req.kv_tokens[base - 1 : base + len(tokens) - 1] == req.committed[-1:] + tokens[:-1]

    def fits(self, req: DraftRequest, extra: int) -> bool:
        return len(req.committed) + extra <= self.runner.max_len

    def _run(self, reqs: list[DraftRequest], rows: list[list[int]], k: int) -> RoundOutput:
        return self._round(rows, [len(r.kv_tokens) for r in reqs], [r.slot for r in reqs], k, reqs)

    def _round(self, rows, starts, slots, k, reqs, prefix_slots=(), prefix_len=()) -> RoundOutput:
        executor = self.runner.executor
        writes, self.feature_writes = self.feature_writes, []
        if self._copies:  # picked branches' KV first: the round may read it, and reuses branch slots
            src, dst, first, n = (list(c) for c in zip(*self._copies))
            self._copies = []
            executor.run("copy_kv", src_slots=src, dst_slots=dst, starts=first, lengths=n)
        return executor.run(
            "draft_round",
            rows=rows,
            starts=list(starts),
            slots=list(slots),
            k=k,
            temperatures=[r.temperature for r in reqs],
            seeds=[r.seed for r in reqs],
            prefix_slots=list(prefix_slots),
            prefix_len=list(prefix_len),
            feature_writes=writes,
        )

    def propose(self, reqs: list[DraftRequest], ks: list[int] | None = None) -> dict[int, Proposal]:
        """Proposals for `reqs`: min(ks[i], r.k) tokens each (r.k where ks[i] is 0 or missing); a ready
        draft-ahead proposal is used when it is long enough (cut to the asked length)."""
        out: dict[int, Proposal] = {}
        todo = []
        K = self.runner.config.sampled_top_k
        for i, req in enumerate(reqs):
            asked = ks[i] if ks is not None and i < len(ks) else 0
            req.round_k = min(asked, req.k) if asked else req.k
            ready = req.ready
            req.ready = None
            if ready is not None and len(ready.tokens) >= req.round_k > 0:
                n = req.round_k
                ids, probs = ready.topk_ids[: n * K], ready.topk_probs[: n * K]
                hit, seconds = ready.ahead_hit, ready.seconds[:n]
                out[req.request_id] = Proposal(ready.tokens[:n], ids, probs, hit, seconds)
            elif req.round_k > 0 and self.fits(req, 2 * req.round_k + 2):
                # A picked branch left KV past the committed tokens (which it holds): keep one committed
                # token pending. Otherwise the verdict already cut the KV tokens to a committed prefix.
                if len(req.kv_tokens) >= len(req.committed):
                    del req.kv_tokens[len(req.committed) - 1 :]
                todo.append(req)
            else:
                out[req.request_id] = Proposal([])
        self.round_ran = bool(todo)
        if todo:
            k = max(r.round_k for r in todo)
            result = self._run(todo, [r.committed[len(r.kv_tokens) :] for r in todo], k)
            for b, req in enumerate(todo):
                n = req.round_k
                tokens = result.tokens[b][:n]
                ids = result.topk_ids[b][: n * K] if result.topk_ids else []
                probs = result.topk_probs[b][: n * K] if result.topk_probs else []
                seconds = result.seconds[b][:n] if result.seconds else []
                req.kv_tokens += req.committed[len(req.kv_tokens) :]  # no copy of the whole context
                if not self.reads_features:  # a feature draft re-feeds drafts with the target's features
                    req.kv_tokens += result.tokens[b][: k - 1]
                out[req.request_id] = Proposal(tokens, ids, probs, seconds=seconds)
        self.draft_tokens += sum(len(p.tokens) for p in out.values())
        return out

    AHEAD_PROBE_EVERY = 16

    def ahead_worthwhile(self, min_hit_rate: float, rows: int = 1) -> bool:
        """Draft ahead for `rows` requests while the chance that all of their guesses hit (the recent
        per-request hit rate to the power `rows`) is at least `min_hit_rate`; otherwise only every 16th
        round, to notice when it would pay again. All of them, because the next ask spares a round only
        when no request in it needs one: a round for 11 of 16 rows costs what a round for 16 does (the
        draft's forwards are memory-bound), so partial hits save nothing, while the ahead round itself
        takes draft time and, on a shared GPU, the target's."""
        if self.ahead_hit_rate**rows >= min_hit_rate or self.rounds_without_ahead >= self.AHEAD_PROBE_EVERY:
            self.rounds_without_ahead = 0
            return True
        self.rounds_without_ahead += 1
        return False

    def draft_ahead(self, reqs: list[DraftRequest], proposals: dict[int, Proposal]) -> bool:
        """Assume every proposal is accepted plus the draft's own bonus guess; draft the next round.
        Returns whether a round ran."""
        todo = []
        for req in reqs:
            prop = proposals.get(req.request_id)
            if prop is None or not prop.tokens or len(prop.tokens) != req.round_k:
                continue
            exact = len(req.kv_tokens) == len(req.committed) + len(prop.tokens) - 1
            if not (exact and self._holds(req, prop.tokens)) or not self.fits(req, 3 * req.round_k + 4):
                continue
            todo.append(req)
        if not todo:
            return False
        k = max(r.round_k for r in todo) + 1
        result = self._run(todo, [[proposals[r.request_id].tokens[-1]] for r in todo], k)
        K = self.runner.config.sampled_top_k
        for b, req in enumerate(todo):
            prop = proposals[req.request_id]
            guess, *nxt = result.tokens[b][: req.round_k + 1]
            req.kv_tokens = [*req.kv_tokens, prop.tokens[-1], *result.tokens[b][: k - 1]]
            req.ahead_expect = req.committed + prop.tokens + [guess]
            ids = result.topk_ids[b][K : (req.round_k + 1) * K] if result.topk_ids else []
            probs = result.topk_probs[b][K : (req.round_k + 1) * K] if result.topk_probs else []
            req.ahead = Proposal(nxt, ids, probs)
        return True

    def draft_branches(
        self, reqs: list[DraftRequest], proposals: dict[int, Proposal]
    ) -> dict[int, tuple[int, list[Branch]]]:
        """While the target verifies `proposals`, draft the next proposal for each likely outcome: for
        each accepted length j < k the target's token guessed as the draft's second choice at position
        j + 1, and for j = k the draft's own next token. One batched round; returns each request's
        (committed length, branches) by request id. One more branch costs no row: a step that verified
        no draft for the request (the target did not wait for this proposal) and emitted its first token:
        its proposal is the rest of this one and the all-accepted row's guess (the KV it lacks, of the
        last proposed token, is in that row's slot)."""
        rows, starts, slots, prefix_slots, prefix_len, owners = [], [], [], [], [], []
        # All or none: the target goes on without waiting only when most of its requests have their
        # branch; a branch round for a few of many requests costs a round and spares the target nothing.
        needed = sum(len(p.tokens) + 1 for r in reqs if (p := proposals.get(r.request_id)) and p.tokens)
        if needed > self.branch_slots.num_free + sum(len({b.slot for b in r.branches}) for r in reqs):
            return {}
        for req in reqs:
            prop = proposals.get(req.request_id)
            if prop is None or not prop.tokens or len(prop.seconds) < len(prop.tokens):
                continue
            v, n = prop.tokens, len(prop.tokens)
            base = len(req.committed)
            if not self._holds(req, v):
                continue
            if not self.fits(req, 3 * req.k + 4) or self.branch_slots.num_free < n + 1:
                continue
            self._drop_branches(req)
            req.branch_base = base
            for j in range(n + 1):
                slot = self.branch_slots.alloc() + self.branch_slot_offset
                # j < n: the target rejects v[j] and emits the draft's second choice there; j = n: it
                # accepts all and emits a token the round's first output guesses (fed: v[n - 1]).
                feed = prop.seconds[j] if j < n else v[-1]
                split = base + j if j < n else base + n - 1
                rows.append([feed])
                starts.append(split)
                slots.append(slot)
                prefix_slots.append(req.slot)
                prefix_len.append(split)
                owners.append((req, [*v[:j], feed] if j < n else None))
        if not rows:
            return {}
        k = max(r.k for r, _ in owners) + 1
        result = self._round(rows, starts, slots, k, [r for r, _ in owners], prefix_slots, prefix_len)
        out: dict[int, tuple[int, list[Branch]]] = {}
        for b, (req, key) in enumerate(owners):
            tokens, seconds = result.tokens[b], result.seconds[b] if result.seconds else []
            kv = rows[b] + tokens[: k - 1]
            if key is None:  # all accepted: the first drafted token is the guess, the rest the proposal
                prop = proposals[req.request_id]
                key = prop.tokens + tokens[:1]
                plain = Proposal(
                    (prop.tokens[1:] + tokens[:1])[: req.k], seconds=(prop.seconds[1:] + seconds[:1])[: req.k]
                )
                req.branches.append(Branch(prop.tokens[:1], plain, slots[b], starts[b], rows[b]))
                out.setdefault(req.request_id, (req.branch_base, []))[1].append(req.branches[-1])
                tokens, seconds = tokens[1:], seconds[1:]
            branch = Branch(key, Proposal(tokens[: req.k], seconds=seconds[: req.k]), slots[b], starts[b], kv)
            req.branches.append(branch)
            out.setdefault(req.request_id, (req.branch_base, []))[1].append(branch)
        return out
