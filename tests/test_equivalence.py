"""Every schedule gives the gradients of single-process training (gloo, several processes).

Each world size is spawned once and runs all of its configurations; every replica's
gradient after one iteration is compared with the single-process reference of the same
mini-batch, then a few AdamW steps must give the reference losses and bit-identical replicas.
"""

import pytest

from chimera.train import TrainConfig
from chimera.train.equivalence import check_equivalence

pytestmark = pytest.mark.slow  # most tests here share a multi-process run (module fixture)

F64 = dict(dtype="float64", steps=3, progress=False)

D2 = [
    ("gpipe", {}, 2), ("gpipe", {}, 4), ("1f1b", {}, 2), ("1f1b", {}, 4),
    ("interleaved", {"chunks": 2}, 2), ("interleaved", {"chunks": 2}, 4),
    ("gems", {}, 2), ("gems", {}, 4), ("zb-h1", {}, 4),
    ("chimera", {}, 2), ("chimera", {}, 4), ("chimera", {"strategy": "doubling"}, 4),
    ("chimera", {"strategy": "halving"}, 2), ("chimera", {"strategy": "halving"}, 4),
    ("chimera", {"recompute": True}, 4),
    ("zb-v", {}, 4), ("dualpipev", {}, 4), ("dualpipe", {}, 4),
    ("chimera-zb", {}, 4), ("chimera-zb", {}, 5), ("chimera-zb", {"recompute": True}, 4),
]
D4 = [
    ("gpipe", {}, 4), ("1f1b", {}, 8), ("interleaved", {"chunks": 2}, 4), ("gems", {}, 8),
    ("chimera", {}, 4), ("chimera", {}, 8), ("chimera", {"strategy": "doubling"}, 8),
    ("chimera", {"strategy": "halving"}, 4), ("chimera", {"pipes": 4}, 8), ("zb-h1", {}, 8),
    ("zb-v", {}, 8), ("dualpipev", {}, 8), ("dualpipe", {}, 8), ("chimera-zb", {}, 8),
    ("chimera-zb", {"pipes": 4}, 8),
]
W2_ZB = [("chimera-zb", {}, 4)]
BIDIRECTIONAL = ("chimera", "gems", "chimera-zb", "dualpipe")  # two (or Q) copies of each stage
W2 = [("chimera", {}, 2), ("chimera", {}, 4), ("1f1b", {}, 4), ("chimera", {"strategy": "doubling"}, 4)]


def _configs(rows, stages, dp=1, **extra):
    return [TrainConfig(schedule=s, stages=stages, micro_batches=n, data_parallel=dp,
                        **{**F64, **extra, **kw}) for s, kw, n in rows]


@pytest.fixture(scope="module")
def world2():
    cfgs = _configs(D2, 2) + [
        TrainConfig(schedule="chimera", stages=2, micro_batches=4, steps=3, progress=False),  # float32
        TrainConfig(model="bert-tiny", schedule="chimera", stages=2, micro_batches=4, **F64),
    ]
    return check_equivalence(cfgs)


@pytest.fixture(scope="module")
def world4():
    return check_equivalence(_configs(D4, 4) + _configs(W2 + W2_ZB, 2, dp=2))


def _check(report):
    c = report["config"]
    tol = 1e-10 if c["dtype"] == "float64" else 1e-5
    what = f"{c['model']} {c['schedule']} D={c['stages']} N={c['micro_batches']} W={c['data_parallel']} " \
           f"{c['strategy'] or ''} pipes={c['pipes']} recompute={c['recompute']}"
    assert not report["missing"], what
    assert report["max_grad_rel_err"] < tol, what
    assert report["max_loss_rel_err"] < tol, what
    assert report["replicas_identical"], what
    return c


def test_world_of_two(world2):
    assert len(world2) == len(D2) + 2
    for report in world2:
        c = _check(report)
        assert report["min_replicas"] == (2 if c["schedule"] in BIDIRECTIONAL else 1)


def test_world_of_four(world4):
    assert len(world4) == len(D4) + len(W2) + len(W2_ZB)
    for report in world4:
        c = _check(report)
        replicas = (c["pipes"] or 2) if c["schedule"] in BIDIRECTIONAL else 1
        assert report["min_replicas"] == replicas * c["data_parallel"]


def test_losses_decrease_and_are_reported(world2):
    report = world2[0]
    assert len(report["losses"]) == 3
    assert report["losses"][-1] < report["losses"][0]
