"""A checkpoint in doubt or never judged is never served silently (issue 38): `chimera generate`
and `chimera export` refuse it in one line naming the newest healthy checkpoint, unless
--allow-in-doubt (then a warning, every time); a run's folder serves its newest healthy one
and names those passed over; `chimera judge` gives a checkpoint never judged the verdict its
run would have given it, and records it."""

import math
import shutil

import pytest
import torch

from chimera.cli import main
from chimera.train import TrainConfig
from chimera.train import checkpoint as ckpt
from chimera.train.checkpoint.lease import claim
from chimera.train.checkpoint.serve import choose
from chimera.train.judge import judge
from chimera.train.launch import launch
from chimera.train.loop import Trainer


def ref_cfg(data, **kw):
    base = dict(schedule="none", stages=1, micro_batch_size=8, dtype="float64", steps=2,
                data=data, progress=False)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def made(data, tmp_path_factory):
    """One run's folder as a killed, diverging run leaves it: step-2 healthy, step-3 with its
    weights blown up (x1e29, finite) and never judged. A copy per test."""
    root = tmp_path_factory.mktemp("serve")
    t = Trainer(ref_cfg(data, checkpoint_dir=str(root / "ck")))
    losses = [t.step(s).loss for s in range(2)]
    ckpt.save(t, root / "ck", 2, keep=5, health={"status": "healthy", "recent_losses": losses})
    with torch.no_grad():
        for p in t.params:
            p.mul_(1e29)
    ckpt.save(t, root / "ck", 3, keep=5, health={"status": "unconfirmed", "recent_losses": losses})
    return root / "ck"


@pytest.fixture
def run(made, tmp_path):
    shutil.copytree(made, tmp_path / "ck")
    return tmp_path / "ck"


def in_doubt(path, why="step 3: the loss is nan"):
    ckpt.set_health(path, {**ckpt.health_of(ckpt.read_meta(path)), "status": "in doubt",
                           "reason": why})


