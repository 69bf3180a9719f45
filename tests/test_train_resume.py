"""Resuming with a changed config (issues 25 and 26): each differing field named on its own
line, what a resume refuses and what it accepts (announced, never applied silently), and the
optimizer settings recorded in the checkpoint."""

import json

import pytest

from chimera.cli import main
from chimera.train import ConfigError, TrainConfig, build
from chimera.train import checkpoint as ckpt
from chimera.train.launch import launch
from chimera.train.loop import Trainer
from chimera.train.optim import lr_at

BASE = dict(schedule="none", stages=1, micro_batch_size=4, steps=2, progress=False, lr=2e-3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data):
    """A checkpoint directory holding step 2 of BASE's run."""
    root = tmp_path_factory.mktemp("resume") / "ckpt"
    launch(TrainConfig(data=data, checkpoint_dir=str(root), **BASE))
    return root


def _resume(saved, data, **kw):
    return TrainConfig(**{**BASE, "data": data, "checkpoint_dir": str(saved), "resume": True,
                          **kw}).preflight()


def test_the_checkpoint_records_the_optimizer_settings(saved):
    run = json.loads((ckpt.latest(saved) / "meta.json").read_text())["run"]
    assert run["lr"] == 2e-3 and run["lr_schedule"] == "cosine" and run["weight_decay"] == 0.1
    assert (run["adam_beta1"], run["adam_beta2"], run["adam_eps"]) == (0.9, 0.95, 1e-8)
    assert run["step_batch"] == 4 and run["steps"] == 2 and run["clip"] == 1.0


def test_refused_changes_are_named_one_line_each(saved, data):
    with pytest.raises(ConfigError) as err:
        _resume(saved, data, seq_len=16, micro_batch_size=2, seed=3)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("--resume: ") and "what differs" in lines[0]
    named = lines[1:-1]
    assert len(named) == 3, lines
    assert any("model seq_len: 32 in the checkpoint, 16 now (--seq-len)" in l for l in named)
    assert any("batch" in l and "4 in the checkpoint, 2 now" in l for l in named)
    assert any("seed: 0 in the checkpoint, 3 now (--seed)" in l for l in named)
    assert "accepts" in lines[-1] and "refuses" in lines[-1]
    assert max(map(len, lines)) < 300  # not a dump of the model's config


def test_another_model_is_one_line_not_its_every_field(saved, data):
    with pytest.raises(ConfigError) as err:
        _resume(saved, data, model="bert-tiny")
    lines = str(err.value).splitlines()  # one difference: one line, as any bad input
    assert len(lines) == 1 and "model: 'gpt2-tiny' in the checkpoint, 'bert-tiny' now (--model)" \
        in lines[0] and "refuses" in lines[0]


def test_new_data_is_refused_unless_allowed(saved, data, tmp_path):
    other = tmp_path / "other.txt"
    other.write_bytes(open(data, "rb").read()[::-1])
    with pytest.raises(ConfigError, match="--resume-allow data"):
        _resume(saved, data=str(other))
    cfg = _resume(saved, data=str(other), resume_allow=("data",))
    assert build.resume_changes(cfg) == []
    assert _resume(saved, data=str(other), resume_allow="data").ckpt.resume_allow == ("data",)


def test_the_same_batch_on_another_layout_is_accepted_and_announced(saved, data):
    cfg = _resume(saved, data, micro_batches=2, micro_batch_size=2)  # 4 sequences either way
    assert build.resume_changes(cfg) == [
        "  micro_batches: 1 in the checkpoint, 2 now (-N)",
        "  micro_batch_size: 4 in the checkpoint, 2 now (-B)"]


def test_accepted_changes_are_announced_and_applied(saved, data, tmp_path, capsys):
    import shutil

    where = tmp_path / "ckpt"
    shutil.copytree(saved, where)
    cfg = TrainConfig(**{**BASE, "data": data, "checkpoint_dir": str(where), "resume": True,
                         "steps": 3, "lr": 1e-3, "adam_beta2": 0.99})
    result = launch(cfg)
    err = capsys.readouterr().err
    assert "resuming from" in err and "with these changes" in err
    assert "  steps: 2 in the checkpoint, 3 now (--steps)" in err
    assert "  lr: 0.002 in the checkpoint, 0.001 now (--lr)" in err
    assert "  adam_beta2: 0.95 in the checkpoint, 0.99 now (--adam-beta2)" in err
    assert [s["step"] for s in result["steps"]] == [2]
    assert result["steps"][0]["lr"] == lr_at(cfg, 2) == pytest.approx(1e-3 * 0.55)  # the new lr's


def test_an_unchanged_resume_says_nothing(saved, data):
    assert build.resume_changes(_resume(saved, data)) == []


def test_the_cli_prints_every_named_line_and_exits_2(saved, data, monkeypatch, capsys):
    import chimera.train.launch

    monkeypatch.setattr(chimera.train.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--schedule", "none", "--stages", "1", "-B", "4", "--data", data,
              "--checkpoint-dir", str(saved), "--resume", "--seq-len", "16", "--seed", "1"])
    err = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert err[0].startswith("chimera train: --resume:")
    assert sum("(--seq-len)" in l for l in err) == 1 and sum("(--seed)" in l for l in err) == 1


def test_a_checkpoint_from_before_the_record_is_still_compared(data, tmp_path):
    """Older checkpoints have no ``run``: the model, seed, batch and layout still compare."""
    t = Trainer(TrainConfig(data=data, **BASE))
    t.step(0)
    path = ckpt.save(t, tmp_path, 1, keep=1)
    meta = json.loads((path / "meta.json").read_text())
    del meta["run"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"seed: 0 in the checkpoint, 5 now"):
        _resume(tmp_path, data, seed=5)
    assert build.resume_changes(_resume(tmp_path, data, stages=1, dtype="fp16")) == [
        "  dtype: 'float32' in the checkpoint, 'fp16' now (--dtype)"]


def test_doc_mask_is_recorded_and_a_change_announced():
    """--doc-mask changes what attends to what, not the weights: accepted and announced (a
    checkpoint from before it was recorded says nothing)."""
    from chimera.train import resume

    cfg = TrainConfig(**BASE, doc_mask=True)
    meta = {"model": cfg.net.model, "run": {**resume.record(cfg), "doc_mask": False}}
    refused, accepted = resume.compare(meta, cfg, {})
    assert refused == [] and accepted == ["  doc_mask: False in the checkpoint, True now (--doc-mask)"]
    del meta["run"]["doc_mask"]
    assert resume.compare(meta, cfg, {}) == ([], [])
