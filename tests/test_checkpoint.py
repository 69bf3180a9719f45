"""Checkpoints: keyed by parameter name, complete or absent, safe to read, resumable on
another layout (one spawned gloo group runs the multi-rank cases), never holding NaN."""

import dataclasses
import functools
import json
import os
import pickle
import shutil

import pytest
import torch

from chimera.models import build_model, get_config
from chimera.train import ConfigError, TrainConfig
from chimera.train import checkpoint as ckpt
from chimera.train.checkpoint import disk
from chimera.train.launch import launch
from chimera.train.checkpoint.lease import Lease, claim
from chimera.train.loop import NonFiniteLoss, Trainer, run_context
from ranks import run_ranks


def ref_cfg(data, **kw):
    base = dict(schedule="none", stages=1, micro_batch_size=8, dtype="float64", steps=4,
                data=data, progress=False)
    return TrainConfig(**{**base, **kw})


def adam_state(trainer):
    return [{k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.params]


# -- one process ------------------------------------------------------------------------
def test_round_trip_continues_bit_identically(data, tmp_path):
    cfg = ref_cfg(data)
    a = Trainer(cfg)
    for step in range(2):
        a.step(step)
    path = ckpt.save(a, tmp_path, 2, keep=3)
    assert path.name == "step-00000002" and (path / "meta.json").is_file()
    meta = ckpt.verify(path, "gpt2-tiny", ckpt.model_fingerprint(get_config("gpt2-tiny")))
    assert meta["step"] == 2 and meta["data"]["next_step"] == 2

    b = Trainer(cfg)
    assert ckpt.restore(b, tmp_path) == 2
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)
    for sa, sb in zip(adam_state(a), adam_state(b)):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert a.step(2).loss == b.step(2).loss
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.params, b.params))

    # keyed by the model's own names: a single-device model loads it as is
    model = build_model(get_config("gpt2-tiny"), 0).double()
    model.load_state_dict(ckpt.load_model_state(path))


