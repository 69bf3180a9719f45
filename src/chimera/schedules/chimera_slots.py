"""Chimera's two-pipe order as the paper's code runs it: every replica has fixed slots.

Worker i holds stage i of the down pipe and stage D-1-i of the up pipe. Of its two replicas,
the one in the first half of its pipe (stage s = min(i, D-1-i) < D/2) is its **own** replica,
the other (stage D-1-s) its **other** one. A *forward slot* runs g micro-batches of one pipe
(g = 1 for direct concatenation, g = 2 for forward doubling and backward halving, so that with
B = 2F a forward slot is as long as a backward slot); a *backward slot* runs one. A unit holds
g·D/2 micro-batches per pipe. With a = D/2 - s, each unit on worker i runs, in this order::

    1. a times:           [B own, tail of the previous unit]  F own
    2. s times:           F other   F own
    3. a times:           F other   B other
    4. g·D/2 - a times:   B own     B other
   after the last unit, a times: B own

Forwards and backwards of one replica run in micro-batch order. This is the loop of the
official SC'21 code (``schedule_number_a``, ``_b`` and ``_c`` = b + D/2 in its forward-doubling
runtime) written once for both g: phase 1 of a unit takes the previous unit's last backwards
of the own pipe, so units chain with no gap, and in phase 2 the other pipe's forward goes
first (it arrives from the far end and would otherwise wait). Forward doubling at D=4, one
unit of N=8, B=2F (``chimera show -s chimera -D 4 -N 8 --strategy doubling --cost 1:2``;
UPPER = down pipe, lower = up pipe, one column = one F)::

    P0 | F0 F1 F2 F3 f4 f5 b4 b4 f6 f7 b5 b5 .  B0 B0 b6 b6 B1 B1 b7 b7 B2 B2 .  .  B3 B3
    P1 | .  F0 F1 f4 f5 F2 F3 f6 f7 b4 b4 B0 B0 b5 b5 B1 B1 b6 b6 B2 B2 b7 b7 B3 B3 .  .
    P2 | .  f4 f5 F0 F1 f6 f7 F2 F3 B0 B0 b4 b4 B1 B1 b5 b5 B2 B2 b6 b6 B3 B3 b7 b7 .  .
    P3 | f4 f5 f6 f7 F0 F1 B0 B0 F2 F3 B1 B1 .  b4 b4 B2 B2 b5 b5 B3 B3 b6 b6 .  .  b7 b7

P0 (s=0, a=2): phase 1 is F0F1 F2F3, phase 3 f4f5 b4, f6f7 b5, phase 4 (2 times) B0 b6, B1 b7,
then B2 B3 close the unit (or open the next one, before F8F9 and F10F11). P1 (s=1, a=1):
F0F1 | f4f5 F2F3 | f6f7 b4 | B0 b5, B1 b6, B2 b7 | B3. With N=16 the second unit's forwards
fill the first one's tail: 51 units for 48 of work, against 27 for 24 with one unit.

Within a unit this order puts a backward right after the one it waits for on the neighbour,
so it exposes a p2p latency more than a greedy merge does (benchmarks/RESULTS.md, doubling
order); across units it wins far more than that back.

A partial last unit (N not a multiple of the unit) runs as a full one with the missing
micro-batches left out: every rank's order stays a sub-order of a valid full one, so it is
deadlock-free too.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from chimera.ir import Action, Op


def slot_programs(stages: int, micro_pipe: Sequence[int], group: int) -> list[list[Action]]:
    """Every worker's actions under the slot rule; ``micro_pipe`` is cut into units of
    ``group * stages / 2`` micro-batches per pipe, in micro-batch order (two pipes)."""
    per_unit = group * stages // 2
    units = [_units(micro_pipe, p, per_unit, group) for p in (0, 1)]
    return [_worker(stages, i, units, per_unit) for i in range(stages)]


def _units(micro_pipe: Sequence[int], pipe: int, per_unit: int, group: int) -> list[list[tuple]]:
    """The forward slots (tuples of ``group`` micro-batches) of ``pipe``, unit by unit."""
    micros = [m for m, p in enumerate(micro_pipe) if p == pipe]
    units = [micros[k:k + per_unit] for k in range(0, len(micros), per_unit)]
    return [[tuple(u[j:j + group]) for j in range(0, len(u), group)] for u in units]


def _worker(stages: int, i: int, units: list[list[list[tuple]]], per_unit: int) -> list[Action]:
    own = 0 if i < stages // 2 else 1
    s = min(i, stages - 1 - i)
    a = stages // 2 - s
    f_own, f_other = _Replica(own, s, units[own]), _Replica(1 - own, stages - 1 - s, units[1 - own])
    out: list[Action] = []
    for k in range(max(len(units[0]), len(units[1]))):
        for j in range(a):                                    # 1. tail of unit k-1, then own
            out += f_own.backward() if k else []
            out += f_own.forward(k, j)
        for j in range(s):                                    # 2. other pipe's forward first
            out += f_other.forward(k, j) + f_own.forward(k, a + j)
        for j in range(a):                                    # 3.
            out += f_other.forward(k, s + j) + f_other.backward()
        for _ in range(per_unit - a):                         # 4.
            out += f_own.backward() + f_other.backward()
    for _ in range(a):
        out += f_own.backward()
    return out


class _Replica:
    """One stage of one pipe on a worker: forward slots by (unit, index), backwards in the
    order the forwards ran (a slot the unit lacks, at the end of a partial unit, is empty)."""

    def __init__(self, pipe: int, stage: int, units: list[list[tuple]]):
        self.pipe, self.stage, self.units = pipe, stage, units
        self.pending: deque[int] = deque()

    def forward(self, unit: int, j: int) -> list[Action]:
        if unit >= len(self.units) or j >= len(self.units[unit]):
            return []
        self.pending.extend(self.units[unit][j])
        return [Action(Op.F, self.pipe, self.stage, m) for m in self.units[unit][j]]

    def backward(self) -> list[Action]:
        return [Action(Op.B, self.pipe, self.stage, self.pending.popleft())] if self.pending else []
