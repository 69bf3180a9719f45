"""Mixed precision (issue 25): bf16 weights with float32 master weights and optimizer state,
and float16 autocast with a loss scaler that skips a step whose gradients overflow."""

import functools

import pytest
import torch

from chimera.train import TrainConfig
from chimera.train import checkpoint as ckpt
from chimera.train.loop import NonFiniteLoss, Trainer
from chimera.train.precision import LossScaler
from ranks import run_ranks

STEPS = 4


def _cfg(data, dtype, **kw):
    base = dict(schedule="none", stages=1, micro_batch_size=8, data=data, progress=False,
                steps=STEPS, dtype=dtype)
    return TrainConfig(**{**base, **kw})


def _train(trainer, steps=STEPS):
    logs = [trainer.step(s) for s in range(steps)]
    trainer.norms = [l.grad_norm for l in logs]  # the unscaled gradients' (AdamW alone would not
    # show a missing unscale: it divides the scale out, and clipping hides it)
    return [l.loss for l in logs], {n: p.detach().clone() for n, _, p in trainer.replica_parameters()}


@pytest.fixture(scope="module")
def float32_run(data):
    t = Trainer(_cfg(data, "float32"))
    init = {n: p.detach().clone() for n, _, p in t.replica_parameters()}
    run = (*_train(t), init)
    FLOAT32_NORMS[:] = t.norms
    return run


FLOAT32_NORMS: list[float] = []


def _assert_near_float32(got, want, loss_tol, param_tol):
    """Losses within ``loss_tol``; the parameters moved as float32 training moved them: the
    difference is below ``param_tol`` of the size of float32's update (whose elements are
    a few learning rates: an element-wise tolerance would measure sign flips of tiny ones)."""
    (losses, params), (ref_losses, ref_params, init) = got, want
    assert losses == pytest.approx(ref_losses, abs=loss_tol)
    assert params and all(p.dtype == torch.float32 for p in params.values())
    off = sum(float((p - ref_params[n]).double().pow(2).sum()) for n, p in params.items())
    moved = sum(float((ref_params[n] - init[n]).double().pow(2).sum()) for n in params)
    assert (off / moved) ** 0.5 < param_tol, (off / moved) ** 0.5


def test_bf16_master_keeps_float32_masters_and_state(data, float32_run):
    t = Trainer(_cfg(data, "bf16-master"))
    run = _train(t)
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in t.params} == {torch.float32}  # what the optimizer updates
    state = [v for st in t.optimizer.state.values() for k, v in st.items() if k != "step"]
    assert state and {v.dtype for v in state} == {torch.float32}
    for p, m in zip(t.model.parameters(), t.params):  # the weights are the rounded masters
        assert torch.equal(p, m.to(torch.bfloat16))
    # bf16 forwards: losses to bf16's precision (0.03 at 5.0); the masters move as float32 training's do
    _assert_near_float32(run, float32_run, loss_tol=0.1, param_tol=0.1)
    # ... and the masters hold updates smaller than bf16 can: some differ from their bf16 copy
    assert any(not torch.equal(m, p.float()) for p, m in zip(t.model.parameters(), t.params))


