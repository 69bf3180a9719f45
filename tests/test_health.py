"""Never lose the last good checkpoint (issue 26, case 1): a step is in doubt when its loss or
gradient norm is not finite or its loss spikes; no checkpoint follows such a step, the
checkpoint of the weights it ran on is marked in doubt, pruning keeps the newest healthy one,
--resume passes over those in doubt, and a run that stays or ends in doubt exits 1."""

import json
import math
import subprocess
import sys

import pytest
import torch

from chimera.train import ConfigError, TrainConfig
from chimera.train import checkpoint as ckpt
from chimera.train.checkpoint import CheckpointManager
from chimera.train.checkpoint.keeper import Keeper, RunInDoubt
from chimera.train.health import MIN_RISE, WINDOW, LossHistory
from chimera.train.launch import launch
from chimera.train.loop import StepLog, Trainer


# -- the rule ---------------------------------------------------------------------------
def test_nonfinite_values_are_in_doubt_before_any_history():
    h = LossHistory()
    assert "loss is nan" in h.doubt(math.nan, 1.0)
    assert "loss is inf" in h.doubt(math.inf, 1.0)
    assert "gradient norm is nan" in h.doubt(5.0, math.nan)
    assert h.doubt(5.0, 1.0) is None  # no history: only non-finite values count


def test_a_spike_is_far_above_the_recent_median():
    h = LossHistory([5.0, 4.0, 3.0])  # median 4
    assert h.doubt(8.0) is None  # doubled exactly: not above
    assert "spike" in h.doubt(8.01) and "median 4" in h.doubt(8.01)
    assert h.doubt(100.0).startswith("the loss 100 is a spike")
    low = LossHistory([0.02, 0.03])  # near zero: doubling is noise, the rise must pass a nat too
    assert low.doubt(0.2) is None and low.doubt(0.03 + MIN_RISE + 0.1) is not None
    assert LossHistory([4.0], factor=0).doubt(1e9) is None  # --spike-factor 0: off


def test_only_healthy_losses_make_the_history():
    h = LossHistory([4.0])
    assert h.judge(100.0) is not None and h.losses == [4.0]  # a spike does not become normal
    assert h.judge(3.0) is None and h.losses == [4.0, 3.0]
    for _ in range(2 * WINDOW):
        h.judge(3.5)
    assert len(h.losses) == WINDOW


# -- the keeper: publishing, judging, pruning, resuming -------------------------------------
def ref_cfg(data, **kw):
    base = dict(schedule="none", stages=1, micro_batch_size=8, dtype="float64", steps=4,
                data=data, progress=False)
    return TrainConfig(**{**base, **kw})


def fake(step, loss, norm=1.0):
    return StepLog(step, loss, 1e-3, norm, 0.01, 256)


def test_a_spike_marks_the_checkpoint_it_ran_on_and_keeps_the_healthy_one(data, tmp_path, capsys):
    cfg = ref_cfg(data, checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_checkpoints=1)
    trainer, manager = Trainer(cfg), CheckpointManager(tmp_path, cfg.ckpt.keep_checkpoints)
    manager.claim(resume=False)
    keeper = Keeper(cfg, trainer, manager, rank=0, start=0)
    try:
        for step, loss in enumerate([5.5, 5.4, 60.0]):  # step 2 spikes
            keeper.after_step(step, fake(step, loss))
            keeper.publish(step + 1, fake(step, loss))
        with pytest.raises(RunInDoubt, match=r"ended in doubt \(step 2: the loss 60 is a spike"):
            keeper.finish(3)
    finally:
        manager.release()
    names = [p.name for _, p in ckpt.published(tmp_path)]
    assert names == ["step-00000001", "step-00000002"]  # keep 1, and the newest healthy one
    health = {n: ckpt.health_of(ckpt.read_meta(tmp_path / n)) for n in names}
    assert health["step-00000001"]["status"] == "healthy"
    assert health["step-00000001"]["judged_by"]["loss"] == 5.4
    assert health["step-00000002"]["status"] == "in doubt"
    assert "step 2: the loss 60 is a spike" in health["step-00000002"]["reason"]
    err = capsys.readouterr().err
    assert "checkpoint step-00000003 not published" in err and "step-00000001" in err
    assert ckpt.resumable(tmp_path) == (tmp_path / "step-00000001",
                                        [(tmp_path / "step-00000002", health["step-00000002"]["reason"])])