def cli(capsys, *argv) -> tuple[int, list[str]]:
    """`chimera ARGV` in this process: (exit code, the lines of stderr); stdout in ``cli.out``."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    cli.out = captured.out
    return code, captured.err.strip().splitlines()


def generate(capsys, checkpoint, *extra):
    return cli(capsys, "generate", "--checkpoint", checkpoint, "--prompt", "the",
               "--max-new-tokens", "2", "--temperature", "0", *extra)


def test_a_step_folder_in_doubt_is_refused_in_one_line_naming_the_healthy_one(run, tmp_path, capsys):
    in_doubt(run / "step-00000003")
    for code, err in (generate(capsys, run / "step-00000003"),
                      cli(capsys, "export", "--checkpoint", run / "step-00000003", "--out", tmp_path / "o")):
        assert code == 2 and len(err) == 1, err
        assert "is in doubt (step 3: the loss is nan)" in err[0]
        assert f"newest healthy checkpoint {run / 'step-00000002'}" in err[0]
        assert "--allow-in-doubt" in err[0]
    assert not (tmp_path / "o").exists()


def test_a_step_folder_never_judged_is_refused_and_names_chimera_judge(run, capsys):
    code, err = generate(capsys, run / "step-00000003")
    assert code == 2 and len(err) == 1, err
    assert "not judged yet" in err[0] and f"chimera judge --checkpoint {run / 'step-00000003'}" in err[0]
    assert f"newest healthy checkpoint {run / 'step-00000002'}" in err[0]


def test_allow_in_doubt_serves_it_with_a_warning_every_time(run, tmp_path, capsys):
    in_doubt(run / "step-00000003")
    for _ in range(2):
        code, err = generate(capsys, run / "step-00000003", "--allow-in-doubt")
        assert code == 0
        assert sum("warning: serving checkpoint" in line and "in doubt" in line for line in err) == 1
    code, err = cli(capsys, "export", "--checkpoint", run / "step-00000003", "--out", tmp_path / "o",
                    "--allow-in-doubt")
    assert code == 0 and any("chimera export: warning: serving checkpoint" in l for l in err), err
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_a_run_folder_serves_its_newest_healthy_one_and_names_the_newer(run, capsys):
    path, notes = choose(run)
    assert path == run / "step-00000002"
    assert len(notes) == 1 and "passing over step-00000003, not judged yet" in notes[0]
    code, err = generate(capsys, run)
    assert code == 0 and any("passing over step-00000003" in line for line in err), err
    # --allow-in-doubt: the run's newest, whatever its verdict
    path, notes = choose(run, allow_in_doubt=True)
    assert path == run / "step-00000003" and notes[0].startswith("warning: serving checkpoint")
    # no healthy one left: refused, naming the newest
    in_doubt(run / "step-00000002", "step 2: the loss is inf")
    with pytest.raises(ckpt.CheckpointError, match="no healthy checkpoint in it; newest step-00000003"):
        choose(run)


def test_judging_serves_a_good_checkpoint_and_doubts_a_blown_up_one(run, made, capsys):
    healthy = run / "step-00000002"
    ckpt.set_health(healthy, {**ckpt.health_of(ckpt.read_meta(healthy)), "status": "unconfirmed"})
    with pytest.raises(ckpt.CheckpointError, match="not judged yet"):
        choose(healthy)
    code, _ = cli(capsys, "judge", "--checkpoint", run)  # both never judged: both judged
    assert code == 1, cli.out  # one is in doubt
    assert "step-00000002: healthy" in cli.out and "step-00000003: in doubt" in cli.out
    good, blown = (ckpt.health_of(ckpt.read_meta(run / n)) for n in ("step-00000002", "step-00000003"))
    assert good["status"] == "healthy" and good["judged_by"]["by"].startswith("chimera judge")
    assert blown["status"] == "in doubt" and "chimera judge" in blown["reason"]
    assert not math.isfinite(blown["judged_by"]["loss"]) or "spike" in blown["reason"]
    assert choose(healthy) == (healthy, [])
    with pytest.raises(ckpt.CheckpointError, match="is in doubt"):
        choose(run / "step-00000003")
    code, _ = cli(capsys, "judge", "--checkpoint", run)
    assert code == 0 and "nothing to judge" in cli.out


def test_the_verdict_is_the_runs_own(data, tmp_path):
    """The last checkpoint of a run is judged by a forward-only probe: judging it again (as
    if the run had been killed before its probe) gives the same loss and the same verdict."""
    launch(ref_cfg(data, checkpoint_dir=str(tmp_path / "ck")))
    last = tmp_path / "ck" / "step-00000002"
    by_run = ckpt.health_of(ckpt.read_meta(last))
    assert by_run["status"] == "healthy"
    ckpt.set_health(last, {k: v for k, v in by_run.items() if k != "judged_by"} | {"status": "unconfirmed"})
    [verdict] = judge(tmp_path / "ck")
    assert verdict.why is None and verdict.step == 2
    assert verdict.loss == pytest.approx(by_run["judged_by"]["loss"], rel=1e-12)
    assert ckpt.health_of(ckpt.read_meta(last))["status"] == "healthy"


def test_judge_refuses_a_live_runs_folder_and_missing_data(run, tmp_path):
    lease = claim(run, resume=True)
    try:
        with pytest.raises(ckpt.CheckpointError, match="is in use by run"):
            judge(run / "step-00000003")
    finally:
        lease.release()
    with pytest.raises(ValueError, match=r"the run's data .* is not there .*pass --data"):
        judge(run / "step-00000003", data=str(tmp_path / "gone.txt"))
    with pytest.raises(ckpt.CheckpointError, match="no such directory"):
        judge(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in it"):
        judge(tmp_path / "empty")


@pytest.mark.slow
def test_a_run_killed_right_after_publishing(run_cli, data, tmp_path):
    """The issue's case end to end: `--fault kill:0:3` kills the run as step 3 starts, right
    after step-3 was published (unconfirmed). The run's folder serves step-2 with a note, the
    step folder is refused naming `chimera judge`, which judges it; then it is served."""
    ck = tmp_path / "ck"
    r = run_cli("train", "--schedule", "none", "--stages", "1", "--data", data, "-B", "8",
                "--steps", "6", "--checkpoint-dir", ck, "--checkpoint-every", "1",
                "--fault", "kill:0:3", "--no-progress", "--png", "", "--trace", "")
    assert r.returncode != 0
    newest = ck / "step-00000003"
    assert ckpt.health_of(ckpt.read_meta(newest))["status"] == "unconfirmed"
    gen = ("generate", "--prompt", "the", "--max-new-tokens", "2", "--temperature", "0", "--checkpoint")
    r = run_cli(*gen, ck)
    assert r.returncode == 0 and "serving step-00000002" in r.stderr and "step-00000003, not judged" in r.stderr
    r = run_cli(*gen, newest)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    assert f"chimera judge --checkpoint {newest}" in r.stderr and str(ck / "step-00000002") in r.stderr
    r = run_cli("judge", "--checkpoint", ck)
    assert r.returncode == 0 and f"{newest}: healthy" in r.stdout, r.stdout + r.stderr
    r = run_cli(*gen, newest)
    assert r.returncode == 0 and r.stderr.count("\n") == 1, r.stderr  # the timing line alone