def test_bf16_master_checkpoints_hold_the_masters(data, tmp_path):
    t = Trainer(_cfg(data, "bf16-master"))
    _train(t, 2)
    path = ckpt.save(t, tmp_path, 2, keep=1)
    stored = ckpt.load_model_state(path)
    assert {v.dtype for v in stored.values()} == {torch.float32}
    again = Trainer(_cfg(data, "bf16-master"))
    assert ckpt.restore(again, tmp_path) == 2
    for a, b in zip(t.params, again.params):
        assert torch.equal(a, b)
    for a, b in zip(t.model.parameters(), again.model.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert t.step(2).loss == again.step(2).loss


def test_fp16_scales_the_loss_and_trains_like_float32(data, float32_run):
    t = Trainer(_cfg(data, "fp16"))
    assert t.scaler.scale == 2.0 ** 16
    run = _train(t)
    assert t.norms == pytest.approx(FLOAT32_NORMS, rel=1e-2)  # the gradients were unscaled
    _assert_near_float32(run, float32_run, loss_tol=5e-3, param_tol=0.02)
    assert t.scaler.scale == 2.0 ** 16  # no overflow in a few steps


def _inf_grad(trainer):
    trainer.params[0].grad.view(-1)[0] = float("inf")


def test_fp16_scaler_skips_a_step_with_an_inf_gradient(data):
    t = Trainer(_cfg(data, "fp16"))
    t.step(0)
    before = [p.detach().clone() for p in t.params]
    log = t.step(1, on_grads=_inf_grad)
    assert log.skipped and log.loss == log.loss  # the loss is finite: only the gradients overflowed
    assert all(torch.equal(a, b) for a, b in zip(before, t.params))  # no update
    assert t.scaler.scale == 2.0 ** 15
    assert not t.step(2).skipped  # the run goes on, at the smaller scale
    assert not all(torch.equal(a, b) for a, b in zip(before, t.params))
    # float32 without a scaler stops there instead (unless --skip-nonfinite)
    with pytest.raises(NonFiniteLoss):
        Trainer(_cfg(data, "float32")).step(0, on_grads=_inf_grad)


def test_loss_scale_grows_after_enough_good_steps():
    s = LossScaler(scale=8.0, growth_interval=2)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0
    s.update(True)
    assert s.scale == 8.0 and s.good_steps == 0


# -- pipelined, on virtual ranks (precision, not the transport, is the subject) -------------------
def _worker(rank, world, data):
    out = {}
    for dtype, sharded in (("bf16-master", False), ("fp16", False), ("fp16", True)):
        cfg = _cfg(data, dtype, schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2,
                   shard_optimizer=sharded)
        t = Trainer(cfg)
        losses, params = _train(t)
        out[dtype + "-sharded" * sharded] = (losses, params, t.norms, [m.dtype for m in t.params],
                      sorted({str(p.dtype) for m in t.runtime.modules.values() for p in m.parameters()}))
    return out


def test_pipelined_mixed_precision_is_close_to_one_process_float32(data, float32_run):
    for out in run_ranks(functools.partial(_worker, data=data), 2):
        losses, params, _, master_dtypes, module_dtypes = out["bf16-master"]
        assert set(master_dtypes) == {torch.float32} and module_dtypes == ["torch.bfloat16"]
        _assert_near_float32((losses, params), float32_run, loss_tol=0.1, param_tol=0.1)
        for name in ("fp16", "fp16-sharded"):  # the scaler unscales an optimizer's slices too
            losses, params, norms, _, module_dtypes = out[name]
            assert module_dtypes == ["torch.float32"]
            assert norms == pytest.approx(FLOAT32_NORMS, rel=1e-2)
            _assert_near_float32((losses, params), float32_run, loss_tol=5e-3, param_tol=0.02)


def test_a_run_goes_on_past_an_overflow_and_says_so(data, monkeypatch, capsys):
    """The nan drill under fp16: the step is skipped with a line naming the new scale, and the
    run ends normally (float32 would stop there)."""
    from chimera.train.launch import launch

    monkeypatch.setenv("CHIMERA_FAULT", "nan:0:1")
    result = launch(_cfg(data, "fp16", steps=3))
    assert [s["skipped"] for s in result["steps"]] == [False, True, False]
    assert "step 1: float16 gradients overflowed: skipped (no optimizer step), loss scale now 32768" \
        in capsys.readouterr().err


# -- a weight tied across stages (HF GPT-2's embedding and head) ---------------------------------
def _tied_worker(rank, world, root):
    cfg = TrainConfig(model=f"hf:{root / 'gpt2'}", data=str(root / "text.txt"), dtype="bf16-master",
                      schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2, seq_len=8,
                      steps=3, progress=False)
    t = Trainer(cfg)
    losses, _ = _train(t, 3)
    tie = t.tie_sync.ties[0] if t.tie_sync.ties else None
    copies = [p.detach().clone() for n, _, p in t.replica_parameters()  # masters, by the
              if n == "transformer.wte.weight"]  # tie's first name: embedding and head
    return {"losses": losses, "copies": copies, "tied": tie is not None}


def test_bf16_master_keeps_a_tied_weight_tied(tmp_path):
    """The tie's copies (embedding on the first stage, head on the last) get the summed
    gradient, so their float32 masters, and the bf16 weights rounded from them, stay equal."""
    import json

    from transformers import GPT2Config

    (tmp_path / "text.txt").write_bytes(open(json.__file__, "rb").read()[:20_000] * 3)
    GPT2Config(vocab_size=256, n_embd=16, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
               eos_token_id=None).save_pretrained(tmp_path / "gpt2")
    outs = run_ranks(functools.partial(_tied_worker, root=tmp_path), 2)
    assert outs[0]["tied"] and outs[0]["losses"] == outs[1]["losses"]
    copies = [c for out in outs for c in out["copies"]]  # 2 replicas x (embedding, head)
    assert len(copies) == 4 and all(torch.equal(copies[0], c) for c in copies[1:])
    assert copies[0].dtype == torch.float32


def test_the_loss_scale_is_checkpointed(data, tmp_path):
    t = Trainer(_cfg(data, "fp16"))
    t.step(0)
    t.step(1, on_grads=_inf_grad)  # the scale halves
    t.step(2)
    ckpt.save(t, tmp_path, 3, keep=1)
    again = Trainer(_cfg(data, "fp16"))
    assert again.scaler.scale == 2.0 ** 16
    ckpt.restore(again, tmp_path)
    assert (again.scaler.scale, again.scaler.good_steps) == (2.0 ** 15, 1)
    assert again.step(3).loss == t.step(3).loss
