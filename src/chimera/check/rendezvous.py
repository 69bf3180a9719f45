"""Rendezvous check: replay every rank's communication calls under NCCL's rules (no torch).

gloo matches messages by tag and buffers them, so an order of calls that trains on CPU can
hang on GPUs. This module replays, for every rank, the exact sequence of ``torch.distributed``
calls the runtime makes for a :class:`~chimera.check.comm_plan.CommPlan` (:func:`chimera.check.issued.issued_ops`:
what :class:`~chimera.runtime.p2p.Mailbox`, :class:`~chimera.runtime.sync.GradSync` and the
shards call, in order; a test records the real runtime's calls, sizes included, and
compares) under these rules:

- **Streams.** Each call joins a FIFO stream when the rank's CPU reaches it. Mode ``pair``:
  p2p on one stream per pair of ranks on each side, shared by both directions (NCCL's
  lazily created 2-rank communicators); mode ``rank``: one p2p stream per rank
  (``init_process_group(device_id=...)``). In both, a rank's collectives share one more
  FIFO over all communicators (NCCL's rule for communicators used concurrently). Mode
  ``strict``: one stream per rank for everything, p2p and collectives together, the worst
  case NCCL's guide asks programs to survive and the model :mod:`chimera.check.comm_plan` proves
  its order safe in. Every deadlock-free replay in ``strict`` is one in the other modes
  (they only split its streams), and the validator replays all three.
- **Rendezvous.** A send and its receive complete together, and only while both are at the
  head of their streams: a send larger than NCCL's buffer waits for the peer's receive, and
  nothing behind it on its stream moves meanwhile. (Small messages may slip through the
  buffer on real hardware; the check assumes none does.)
- **CPU.** ``Work.wait`` blocks the rank's CPU until the op completed: a RECV waits for its
  posted receive; STEP waits for every send, then every collective, in issue order.
  Compute, posts, sends and launches never block.
- **Collectives.** The k-th collective on a group completes when it is at the head of
  every member's stream. Before the replay, every group's collectives are compared member
  by member, by kind, size and count (:func:`compare_groups`, a CollectiveMismatch naming
  both members): NCCL would hang on a different count and mix buffers on a different size.
  A replica the plan lets reduce bucket by bucket (``CommPlan.early``, the device plan:
  ``buckets=True``) issues one allreduce per bucket inside its last backward, each its own
  collective; otherwise one allreduce at its Launch. ``sizes`` gives each stage's bucket
  sizes (:func:`bucket_sizes`; by default two buckets of one element, so that a bucketed
  member never looks like an unbucketed one). A group of one rank issues nothing.
- **Sharded optimizer** (``sharded=True``, ZeRO-1, :mod:`chimera.runtime.shard`): a replica's
  collective at its Launch is a reduce-scatter (the device plan; never bucketed; the CPU
  plan runs an allreduce in that slot); after STEP the rank issues one parameter all-gather
  per replica, stages in order, and waits for each right before its replica's first forward
  of the next iteration (prefetch). Those gathers are what makes iterations interact, so a
  sharded replay runs two iterations, each ending as ``PipelineRuntime.gather_parameters``
  does (wait for gathers no forward waited for, then issue the next ones). A stage with
  nothing to train (``sizes[stage] == ()``) has no shard: one one-element allreduce, no
  gather, and no bucket at all.
- **Lazy communicators** (``lazy_communicators=True``): the first use of a communicator (a
  pair's first p2p call in ``pair`` mode, a group's first collective) blocks the CPU until
  every member reaches its own first use: NCCL creates it then. The runtime creates every
  communicator at start-up (``ProcessGrid.warm_up``), so :mod:`chimera.check.validate` replays
  with eager communicators; the lazy mode shows why that matters.
- **Data parallelism.** ``data_parallel=W`` replays W pipeline copies (global rank
  ``w * D + d``): p2p stays inside a copy, stage groups span all copies. The copies run in
  lock-step, so W >= 2 behaves like W = 2, which is W = 1 with every stage group reducing
  (with W = 1 a stage held once issues nothing). Progress here is monotone (a call that
  may complete stays so until it does), so removing those calls cannot create a deadlock:
  W = 2 passing implies W = 1 passing. The validator replays W = 2; tests replay both.
- **Tensor parallelism** (``tensor_parallel=T``): a TP group is one rank. Its T members run
  the pipeline rank's program (the API checks at start-up that they agree on it), with
  p2p and stage groups at their own t, and the collectives their layers issue inside each
  F, B and I on the TP group's communicator, in program order, each waited for before the
  compute goes on (:mod:`chimera.check.issued`). They join the rank's collective FIFO
  (strict: its one stream), as the NCCL emulation gates them: NCCL's worst case for
  communicators used concurrently. So a TP group is a rank whose computes block until its
  earlier collectives (strict: every earlier call) complete, and an order that lets a
  launch get ahead of a compute whose result another replica needs first deadlocks at
  T > 1 even where p2p and collectives have streams of their own. The members are
  symmetric, so T >= 2 behaves like T = 2 (the validator's replay).

**A recorded run** (:func:`replay_recorded`): the calls and waits a run really made, logged
by the virtual ranks (``chimera.runtime.virtual``, what ``benchmarks/gpu_check.py`` does on
a GPU), including the start-up, the trainer's and the API's own collectives (loss, norm,
ties, buffers, the batch fingerprint), replayed under the same rules: messages matched by
order per pair (tags and sizes must agree), collectives by order per group.

Not modelled by :func:`check`: timing (only whether progress is possible), buffering of
small messages (which only hides deadlocks), the start-up warm-up (its order is fixed and
global), collectives outside the schedule (loss, gradient norm, ties, buffers, the batch
fingerprint, checkpoints: blocking, in one program order on every rank; a recorded run
covers them), and, without sharding, more than one iteration (after STEP everything is
complete, so iterations do not interact).

The replay is event driven: each call is queued, matched and completed once, so it costs
O(number of calls).
"""

