"""CheckpointManager: one owner of a run's checkpoint folder. The lease keeps a second live run
out, saving publishes whole and prunes to the keep policy, an interrupted save leaves the last
good checkpoint loadable, and after a divergence the verdicts steer restore to the last good
one."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chimera.train import TrainConfig
from chimera.train import checkpoint as ckpt
from chimera.train.checkpoint import CheckpointManager
from chimera.train.checkpoint.lease import Lease
from chimera.train.loop import Trainer

UNCONFIRMED = {"status": ckpt.UNCONFIRMED}


def ref_cfg(data, **kw):
    base = dict(schedule="none", stages=1, micro_batch_size=8, dtype="float64", steps=4,
                data=data, progress=False)
    return TrainConfig(**{**base, **kw})


def by(step, loss=5.0):
    return {"by": f"step {step}", "loss": loss, "grad_norm": 1.0}


def names(directory):
    return [p.name for _, p in ckpt.published(directory)]


def copy(params):
    return [p.detach().clone() for p in params]


HOLD = """
import sys
from chimera.train.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1])
manager.claim(resume=False)
print(manager.lease.run_id, flush=True)
sys.stdin.read()  # held until the test closes our stdin or kills us
"""


@pytest.mark.slow
def test_a_claim_is_refused_while_another_live_run_holds_the_folder(data, tmp_path, cli_env):
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=cli_env)
    try:
        run_id = other.stdout.readline().strip()
        assert run_id, "the other run did not claim the folder"
        manager = CheckpointManager(tmp_path)
        with pytest.raises(ckpt.CheckpointError, match=f"in use by run {run_id}, pid {other.pid}"):
            manager.claim(resume=True)
        t = Trainer(ref_cfg(data))
        with pytest.raises(ckpt.CheckpointError, match="in use by"):  # nor a lease-less save
            manager.save(t, 1)
        assert names(tmp_path) == []
    finally:
        other.kill()  # killed, not released: the kernel drops the lock, none is left stale
        other.wait()
    with CheckpointManager(tmp_path) as manager:
        manager.claim(resume=False)
        assert manager.lease.run_id != run_id


def test_save_and_prune_keep_the_policy(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    with CheckpointManager(tmp_path, keep=2) as manager:
        manager.claim(resume=False)
        ckpt.save(t, tmp_path, 1, keep=1, lease=Lease(tmp_path, "theirs"))  # another run's
        verdicts = {2: None, 3: None, 4: "the loss 60 is a spike", 5: None}
        for step, why in verdicts.items():
            path = manager.save(t, step, UNCONFIRMED)
            if step < 5:  # the newest is never judged: the run ended first
                manager.judge(path, why, by(step))
    # the newest two of ours, our newest healthy one whatever keep says, and theirs
    assert names(tmp_path) == ["step-00000001", "step-00000003", "step-00000004", "step-00000005"]
    assert ckpt.owner(tmp_path / "step-00000001") == "theirs"
    status = {n: ckpt.health_of(ckpt.read_meta(tmp_path / n))["status"] for n in names(tmp_path)}
    assert status["step-00000003"] == "healthy" and status["step-00000004"] == "in doubt"
    assert status["step-00000005"] == "unconfirmed"
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".del-*"))


def test_a_save_interrupted_midway_leaves_the_last_good_one_loadable(data, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    t = Trainer(ref_cfg(data))
    t.step(0)
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(t, 1)
    good = copy(t.params)
    t.step(1)

    def half_then_die(self, plan, planner):  # a crash after half of a tensor file is written
        (Path(self.path) / "__0_0.distcp").write_bytes(b"\0" * 1000)
        raise OSError(5, "Input/output error", "__0_0.distcp")
    with monkeypatch.context() as patch:
        patch.setattr(FileSystemWriter, "write_data", half_then_die)
        with pytest.raises(ckpt.CheckpointIOError, match="Input/output error"):
            manager.save(t, 2)
    assert (tmp_path / ".tmp-step-00000002" / "__0_0.distcp").is_file()  # never read
    assert names(tmp_path) == ["step-00000001"]
    ckpt.verify(tmp_path / "step-00000001")  # whole, every file as written
    fresh = Trainer(ref_cfg(data))
    assert CheckpointManager(tmp_path).restore(fresh) == 1
    assert all(torch.equal(a, b) for a, b in zip(good, fresh.params))
    manager.save(t, 3)  # the next save clears the leftover
    assert names(tmp_path) == ["step-00000003"] and not list(tmp_path.glob(".tmp-*"))


def test_judge_and_restore_after_a_divergence_pick_the_last_good(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    with CheckpointManager(tmp_path, keep=1) as manager:
        manager.claim(resume=False)
        first = manager.save(t, 1, UNCONFIRMED)
        good = copy(t.params)
        t.step(1)
        manager.judge(first, None, by(1, 5.4))  # step 1 ran on step-1's weights: healthy
        second = manager.save(t, 2, UNCONFIRMED)
        t.step(2)
        manager.judge(second, "the loss 60 is a spike", by(2, 60.0))
        third = manager.save(t, 3, UNCONFIRMED)
        manager.judge(third, "the loss is nan", by(3, float("nan")))
        assert manager.last_good() == first
    # keep 1, and yet the healthy one stays: the run diverged after it
    assert names(tmp_path) == ["step-00000001", "step-00000003"]
    path, skipped = CheckpointManager(tmp_path).resumable()
    assert path == first and skipped == [(third, "step 3: the loss is nan")]
    fresh = Trainer(ref_cfg(data))
    assert CheckpointManager(tmp_path).restore(fresh) == 1
    assert all(torch.equal(a, b) for a, b in zip(good, fresh.params))


def test_keep_is_at_least_one(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)