def test_resume_refuses_a_directory_of_checkpoints_all_in_doubt(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    path = ckpt.save(t, tmp_path, 1, keep=2, health={"status": "in doubt", "reason": "step 1: x"})
    assert ckpt.resumable(tmp_path) == (None, [(path, "step 1: x")])
    with pytest.raises(ConfigError, match="every checkpoint in .* is in doubt"):
        ref_cfg(data, checkpoint_dir=str(tmp_path), resume=True).preflight()


def test_the_final_checkpoint_is_judged_by_a_probe_of_the_next_batch(data, tmp_path):
    """No step follows the last one: a forward-only loss of mini-batch ``steps`` judges it,
    the loss the next step of a longer run computes (dropout is 0: the same number)."""
    flat = dict(min_lr_ratio=1.0, warmup=1)  # the same learning rates, whatever --steps
    launch(ref_cfg(data, checkpoint_dir=str(tmp_path / "a"), **flat))
    health = ckpt.health_of(ckpt.read_meta(tmp_path / "a" / "step-00000004"))
    assert health["status"] == "healthy" and health["judged_by"]["by"] == "a forward-only probe"
    longer = launch(ref_cfg(data, steps=5, **flat))
    assert health["judged_by"]["loss"] == pytest.approx(longer["steps"][4]["loss"], rel=1e-12)
    assert health["made_by"]["step"] == 3 and len(health["recent_losses"]) == 4


# -- the run: resumed from a good checkpoint with --lr 1e30 ------------------------
def train(run_cli, data, tmp_path, *args):
    return run_cli("train", "--schedule", "none", "--stages", "1", "--dtype", "float64",
                   "--data", data, "-B", "8", "--no-progress", "--checkpoint-dir", tmp_path / "ck",
                   "--checkpoint-every", "1", "--png", tmp_path / "t.png", "--trace",
                   tmp_path / "t.json", *args)


def weights(path):
    return max(float(v.abs().max()) for v in ckpt.load_model_state(path).values())


@pytest.mark.slow
def test_a_diverging_run_never_deletes_the_good_checkpoint(run_cli, data, tmp_path):
    r = train(run_cli, data, tmp_path, "--steps", "4")
    assert r.returncode == 0, r.stderr
    good = tmp_path / "ck" / "step-00000004"
    sane = weights(good)

    # the update of step 4 blows the weights up; step 5's loss shows it
    r = train(run_cli, data, tmp_path, "--steps", "8", "--resume", "--lr", "1e30",
              "--keep-checkpoints", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"newest healthy checkpoint {good}" in r.stderr.splitlines()[-1]
    assert ckpt.health_of(ckpt.read_meta(good))["status"] == "healthy"  # kept despite keep 1
    assert weights(good) == sane
    for _, path in ckpt.published(tmp_path / "ck"):
        if path != good:
            assert ckpt.health_of(ckpt.read_meta(path))["status"] == "in doubt"
            doubted = path
    # the blown-up weights are not served (issue 38): one line naming the good checkpoint
    r = run_cli("generate", "--checkpoint", doubted, "--prompt", "x", "--max-new-tokens", "2")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is in doubt" in r.stderr and f"newest healthy checkpoint {good}" in r.stderr

    # skipping the non-finite steps stops after --skip-limit of them, never exits 0
    r = train(run_cli, data, tmp_path, "--steps", "30", "--resume", "--lr", "1e30",
              "--skip-nonfinite", "--skip-limit", "3", "--log-json", tmp_path / "log.jsonl")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "3 steps in a row skipped" in r.stderr or "ended in doubt" in r.stderr, r.stderr
    steps = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(steps) < 26  # it stopped: the run does not skip to the end

    # --resume passes over what is in doubt, says so, and continues from the good one
    r = train(run_cli, data, tmp_path, "--steps", "5", "--resume", "--log-json", tmp_path / "ok.jsonl")
    assert r.returncode == 0, r.stderr
    assert "--resume: passing over step-00000005" in r.stderr
    assert "resuming from step-00000004" in r.stderr
    resumed = [json.loads(l) for l in (tmp_path / "ok.jsonl").read_text().splitlines()]
    assert [s["step"] for s in resumed] == [4] and math.isfinite(resumed[0]["loss"])
    assert weights(tmp_path / "ck" / "step-00000005") < 100 * sane + 1


def test_full_disk_during_a_checkpoint_says_so(data, tmp_path, monkeypatch):
    """DCP wraps the rank's error in a CheckpointException whose first line is "ranks: ...":
    the message is the OSError's own."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", "x.distcp")
    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    t = Trainer(ref_cfg(data))
    t.step(0)
    with pytest.raises(ckpt.CheckpointIOError, match="No space left on device"):
        ckpt.save(t, tmp_path, 1, keep=2)
    assert ckpt.latest(tmp_path) is None


def test_limits_of_the_health_flags():
    for kw, word in ((dict(skip_limit=0), "--skip-limit"), (dict(spike_factor=1.0), "--spike-factor"),
                     (dict(spike_factor=math.nan), "--spike-factor"), (dict(warmup=-5), "--warmup")):
        with pytest.raises(ConfigError, match=word):
            TrainConfig(**kw)
    assert TrainConfig(spike_factor=0, warmup=0).run.spike_factor == 0


def test_a_resume_on_other_data_starts_the_history_afresh(data, tmp_path):
    """A fine-tune on other data may start far above the old loss: not a spike."""
    other = tmp_path / "other.txt"
    other.write_bytes(bytes(range(256)) * 300)  # every byte alike: a loss far above the text's
    launch(ref_cfg(data, steps=2, checkpoint_dir=str(tmp_path / "ck")))
    meta = ckpt.read_meta(tmp_path / "ck" / "step-00000002")
    assert len(meta["health"]["recent_losses"]) == 2
    cfg = ref_cfg(str(other), steps=2, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert Keeper(cfg, None, None, 0, 2).history.losses == []
    same = ref_cfg(data, steps=3, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert Keeper(same, None, None, 0, 2).history.losses == meta["health"]["recent_losses"]


def test_generate_and_export_take_the_newest_healthy_checkpoint(data, tmp_path):
    """A run's folder serves its newest healthy checkpoint; a step folder in doubt is refused
    (the rest of the rule: tests/test_serve.py)."""
    from chimera.train.checkpoint.serve import choose

    t = Trainer(ref_cfg(data))
    t.step(0)
    good = ckpt.save(t, tmp_path, 1, keep=3)
    bad = ckpt.save(t, tmp_path, 2, keep=3, health={"status": "in doubt", "reason": "step 2: x"})
    assert choose(tmp_path)[0] == good and choose(bad, allow_in_doubt=True)[0] == bad
    with pytest.raises(ckpt.CheckpointError, match=f"in doubt .*newest healthy checkpoint {good}"):
        choose(bad)
    ckpt.set_health(good, {"status": "in doubt", "reason": "step 1: y"})
    with pytest.raises(ckpt.CheckpointError, match="no healthy checkpoint in it"):
        choose(tmp_path)


def test_weights_that_overflowed_are_not_published_and_name_the_way_back(data, tmp_path):
    """A finite loss and norm, then an update to inf: the state is refused, and the message
    says which checkpoint to resume from."""
    cfg = ref_cfg(data, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    trainer, manager = Trainer(cfg), CheckpointManager(tmp_path, cfg.ckpt.keep_checkpoints)
    manager.claim(resume=False)
    keeper = Keeper(cfg, trainer, manager, rank=0, start=0)
    try:
        keeper.after_step(0, fake(0, 5.5))
        keeper.publish(1, fake(0, 5.5))
        keeper.after_step(1, fake(1, 5.4))  # step-1 judged healthy
        with torch.no_grad():
            trainer.params[0].view(-1)[0] = float("inf")
        with pytest.raises(ckpt.NonFiniteCheckpoint, match="newest healthy checkpoint .*step-00000001"):
            keeper.publish(2, fake(1, 5.4))
    finally:
        manager.release()
    assert [p.name for _, p in ckpt.published(tmp_path)] == ["step-00000001"]