from __future__ import annotations

from collections import deque

from chimera.check.comm_plan import CommPlan
from chimera.errors import UserError
from chimera.ir import Schedule
from chimera.check.issued import (ALL_GATHER, ALL_REDUCE, COLLECTIVES, IRECV, ISEND, OTHERS,  # noqa: F401
                            REDUCE_SCATTER, TP, WAIT, Issued, action_index, at_tp_position,
                            bucket_sizes, group_key, issued_ops, pipeline_calls, ranks_text,
                            shifted, stage_group)
from chimera.check.validation_error import ValidationError

MODES = ("pair", "rank", "strict")  # strictest last
class RendezvousDeadlock(ValidationError):
    """The replay stopped with ranks left: ``stuck`` maps each stuck global rank to what it
    waits at; ``heads`` names the call at the head of each non-empty stream or FIFO."""

    def __init__(self, problem: str, schedule: Schedule, rank: int, index: int,
                 stuck: dict[int, str], heads: list[str]):
        self.stuck, self.heads = stuck, heads
        super().__init__(problem, schedule, rank, index)


class CollectiveMismatch(ValidationError):
    """Members of a stage group issue different collectives (kind, size or count): NCCL would
    hang, or reduce one member's bucket with another's."""


def check(plan: CommPlan, mode: str = "strict", data_parallel: int = 1,
          lazy_communicators: bool = False, buckets: bool = True, sharded: bool = False,
          sizes: dict[int, tuple[int, ...]] | None = None, tensor_parallel: int = 1) -> None:
    """Replay ``plan`` under NCCL's rules (module docstring): first every stage group's
    collectives are compared member by member (kind, size, count; raise CollectiveMismatch),
    then the replay raises RendezvousDeadlock if some rank can never finish its iteration.
    ``buckets``, ``sharded`` and ``sizes`` as in :func:`issued_ops`; ``tensor_parallel``: T
    ranks per pipeline rank (global rank (w*D + d)*T + t), their layers' collectives in."""
    if mode not in MODES:
        raise UserError(f"unknown stream mode {mode!r}; choose one of {', '.join(MODES)}")
    for name, value in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    depth, tp = plan.schedule.ranks, tensor_parallel
    copy0 = [pipeline_calls(plan, d, data_parallel, buckets, sharded, sizes, tp > 1)
             for d in range(depth)]
    pipeline = [shifted(c, w * depth) for w in range(data_parallel) for c in copy0]
    calls = [at_tp_position(c, g, t, tp) for g, c in enumerate(pipeline) for t in range(tp)]
    compare_groups(plan, calls, tp)
    _Replay(plan, calls, mode, lazy_communicators, tp).run()


