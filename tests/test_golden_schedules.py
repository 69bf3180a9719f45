"""Golden schedules: generated programs, as text, must not change unless meant to.

The one list scheduler (``schedules.list_play``), behind chimera-zb, GEMS and Chimera with
Q > 2, was rewritten for speed and merged from two; these programs are the ones the plain
versions played (rescanning every ready task at every event). Two-pipe Chimera
follows the official slot rule (``schedules.chimera_slots``, issue 14); its goldens pin that
rule. Each case is one file in ``tests/golden/``: a header line, then ``Schedule.to_text()``
(one line per rank: ``rank: action action ...``), so a change shows as a readable diff.

After an intended change of a schedule: ``pytest tests/test_golden_schedules.py
--regen-goldens``, and review the diff of ``tests/golden/`` before committing it.
"""

import re
from pathlib import Path

import pytest

from chimera.ir import Placement
from chimera.schedules import build
from chimera.schedules.chimera_zb import RESERVES, RULES, op_times, play
from chimera.sim import CostModel

GOLDEN = Path(__file__).parent / "golden"
HOP = CostModel.unit(1, i=1, w=1, p2p_time=0.5)
STAGED = CostModel(f=(1.0, 1.5, 0.7, 1.2), b=(2.0, 2.5, 1.5, 2.2), p2p_time=0.25)
BUILDS = {
    "chimera-zb D4 N8": ("chimera-zb", 4, 8, {}),
    "chimera-zb D8 N16 Q4 1:2:1": ("chimera-zb", 8, 16, {"pipes": 4, "cost": "1:2:1"}),
    "chimera-zb D8 N13 hop cap9": ("chimera-zb", 8, 13, {"cost": HOP, "cap": 9}),
    "chimera-zb D6 N9 2:1:1 cap4": ("chimera-zb", 6, 9, {"cost": "2:1:1", "cap": 4}),
    "chimera-zb D4 N5 per-stage": ("chimera-zb", 4, 5, {"cost": STAGED}),
    "chimera-zb D16 N32 Q8": ("chimera-zb", 16, 32, {"pipes": 8}),
    "chimera D8 N16 Q4 direct": ("chimera", 8, 16, {"pipes": 4}),
    "chimera D8 N16 doubling": ("chimera", 8, 16, {"strategy": "doubling"}),
    "chimera D8 N12 halving": ("chimera", 8, 12, {"strategy": "halving"}),
    "chimera D6 N12 direct": ("chimera", 6, 12, {}),
    "chimera D8 N20 direct": ("chimera", 8, 20, {}),
    "gems D8 N8": ("gems", 8, 8, {}),
}
# chimera-zb's play of D=6, N=9 under each rule and reserve, with and without a p2p hop
PLAYS = {f"play D6 N9 {label} {rule}/{reserve}": (cost, f"{rule}/{reserve}")
         for label, cost in (("1:2:1", "1:2:1"), ("hop", HOP))
         for rule in RULES for reserve in RESERVES}
CASES = sorted([*BUILDS, *PLAYS])


def path_of(case: str) -> Path:
    return GOLDEN / (re.sub(r"[^A-Za-z0-9.-]+", "_", case.replace(":", "-")) + ".txt")


def render(case: str) -> str:
    """The case's golden text: what built it, then its programs (and a play's makespan)."""
    if case in BUILDS:
        name, d, n, kw = BUILDS[case]
        args = "".join(f", {k}={_named(v)}" for k, v in kw.items())
        return f"# {case}: build({name!r}, {d}, {n}{args})\n{build(name, d, n, **kw).to_text()}\n"
    cost, variant = PLAYS[case]
    placement, micro_pipe = Placement.chimera(6, 2), tuple(m % 2 for m in range(9))
    programs, span = play(placement, micro_pipe, op_times(cost, 6, 6), 6, variant)
    lines = [f"{r}: " + " ".join(map(str, prog)) for r, prog in enumerate(programs)]
    return (f"# {case}: play(cost={_named(cost)}, variant={variant!r}), makespan {span!r}\n"
            + "\n".join(lines) + "\n")


def _named(value) -> str:
    return {id(HOP): "HOP", id(STAGED): "STAGED"}.get(id(value), repr(value))


def first_difference(got: str, want: str) -> str:
    for k, (a, b) in enumerate(zip(got.splitlines(), want.splitlines())):
        if a != b:
            return f"line {k + 1} differs:\n  golden: {b}\n  now:    {a}"
    return f"{len(got.splitlines())} lines now, {len(want.splitlines())} in the golden file"


@pytest.mark.parametrize("case", CASES)
def test_schedule_equals_its_golden_text(case, regen_goldens):
    path, text = path_of(case), render(case)
    if regen_goldens:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden file {path.name}: run pytest {__file__} --regen-goldens"
    want = path.read_text()
    assert text == want, f"{case}: {first_difference(text, want)} (intended? --regen-goldens)"


def test_every_golden_file_is_a_case(regen_goldens):
    files = {p.name for p in GOLDEN.glob("*.txt")}
    cases = {path_of(c).name for c in CASES}
    assert len(cases) == len(CASES)  # no two cases share a file
    if regen_goldens:
        for stale in files - cases:
            (GOLDEN / stale).unlink()
        return
    assert files == cases, f"golden files without a case: {sorted(files - cases)}"