def test_publish_is_atomic_and_keeps_the_last_few(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    (tmp_path / ".tmp-step-00000001").mkdir()  # a save that died half-way
    for step in (1, 2, 3, 4):
        ckpt.save(t, tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step-00000003", "step-00000004"]
    (tmp_path / ".tmp-step-00000009").mkdir()  # never read: only published folders count
    assert ckpt.latest(tmp_path).name == "step-00000004"
    ckpt.save(t, tmp_path, 4, keep=2)  # the same step again replaces it whole
    assert ckpt.read_meta(tmp_path / "step-00000004")["step"] == 4


def test_nan_is_never_written(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    with torch.no_grad():
        t.params[3].view(-1)[0] = float("nan")
    with pytest.raises(ckpt.NonFiniteCheckpoint, match="step 1"):
        ckpt.save(t, tmp_path, 1, keep=2)
    assert ckpt.latest(tmp_path) is None


def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(data):
    poison = functools.partial(_poison)
    t = Trainer(ref_cfg(data))
    t.step(0)
    with pytest.raises(NonFiniteLoss, match="step 1"):
        t.step(1, on_grads=poison)
    t = Trainer(ref_cfg(data, skip_nonfinite=True))
    t.step(0)
    before = [p.clone() for p in t.params]
    log = t.step(1, on_grads=poison)
    assert log.skipped and all(torch.equal(a, b) for a, b in zip(before, t.params))
    assert not t.step(2).skipped


def _poison(trainer):
    trainer.params[0].grad.fill_(float("nan"))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/chimera-pwned",))


def test_index_is_not_unpickled_freely(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    path = ckpt.save(t, tmp_path, 1, keep=2)
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(ckpt.CheckpointError, match="posix.system|os.system"):
        ckpt.read_index(path)
    assert not os.path.exists("/tmp/chimera-pwned")


def test_corrupt_or_foreign_checkpoints_are_refused_before_start(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    path = ckpt.save(t, tmp_path, 1, keep=2)
    cfg = dict(schedule="none", stages=1, micro_batch_size=8, data=data, checkpoint_dir=str(tmp_path),
               resume=True)  # the batch it was written with: another is refused (issue 26)
    TrainConfig(**cfg).preflight()  # fine as written
    with pytest.raises(ConfigError, match="bert-tiny|written for model"):
        TrainConfig(**{**cfg, "model": "bert-tiny"}).preflight()
    blob = next(p for p in path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    blob.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="corrupt"):
        TrainConfig(**cfg).preflight()
    (path / "meta.json").write_text("{not json")
    with pytest.raises(ConfigError, match="meta.json"):
        TrainConfig(**cfg).preflight()


# -- one run per directory (issue 13, case 2) -----------------------------------------------
def test_a_directory_with_checkpoints_needs_resume(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    ckpt.save(t, tmp_path, 3, keep=3)
    cfg = dict(schedule="none", stages=1, micro_batch_size=8, data=data, checkpoint_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="holds another run's checkpoints.*--resume"):
        TrainConfig(**cfg).preflight()
    TrainConfig(**cfg, resume=True).preflight()  # continues that run
    with pytest.raises(ckpt.CheckpointError, match="--resume"):  # checked again under the lease
        claim(tmp_path, resume=False)


def test_pruning_keeps_another_runs_checkpoints(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    ckpt.save(t, tmp_path, 1, keep=1, lease=Lease(tmp_path, "theirs"))
    for step in (2, 3):
        ckpt.save(t, tmp_path, step, keep=1, lease=Lease(tmp_path, "mine"))
    assert [p.name for _, p in ckpt.published(tmp_path)] == ["step-00000001", "step-00000003"]
    assert ckpt.owner(tmp_path / "step-00000001") == "theirs"
    assert ckpt.owner(tmp_path / "step-00000003") == "mine"


def test_a_second_run_at_once_is_refused(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    first = claim(tmp_path, resume=False)
    try:
        ckpt.save(t, tmp_path, 1, keep=2, lease=first)
        with pytest.raises(ckpt.CheckpointError, match=f"in use by run {first.run_id}, pid"):
            claim(tmp_path, resume=True)
        with pytest.raises(ckpt.CheckpointError, match="in use by"):  # a lease-less save too
            ckpt.save(t, tmp_path, 2, keep=2)
        cfg = ref_cfg(data, steps=2, checkpoint_dir=str(tmp_path), resume=True)
        with pytest.raises(ckpt.CheckpointError, match="in use by"):
            launch(cfg)
    finally:
        first.release()
    assert ckpt.latest(tmp_path).name == "step-00000001"
    ckpt.verify(ckpt.latest(tmp_path))
    assert launch(cfg)["steps"][0]["step"] == 1  # released: resuming continues its run
    assert ckpt.owner(ckpt.latest(tmp_path)) == first.run_id


def test_a_tampered_meta_is_refused_in_one_line(data, tmp_path):
    t = Trainer(ref_cfg(data))
    t.step(0)
    path = ckpt.save(t, tmp_path, 1, keep=2)
    meta = json.loads((path / "meta.json").read_text())
    for field, value in (("step", "x"), ("files", {"a": {"bytes": None}}), ("layout", None)):
        (path / "meta.json").write_text(json.dumps({**meta, field: value}))
        with pytest.raises(ConfigError, match="malformed") as exc:
            TrainConfig(schedule="none", stages=1, data=data, checkpoint_dir=str(tmp_path),
                        resume=True).preflight()
        assert "\n" not in str(exc.value)


def test_a_full_disk_while_writing_meta_is_one_error(data, tmp_path, monkeypatch):
    t = Trainer(ref_cfg(data))
    t.step(0)

    def full(path, text):
        raise OSError(28, "No space left on device", str(path))
    monkeypatch.setattr(disk, "write_synced", full)
    with pytest.raises(ckpt.CheckpointIOError, match="No space left on device"):
        ckpt.save(t, tmp_path, 1, keep=2)
    assert ckpt.latest(tmp_path) is None


# -- several processes: another layout, determinism, agreement on NaN ------------------------
BASE = dict(stages=2, micro_batches=4, micro_batch_size=2, dtype="float64", steps=4,
            progress=False, checkpoint_every=2)


def _run(cfg):
    """What ``chimera train`` does on one rank, inside an existing process group."""
    from chimera.runtime.transport import TorchDist
    from chimera.train.launch import _train

    trainer = Trainer(cfg, run_context(cfg, transport=TorchDist()))  # the spawned gloo group
    logs = []
    _train(trainer, cfg, None, lambda t, step, log: logs.append(log))
    params = {n: p.detach().clone() for n, _, p in trainer.replica_parameters()}
    return [(l.step, l.loss, l.skipped) for l in logs], params


def _worker(rank, world, root, data):
    out = {}
    a = TrainConfig(schedule="chimera", data=data, checkpoint_dir=f"{root}/a", **BASE)
    out["a"] = _run(a)
    out["again"] = _run(dataclasses.replace(a, checkpoint_dir=f"{root}/again"))
    for name, kw in {"1f1b": dict(schedule="1f1b"),
                     "w2": dict(schedule="1f1b", stages=1, data_parallel=2, micro_batches=2)}.items():
        if rank == 0:
            shutil.copytree(f"{root}/a/step-00000002", f"{root}/{name}/step-00000002")
        torch.distributed.barrier()
        out[name] = _run(dataclasses.replace(a, checkpoint_dir=f"{root}/{name}", resume=True, **kw))
    os.environ["CHIMERA_FAULT"] = "nan:1:1"  # rank 1's gradients only: every rank must agree
    out["skip"] = _run(dataclasses.replace(a, checkpoint_dir=f"{root}/skip", checkpoint_every=1,
                                           skip_nonfinite=True))
    try:
        _run(dataclasses.replace(a, checkpoint_dir=f"{root}/stop", checkpoint_every=1))
        out["stop"] = "no error"
    except NonFiniteLoss as exc:
        out["stop"] = str(exc)
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("layouts")
    return root, run_ranks(functools.partial(_worker, root=str(root), data=data), 2, processes=True,
                           timeout_s=240)


def _params(path):
    return ckpt.load_model_state(path)


@pytest.mark.slow
def test_resume_on_another_schedule_and_width(layouts):
    root, outs = layouts
    losses = [loss for _, loss, _ in outs[0]["a"][0]]
    assert [s for s, _, _ in outs[0]["a"][0]] == [0, 1, 2, 3]
    final = _params(root / "a" / "step-00000004")
    names = set(build_model(get_config("gpt2-tiny"), 0).state_dict())
    assert set(final) == names  # every parameter once, whatever the layout
    for name in ("1f1b", "w2"):
        resumed = outs[0][name][0]
        assert [s for s, _, _ in resumed] == [2, 3]
        for (_, got, _), want in zip(resumed, losses[2:]):
            assert got == pytest.approx(want, rel=1e-12, abs=0)
        other = _params(root / name / "step-00000004")
        for key, value in final.items():
            torch.testing.assert_close(other[key], value, rtol=1e-10, atol=1e-12)
    # the final checkpoint is judged by a forward-only probe: the same loss on every layout
    probes = [ckpt.health_of(ckpt.read_meta(root / name / "step-00000004"))
              for name in ("a", "1f1b", "w2")]
    assert all(h["status"] == "healthy" and h["judged_by"]["by"] == "a forward-only probe"
               for h in probes)
    for h in probes[1:]:
        assert h["judged_by"]["loss"] == pytest.approx(probes[0]["judged_by"]["loss"], rel=1e-12)


@pytest.mark.slow
def test_same_seed_and_layout_are_bit_identical(layouts):
    root, outs = layouts
    for out in outs:
        assert out["again"][0] == out["a"][0]
        assert all(torch.equal(out["again"][1][k], v) for k, v in out["a"][1].items())
    a, again = _params(root / "a" / "step-00000004"), _params(root / "again" / "step-00000004")
    assert all(torch.equal(a[k], again[k]) for k in a)


@pytest.mark.slow
def test_every_rank_agrees_on_a_nonfinite_step(layouts):
    root, outs = layouts
    for out in outs:
        assert [skipped for _, _, skipped in out["skip"][0]] == [False, True, False, False]
        assert "step 1" in out["stop"] and "not finite" in out["stop"]
    assert ckpt.latest(root / "skip").name == "step-00000004"
    assert ckpt.latest(root / "stop").name == "step-00000001"  # before the NaN, finite
    # step 1 ran on step-1's weights and was not finite: that checkpoint is in doubt, and no
    # checkpoint follows step 1 (every rank agreed: the verdicts come from all-reduced values)
    status = {p.name: ckpt.health_of(ckpt.read_meta(p))["status"] for _, p in ckpt.published(root / "skip")}
    assert status == {"step-00000001": "in doubt", "step-00000003": "healthy",
                      "step-00000004": "healthy"}
    assert ckpt.health_of(ckpt.read_meta(root / "stop" / "step-00000001"))["status"] == "in doubt"
    assert ckpt.resumable(root / "stop")[0] is None
    for _, path in ckpt.published(root / "skip"):
        assert all(torch.isfinite(v).all() for v in _params(path).values())
    log = json.loads(json.dumps(outs[0]["skip"][0]))
    assert log[1][2] is True