def compare_groups(plan: CommPlan, calls: list[list[Issued]], tensor_parallel: int = 1) -> None:
    """Every member of a group issues the same sequence of (kind, size) on it. ``calls``: per
    global rank, (w*D + d)*T + t with ``tensor_parallel`` T."""
    seqs: dict[tuple, dict[int, list[Issued]]] = {}  # group -> member -> its collectives
    for r, mine in enumerate(calls):
        for c in mine:
            if c.kind in COLLECTIVES:
                seqs.setdefault(group_key(c), {}).setdefault(r, []).append(c)
    for key, members in sorted(seqs.items(), key=lambda kv: str(kv[0])):
        group = key[1]
        ranks = {m: members.get(m, []) for m in group}
        first, want = group[0], ranks[group[0]]
        for m, got in ranks.items():
            for k in range(max(len(got), len(want))):
                a = want[k] if k < len(want) else None
                c = got[k] if k < len(got) else None
                if a is None or c is None or (a.kind, a.size) != (c.kind, c.size):
                    raise _mismatch(plan, key, k, (first, a), (m, c), calls, tensor_parallel)


def _mismatch(plan: CommPlan, key: tuple, k: int, one, other, calls,
              tp: int = 1) -> CollectiveMismatch:
    depth = plan.schedule.ranks

    def text(rank, c):
        if c is None:
            return f"rank {rank} issues none"
        step = plan.steps[rank // tp % depth][c.step]
        return f"rank {rank} issues {c.describe(calls[rank])} at {step}"
    rank, c = other if other[1] is not None else one
    d = rank // tp % depth
    index = min(action_index(plan.steps[d], c.step), len(plan.schedule.programs[d]) - 1)
    group = (f"the tensor-parallel group {ranks_text(key[1])}" if key[0] == TP else
             f"stage {key[0]}'s group")
    return CollectiveMismatch(f"{group}: collective #{k} differs between its members: "
                              f"{text(*one)}; {text(*other)}", plan.schedule, d, index)


class _Replay:
    def __init__(self, plan: CommPlan, calls: list[list[Issued]], mode: str, lazy: bool,
                 tp: int = 1):
        self.plan, self.calls, self.mode, self.lazy, self.tp = plan, calls, mode, lazy, tp
        n = len(calls)
        self.pc = [0] * n
        self.done = [bytearray(len(c)) for c in calls]
        self.streams: dict[object, deque[tuple[int, int]]] = {}
        self.arrived: dict[tuple, dict[int, object]] = {}  # collective -> member -> its stream
        self.coll_id = [self._number_collectives(c) for c in calls]
        self.first = [self._first_uses(r, c) for r, c in enumerate(calls)] if lazy else []
        self.created: set[tuple] = set()
        self.waiting_for: dict[tuple, set[int]] = {}  # lazy communicator -> arrived members
        self.ready = deque(range(n))

    # -- set-up -------------------------------------------------------------------------
    @staticmethod
    def _number_collectives(calls: list[Issued]) -> dict[int, tuple]:
        """NCCL matches the k-th collective on a communicator with every member's k-th, which
        must be of the same kind and size. Each stage has its own group, even where two have
        the same members."""
        count: dict[tuple, int] = {}
        out = {}
        for i, c in enumerate(calls):
            if c.kind in COLLECTIVES:
                key = group_key(c)
                k = count[key] = count.get(key, -1) + 1
                out[i] = (c.group, key, k, c.kind, c.size)
        return out

    def _first_uses(self, rank: int, calls: list[Issued]) -> dict[int, tuple]:
        """Index of each call that first uses a communicator -> (communicator, members)."""
        seen, out = set(), {}
        for i, c in enumerate(calls):
            if c.kind == TP:
                comm = ("the tensor-parallel group", c.group)
            elif c.kind in COLLECTIVES:
                comm = (f"stage {c.stage}", c.group)
            elif c.kind in (ISEND, IRECV) and self.mode == "pair":
                comm = ("pair", tuple(sorted((rank, c.peer))))
            else:
                continue
            if comm not in seen:
                seen.add(comm)
                out[i] = comm
        return out

    def _stream(self, rank: int, c: Issued):
        """The FIFO ``c`` joins: per pair of ranks, per rank (p2p), or one per rank for all."""
        if c.kind in COLLECTIVES:
            return rank if self.mode == "strict" else ("collectives", rank)
        return self._p2p_stream(rank, c.peer)

    def _p2p_stream(self, rank: int, peer: int):
        return (rank, peer) if self.mode == "pair" else rank

    # -- the replay ---------------------------------------------------------------------
    def run(self) -> None:
        while self.ready:
            self._advance(self.ready.popleft())
        if any(pc < len(c) for pc, c in zip(self.pc, self.calls)):
            raise self._deadlock()

    def _advance(self, r: int) -> None:
        """Run rank ``r``'s CPU until it blocks or its calls are all issued."""
        calls, done = self.calls[r], self.done[r]
        while self.pc[r] < len(calls):
            i = self.pc[r]
            c = calls[i]
            if self.lazy and i in self.first[r] and not self._communicator_ready(r, i):
                return  # woken when the last member arrives
            if c.kind == WAIT and not done[c.target]:
                return  # woken by _complete
            self.pc[r] = i + 1  # before queueing: a completion looks at where the rank is
            if c.kind != WAIT:
                key = self._stream(r, c)
                queue = self.streams.setdefault(key, deque())
                queue.append((r, i))
                if len(queue) == 1:
                    self._progress(key)

    def _communicator_ready(self, r: int, i: int) -> bool:
        comm = self.first[r][i]
        if comm in self.created:
            return True
        members = comm[1]
        arrived = self.waiting_for.setdefault(comm, set())
        arrived.add(r)
        if len(arrived) < len(members):
            return False
        self.created.add(comm)
        self.ready.extend(m for m in members if m != r)
        return True

    def _complete(self, r: int, i: int) -> None:
        self.done[r][i] = 1
        pc = self.pc[r]
        if pc < len(self.calls[r]) and self.calls[r][pc].target == i:
            self.ready.append(r)

    def _progress(self, key) -> None:
        """Complete what the heads of the streams allow, starting from stream ``key``: a send
        and its receive at the heads of their streams, a collective at the head of every
        member's."""
        todo = [key]
        while todo:
            key = todo.pop()
            queue = self.streams[key]
            if queue:
                r, i = queue[0]
                done = self._collective(r, i, key) if self.calls[r][i].kind in COLLECTIVES \
                    else self._message(r, i, key)
                todo += done

    def _message(self, r: int, i: int, key) -> list:
        c = self.calls[r][i]
        other = self._p2p_stream(c.peer, r)
        peer_queue = self.streams.get(other)
        if not peer_queue:
            return []
        q, j = peer_queue[0]
        d = self.calls[q][j]
        if d.peer != r or d.kind not in (ISEND, IRECV) or d.kind == c.kind or d.message != c.message:
            return []
        self.streams[key].popleft()
        peer_queue.popleft()
        self._complete(r, i)
        self._complete(q, j)
        return [key, other]

    def _collective(self, r: int, i: int, key) -> list:
        ident = self.coll_id[r][i]
        arrived = self.arrived.setdefault(ident, {})
        arrived[r] = key
        if len(arrived) < len(ident[0]):
            return []
        del self.arrived[ident]
        for m, k in arrived.items():
            self._complete(m, self.streams[k].popleft()[1])
        return list(arrived.values())

    # -- the report ---------------------------------------------------------------------
    def _deadlock(self) -> RendezvousDeadlock:
        s = self.plan.schedule
        stuck = {r: self._stuck_text(r) for r, c in enumerate(self.calls) if self.pc[r] < len(c)}
        heads = self._heads()
        first = min(stuck, key=lambda r: (self.calls[r][self.pc[r]].kind != WAIT, r))
        d = self._pipeline_rank(first)
        index = action_index(self.plan.steps[d], self.calls[first][self.pc[first]].step)
        index = min(index, len(s.programs[d]) - 1)
        streams = {"pair": "one per pair of ranks", "rank": "one per rank",
                   "strict": "one per rank, shared with the collectives"}[self.mode]
        comms = "lazily" if self.lazy else "eagerly"
        ranks = len(self.calls)
        tp = f", T={self.tp} per pipeline rank" if self.tp > 1 else ""
        problem = (f"rendezvous deadlock under NCCL semantics ({ranks} ranks{tp}; p2p streams: "
                   f"{streams}; communicators created {comms}):\n"
                   + "\n".join(f"  {t}" for t in stuck.values())
                   + "\nat the head of each stream and collective queue:\n"
                   + "\n".join(f"  {h}" for h in heads))
        return RendezvousDeadlock(problem, s, d, index, stuck, heads)

    def _pipeline_rank(self, r: int) -> int:
        """d of global rank ``r`` = (w*D + d)*T + t."""
        return r // self.tp % self.plan.schedule.ranks

    def _stuck_text(self, r: int) -> str:
        i = self.pc[r]
        c = self.calls[r][i]
        where = self._step_text(r, c.step)
        if self.lazy and i in self.first[r] and self.first[r][i] not in self.created:
            comm = self.first[r][i]
            missing = sorted(set(comm[1]) - self.waiting_for.get(comm, set()))
            return (f"rank {r} blocks at {where}: creating the communicator of {comm[0]} "
                    f"(ranks {ranks_text(comm[1])}) for {c.describe(self.calls[r])}; "
                    f"rank {ranks_text(missing)} not there")
        return f"rank {r} blocks at {where}: {c.describe(self.calls[r])}"

    def _heads(self) -> list[str]:
        out = []
        for key, queue in sorted(self.streams.items(), key=lambda kv: str(kv[0])):
            if queue:
                r, i = queue[0]
                c = self.calls[r][i]
                if isinstance(key, tuple) and key[0] == "collectives":
                    name = f"collectives of rank {key[1]}"
                elif isinstance(key, tuple):
                    name = f"stream {key[0]}<->{key[1]} on rank {key[0]}"
                else:
                    name = f"{'stream' if self.mode == 'strict' else 'p2p stream'} of rank {key}"
                out.append(f"{name}: {c.describe(self.calls[r])} ({self._step_text(r, c.step)})")
        return out or ["(all empty: the ranks block on the CPU)"]

    def _step_text(self, r: int, step: int) -> str:
        return f"{self.plan.steps[self._pipeline_rank(r)][step]}"


# -- a recorded run -------------------------------------------------------------------------
class RecordedError(UserError):
    """A recorded run's calls do not complete, or do not match, under NCCL's rules."""


def replay_recorded(log: list[list[tuple[str, dict]]], mode: str = "strict") -> int:
    """Replay the calls a run made (``chimera.runtime.virtual.VirtualWorld(record=True)``)
    under NCCL's rules in stream ``mode`` (default: one stream per rank for everything):
    the k-th send from a to b meets the k-th receive at b from a (their tags and sizes must
    agree), the k-th collective of a group every member's k-th (same kind and size). Raise
    RecordedError if they do not match or some rank could never finish; return the number of
    calls replayed."""
    calls = [_recorded_calls(r, mine) for r, mine in enumerate(log)]
    _check_recorded_pairs(log)
    seqs: dict[int, dict[int, list[tuple]]] = {}
    groups: dict[int, tuple[int, ...]] = {}
    for r, mine in enumerate(calls):
        for c in mine:
            if c.kind in COLLECTIVES:
                seqs.setdefault(c.stage, {}).setdefault(r, []).append((c.kind, c.size))
                groups[c.stage] = c.group
    for key, members in seqs.items():
        if len({tuple(v) for v in members.values()}) > 1 or len(members) != len(groups[key]):
            text = "; ".join(f"rank {m}: {v}" for m, v in sorted(members.items()))
            raise RecordedError(f"group {key}: members issue different collectives ({text})")
    _RecordedReplay(calls, mode).run()
    return sum(map(len, calls))


def _recorded_calls(rank: int, mine: list[tuple[str, dict]]) -> list[Issued]:
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    out = []
    for i, (kind, f) in enumerate(mine):
        if kind == ISEND:
            k = sent[f["peer"]] = sent.get(f["peer"], -1) + 1
            out.append(Issued(ISEND, i, f["peer"], (rank, f["peer"], k)))
        elif kind == IRECV:
            k = received[f["peer"]] = received.get(f["peer"], -1) + 1
            out.append(Issued(IRECV, i, f["peer"], (f["peer"], rank, k)))
        elif kind == WAIT:
            out.append(Issued(WAIT, i, target=f["target"]))
        else:
            out.append(Issued(f["name"], i, group=f["ranks"], stage=f["group"], size=f["size"]))
    return out


def _check_recorded_pairs(log) -> None:
    """The k-th send from a to b and the k-th receive at b from a carry one tag and size."""
    ends: dict[tuple, dict[str, tuple]] = {}
    for rank, mine in enumerate(log):
        count: dict[tuple, int] = {}
        for kind, f in mine:
            if kind in (ISEND, IRECV):
                pair = (rank, f["peer"]) if kind == ISEND else (f["peer"], rank)
                k = count[(kind, pair)] = count.get((kind, pair), -1) + 1
                ends.setdefault((*pair, k), {})[kind] = (f["tag"], f["size"])
    for (a, b, k), got in sorted(ends.items()):
        if len(set(got.values())) > 1:
            raise RecordedError(f"message #{k} from rank {a} to rank {b}: the send has (tag, "
                                f"size) {got[ISEND]}, the receive {got[IRECV]}: NCCL would "
                                "deliver the wrong tensor")


class _RecordedReplay(_Replay):
    """The replay of recorded calls: no plan, steps are call indices."""

    def __init__(self, calls: list[list[Issued]], mode: str):
        super().__init__(None, calls, mode, False)

    def _deadlock(self) -> RecordedError:
        stuck = [f"  rank {r} blocks at call #{self.pc[r]}: "
                 f"{self.calls[r][self.pc[r]].describe(self.calls[r])}"
                 for r, c in enumerate(self.calls) if self.pc[r] < len(c)]
        return RecordedError("the recorded calls deadlock under NCCL semantics "
                             f"({mode_text(self.mode)}):\n"
                             + "\n".join(stuck) + "\nat the head of each stream:\n"
                             + "\n".join(f"  {h}" for h in self._heads()))

    def _step_text(self, r: int, step: int) -> str:
        return f"call #{step}"


def mode_text(mode: str) -> str:
    return {"pair": "one stream per pair of ranks", "rank": "one p2p stream per rank",
            "strict": "one stream per rank for p2p and collectives"}[mode]
