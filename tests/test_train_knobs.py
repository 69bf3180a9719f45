"""Issue 25's training knobs: the learning-rate shapes, AdamW's settings, --grad-accum (the
same step as one K-times larger batch, pipelined on virtual ranks against one process), --compile, and
a one-line refusal (exit 2) for every bad value."""

import dataclasses
import functools
import math
import os

import pytest
import torch

from chimera.cli import main
from chimera.train import ConfigError, TrainConfig, build
from chimera.train.launch import launch
from chimera.train.loop import Trainer
from chimera.train.optim import lr_at
from ranks import run_ranks


# -- learning rate --------------------------------------------------------------------------
def _lrs(**kw):
    cfg = TrainConfig(steps=10, warmup=2, lr=1.0, min_lr_ratio=0.1, **kw)
    return [lr_at(cfg, s) for s in range(cfg.optim.steps)]


def test_every_schedule_warms_up_then_takes_its_shape():
    cos, lin, wsd, const = (_lrs(lr_schedule=k) for k in ("cosine", "linear", "wsd", "constant"))
    for lrs in (cos, lin, wsd, const):
        assert lrs[:3] == [0.5, 1.0, 1.0]  # warm-up, then the peak
    assert const == [0.5] + [1.0] * 9
    assert lin[2:] == pytest.approx([0.1 + 0.9 * (1 - i / 8) for i in range(8)])
    assert cos[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    # wsd: the peak until the last 20% (2 of 10 steps), then linear towards 0.1
    assert wsd[:8] == [0.5] + [1.0] * 7
    assert wsd[8:] == pytest.approx([1.0, 0.1 + 0.9 * 0.5])
    assert _lrs(lr_schedule="wsd", wsd_decay=0.5)[5:] == pytest.approx(
        [0.1 + 0.9 * (1 - i / 5) for i in range(5)])
    assert all(a >= b for a, b in zip(cos[2:], cos[3:])) and min(cos) >= 0.1


def test_adamw_settings_reach_the_optimizer(data):
    t = Trainer(TrainConfig(schedule="none", stages=1, data=data, progress=False, adam_beta1=0.8,
                            adam_beta2=0.99, adam_eps=1e-6, weight_decay=0.05))
    groups = t.optimizer.param_groups
    assert {g["betas"] for g in groups} == {(0.8, 0.99)} and {g["eps"] for g in groups} == {1e-6}
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.05]


def test_compile_reaches_every_module(data):
    """The flag compiles in place (not run here: inductor takes minutes on one CPU core)."""
    cfg = TrainConfig(schedule="none", stages=1, data=data, progress=False, compile=True)
    t = Trainer(cfg)
    assert t.model._compiled_call_impl is not None
    assert not any("_orig_mod" in n for n, _ in t.model.named_parameters())  # checkpoint keys
    from chimera.runtime.virtual import run_virtual  # the pipelined layout's stages as well

    for on in (True, False):  # (built and probed layer by layer: nothing compiled runs)
        pipe = dataclasses.replace(cfg, schedule="chimera", stages=2, compile=on)
        held = run_virtual(2, lambda rank: [m._compiled_call_impl is not None
                                            for m in Trainer(pipe).runtime.modules.values()])
        assert held == [[on, on], [on, on]]


# -- gradient accumulation -------------------------------------------------------------------
F64 = dict(dtype="float64", steps=3, progress=False, lr=1e-2, warmup=1)
ACCUM = {  # world 2, 8 sequences per pass; with --grad-accum 2 a step is 16 (BERT: 8, K=2)
    "chimera": dict(schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2, grad_accum=2),
    "1f1b-w2": dict(schedule="1f1b", stages=1, data_parallel=2, micro_batches=2,
                    micro_batch_size=2, grad_accum=2),
    "bert": dict(model="bert-tiny", schedule="chimera", stages=2, micro_batches=2,
                 micro_batch_size=2, grad_accum=2),
    "chimera-sharded": dict(schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2,
                            grad_accum=3, shard_optimizer=True),
}


def _run(cfg, rank):
    from chimera.train.launch import _train

    trainer = Trainer(cfg)
    logs = []
    _train(trainer, cfg, None, lambda t, step, log: logs.append(log))
    params = {n: p.detach().clone() for n, _, p in trainer.replica_parameters()}
    return [(l.step, l.loss, l.grad_norm, l.tokens) for l in logs], params


def _worker(rank, world, data):
    return {name: _run(TrainConfig(data=data, **{**F64, **kw}), rank) for name, kw in ACCUM.items()}


@pytest.fixture(scope="module")
def accumulated(data):
    """Virtual ranks: accumulation, not the transport, is the subject."""
    return run_ranks(functools.partial(_worker, data=data), 2)


def _one_process(data, rows, model="gpt2-tiny", grad_accum=1):
    cfg = TrainConfig(data=data, model=model, schedule="none", stages=1, micro_batches=1,
                      micro_batch_size=rows, grad_accum=grad_accum, **F64)
    trainer = Trainer(cfg)
    logs = [trainer.step(s) for s in range(cfg.optim.steps)]
    return [(l.step, l.loss, l.grad_norm, l.tokens) for l in logs], \
        {n: p.detach() for n, _, p in trainer.replica_parameters()}


