"""Golden digests of generated programs: speed-ups of the list schedulers must not change them.

chimera-zb's event-driven play (``schedules.list_play``) and the slot engine behind GEMS and
Chimera with Q > 2 (``schedules.engine``) were rewritten for speed; these digests were taken
from the plain versions before (rescanning every ready task at every event). Two-pipe Chimera
follows the official slot rule (``schedules.chimera_slots``, issue 14); its digests pin that rule. Regenerate after an
intended change of a schedule with ``python tests/test_golden_schedules.py`` and paste.
"""

import hashlib

import pytest

from chimera.ir import Placement
from chimera.schedules import build
from chimera.schedules.chimera_zb import RESERVES, RULES, op_times, play
from chimera.sim import CostModel

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
GOLDEN = {
    "chimera-zb D4 N8": "145c395022ec13ba",
    "chimera-zb D8 N16 Q4 1:2:1": "3c1021cbae7a5e26",
    "chimera-zb D8 N13 hop cap9": "6a3c9f60ec9fdccd",
    "chimera-zb D6 N9 2:1:1 cap4": "67cee22e5ebafd67",
    "chimera-zb D4 N5 per-stage": "f0f81a938d133953",
    "chimera-zb D16 N32 Q8": "ee530940f5faf192",
    "chimera D8 N16 Q4 direct": "2bd612c5374df84f",
    "chimera D8 N16 doubling": "af061411c779ea29",
    "chimera D8 N12 halving": "5f478cce487be171",
    "chimera D6 N12 direct": "9dada54113435524",
    "chimera D8 N20 direct": "1c7bd0af42e07fce",
    "gems D8 N8": "30d0a0908005e1ef",
    "play D6 N9 1:2:1 ifw/one": "0b5e1ab4d9e51525 45.0",
    "play D6 N9 1:2:1 ifw/1f1b": "0b5e1ab4d9e51525 45.0",
    "play D6 N9 1:2:1 fiw/one": "9a19ec271f369108 45.0",
    "play D6 N9 1:2:1 fiw/1f1b": "9a19ec271f369108 45.0",
    "play D6 N9 1:2:1 ifw-shallow/one": "a9efd497f5a8febf 48.0",
    "play D6 N9 1:2:1 ifw-shallow/1f1b": "40fba2d098dae13b 47.0",
    "play D6 N9 1:2:1 ifw-deep/one": "0b5e1ab4d9e51525 45.0",
    "play D6 N9 1:2:1 ifw-deep/1f1b": "0b5e1ab4d9e51525 45.0",
    "play D6 N9 1:2:1 critical-path/one": "8dbaf32d262ce8a5 48.0",
    "play D6 N9 1:2:1 critical-path/1f1b": "f4aa1f0de1a2cd35 49.0",
    "play D6 N9 1:2:1 ifw-unblock/one": "7dc5455e3fa20fe9 45.0",
    "play D6 N9 1:2:1 ifw-unblock/1f1b": "7dc5455e3fa20fe9 45.0",
    "play D6 N9 1:2:1 fiw-unblock/one": "04e6dd116af60188 41.0",
    "play D6 N9 1:2:1 fiw-unblock/1f1b": "04e6dd116af60188 41.0",
    "play D6 N9 hop ifw/one": "13026e0edfe46a40 38.0",
    "play D6 N9 hop ifw/1f1b": "dc29af6d5c3a0bb7 38.0",
    "play D6 N9 hop fiw/one": "331dd083a7f91c7c 38.0",
    "play D6 N9 hop fiw/1f1b": "af8a13fc134db293 36.0",
    "play D6 N9 hop ifw-shallow/one": "ff64f03928ccd7b7 38.0",
    "play D6 N9 hop ifw-shallow/1f1b": "e07debfeccc8e088 37.5",
    "play D6 N9 hop ifw-deep/one": "13026e0edfe46a40 38.0",
    "play D6 N9 hop ifw-deep/1f1b": "dc29af6d5c3a0bb7 38.0",
    "play D6 N9 hop critical-path/one": "382b84dd0e13c921 39.0",
    "play D6 N9 hop critical-path/1f1b": "6173a7ed0d04b732 38.0",
    "play D6 N9 hop ifw-unblock/one": "d1dbb8ba4732878c 39.0",
    "play D6 N9 hop ifw-unblock/1f1b": "8a1086011ac664dc 38.0",
    "play D6 N9 hop fiw-unblock/one": "b76e1d3a2bdf68ce 38.5",
    "play D6 N9 hop fiw-unblock/1f1b": "f741f655adb9ccbc 36.0",
}


def digest(programs) -> str:
    text = "\n".join(" ".join(map(str, prog)) for prog in programs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def current() -> dict[str, str]:
    out = {key: digest(build(name, d, n, **kw).programs) for key, (name, d, n, kw) in BUILDS.items()}
    placement, micro_pipe = Placement.chimera(6, 2), tuple(m % 2 for m in range(9))
    for cost in ("1:2:1", HOP):
        times = op_times(cost, 6, 6)
        for variant in [f"{r}/{v}" for r in RULES for v in RESERVES]:
            programs, span = play(placement, micro_pipe, times, 6, variant)
            label = "hop" if cost is HOP else cost
            out[f"play D6 N9 {label} {variant}"] = f"{digest(programs)} {span!r}"
    return out


@pytest.fixture(scope="module")
def digests() -> dict[str, str]:
    return current()


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_programs_match_their_golden_digest(key, digests):
    assert digests[key] == GOLDEN[key]


def test_every_case_has_a_digest(digests):
    assert set(digests) == set(GOLDEN)


if __name__ == "__main__":
    for key, value in current().items():
        print(f'    "{key}": "{value}",')