def _assert_same(got, want):
    (logs, params), (ref_logs, ref_params) = got, want
    assert [(s, t) for s, _, _, t in logs] == [(s, t) for s, _, _, t in ref_logs]
    for (_, loss, norm, _), (_, ref_loss, ref_norm, _) in zip(logs, ref_logs):
        assert loss == pytest.approx(ref_loss, rel=1e-10) and norm == pytest.approx(ref_norm, rel=1e-10)
    assert params.keys() <= ref_params.keys() and params
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(ACCUM))
def test_grad_accum_is_one_step_over_the_larger_batch(accumulated, data, name):
    model = ACCUM[name].get("model", "gpt2-tiny")
    rows = TrainConfig(**{**ACCUM[name], "data": data}).step_batch
    ref = _one_process(data, rows, model)
    for rank in (0, 1):
        _assert_same(accumulated[rank][name], ref)


def test_grad_accum_in_one_process_equals_the_larger_batch(data):
    _assert_same(_one_process(data, 4, grad_accum=3), _one_process(data, 12))
    # and it is not a no-op: the first pass alone differs
    (logs, _), (ref, _) = _one_process(data, 4), _one_process(data, 12)
    assert logs[0][1] != ref[0][1]


# -- refusals ----------------------------------------------------------------------------------
BAD = [
    (["--lr-schedule", "exp"], "--lr-schedule"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio"),
    (["--wsd-decay", "-0.1"], "--wsd-decay"),
    (["--adam-beta1", "1"], "--adam-beta1"),
    (["--adam-beta2", "nan"], "--adam-beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--grad-accum", "0"], "--grad-accum"),
    (["--grad-accum", "many"], "--grad-accum"),
    (["--peak-flops", "-1"], "--peak-flops"),
    (["--warmup", "-5"], "--warmup"),
    (["--resume-allow", "model"], "--resume-allow"),
    (["--dtype", "fp8"], "--dtype"),
    (["--dtype", "bf16-master", "--shard-optimizer"], "--shard-optimizer"),
    (["--tensorboard", __file__], "--tensorboard"),
]


@pytest.mark.parametrize("argv, word", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_refused_in_one_line(argv, word, data, monkeypatch, capsys):
    import chimera.train.launch

    monkeypatch.setattr(chimera.train.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--data", data, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and word in err[0], err


@pytest.mark.parametrize("kw", [dict(lr_schedule="step"), dict(min_lr_ratio=2.0),
                                dict(adam_beta2=1.0), dict(adam_eps=-1.0), dict(grad_accum=0),
                                dict(peak_flops=math.inf), dict(resume_allow=("seed",)),
                                dict(warmup=-5)])
def test_the_api_refuses_the_same(kw):
    with pytest.raises(ConfigError):
        TrainConfig(**kw)


def test_launch_runs_with_accumulation(data):
    """End to end through launch: the step's tokens count every accumulated mini-batch."""
    cfg = TrainConfig(data=data, schedule="none", stages=1, micro_batch_size=2, grad_accum=3,
                      steps=2, progress=False)
    steps = launch(cfg)["steps"]
    assert [s["tokens"] for s in steps] == [2 * 3 * build.model_source(cfg).seq_len] * 2


NEW_FLAGS = ("--lr-schedule", "--min-lr-ratio", "--wsd-decay", "--adam-beta1", "--adam-beta2",
             "--adam-eps", "--grad-accum", "--compile", "--tensorboard", "--peak-flops",
             "--resume-allow")


def test_every_new_flag_is_explained_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in NEW_FLAGS:
        assert flag in text, flag
    for phrase in ("bf16-master = bf16 weights", "fp16 = float32 weights with float16 autocast",
                   "K*W*N*B sequences", "model FLOPs utilization", "comma-separated: data"):
        assert phrase in text, phrase
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "TRAINING.md")).read()
    for flag in NEW_FLAGS + ("--dtype bf16-master", "--dtype fp16"):
        assert f"`{flag}" in docs, flag


@pytest.mark.slow
def test_the_new_flags_end_to_end(run_cli, data, tmp_path):
    board = tmp_path / "tb"
    out = run_cli("train", "--data", data, "--steps", "2", "-B", "2", "--grad-accum", "2",
                  "--dtype", "fp16", "--lr-schedule", "linear", "--adam-beta2", "0.99",
                  "--tensorboard", board, "--peak-flops", "1e9", "--eval-every", "2",
                  "--eval-batches", "1", "--no-progress", "--png", "", "--trace", "")
    assert out.returncode == 0, out.stderr
    assert "perplexity" in out.stdout and "of 1e+09 FLOP/s per rank x 2" in out.stdout
    assert any(p.name.startswith("events.out.tfevents") for p in board.iterdir())


def _compile_worker(rank, world, data):
    """In a process of its own: torch.nn.Module.compile patched, dynamo's counters its own."""
    from torch._dynamo.utils import counters  # here: dynamo loads only in this rank

    original = torch.nn.Module.compile
    # dynamo's own tracing with the eager backend: what --compile does to the stages, without
    # inductor's code generation (minutes on one CPU core; --compile itself uses inductor)
    torch.nn.Module.compile = lambda self, **kw: original(self, backend="eager")
    out = {}
    for on in (False, True):
        cfg = TrainConfig(data=data, steps=3, dtype="float64", compile=on, progress=False)
        t = Trainer(cfg)
        out[on] = ([t.step(s).loss for s in range(3)],
                   [m._compiled_call_impl is not None for m in t.runtime.modules.values()])
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


@pytest.mark.slow
def test_compiled_stages_train_as_the_uncompiled_ones(data):
    for out in run_ranks(functools.partial(_compile_worker, data=data), 2, processes=True):
        assert out[False][1] == [False, False] and out[True][1] == [True, True]
        assert out["graphs"] > 0  # dynamo traced the stages
        assert out[True][0] == out[False][0]
