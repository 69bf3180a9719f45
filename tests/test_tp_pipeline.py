"""Tensor parallelism inside every stage (P = W x D x T): the pipeline with T = 2 trains with
the gradients, losses and gradient norms of one process, on virtual ranks (threads: every TP
collective goes through the rank's transport, as the pipeline's own do), float64.

The real-process runs (gloo, the CLI, checkpoints across T) are in the slow tests at the end.
"""

import json
import os
import subprocess
import sys

import pytest

from chimera.errors import UserError
from chimera.train.config import TrainConfig
from chimera.train.equivalence import check_virtual
from limits import limit


def _cfg(**kw) -> TrainConfig:
    base = dict(model="gpt2-tiny", schedule="chimera", stages=2, tensor_parallel=2,
                micro_batches=4, micro_batch_size=2, dtype="float64", steps=3)
    return TrainConfig(**{**base, **kw})


def _exact(r: dict) -> None:
    assert not r["missing"] and r["replicas_identical"], r
    assert r["max_grad_rel_err"] < 1e-12, r
    assert r["max_loss_rel_err"] < 1e-12 and r["max_norm_rel_err"] < 1e-12, r
    assert r["max_param_rel_err"] < 1e-10, r  # after 3 AdamW steps (with clipping)


@pytest.mark.parametrize("schedule", ["chimera", "1f1b", "zb-v", "chimera-zb",
                                      pytest.param("dualpipev", marks=pytest.mark.slow)])
def test_every_kind_of_schedule_with_tp2_equals_one_process(schedule):
    """Bidirectional, 1F1B, split backward (I and W apart: TP's backward allreduces in I)."""
    _exact(check_virtual(_cfg(schedule=schedule)))


@pytest.mark.parametrize("model", ["hf-llama-tiny", "bert-tiny"])
def test_models_with_their_built_in_plans(model):
    """HF Llama (GQA: query and key/value heads both split) with a vocabulary-parallel
    embedding and head; chimera's BERT (post-LN blocks, bidirectional attention, the MLM
    head's decoder by vocabulary, masked targets: the vocab-parallel loss's ignore_index
    and a token_mean over them). chimera's GPT-2, its fused qkv split by head blocks, is
    every test above."""
    _exact(check_virtual(_cfg(model=model, schedule="1f1b")))


@pytest.mark.parametrize("model", ["gpt2-tiny", "hf-llama-tiny"])
def test_the_built_in_lms_keep_their_logits_sharded_and_still_evaluate(model):
    """Under T = 2 the head of a built-in LM keeps its logits sharded over the vocabulary (the
    loss is the vocab-parallel cross-entropy: the runs above are exact with it); evaluation's
    loss and ``eval_step``'s outputs (the logits gathered whole) equal one process's."""
    import torch

    from chimera.runtime.transport import OneRank
    from chimera.runtime.virtual import VirtualWorld, run_virtual
    from chimera.train.equivalence import reference_config
    from chimera.train.loop import Trainer, run_context

    cfg = _cfg(model=model, schedule="1f1b")

    def evaluate(trainer: Trainer):
        x, y = trainer.batch(0)
        trainer.pipe.eval()
        return trainer.pipe.eval_step(x, y, return_outputs=True)

    world = VirtualWorld(cfg.world)

    def rank(r: int):
        trainer = Trainer(cfg, run_context(cfg, None, world.rank(r)))
        heads = [type(list(m.children())[-1].lm_head).__name__
                 for (_, stage), m in trainer.runtime.modules.items() if stage == trainer.schedule.stages - 1]
        return heads, evaluate(trainer)

    ref_cfg = reference_config(cfg)
    ref_loss, ref_logits = evaluate(Trainer(ref_cfg, run_context(ref_cfg, None, OneRank())))
    results = run_virtual(cfg.world, rank, world)
    assert [heads for heads, _ in results] == [[], [], ["ShardedHead"], ["ShardedHead"]]  # 1f1b: d=1 last
    for _, (loss, logits) in results:
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
        assert logits.shape == ref_logits.shape and torch.allclose(logits, ref_logits, rtol=0, atol=1e-12)


@pytest.mark.slow  # 8 virtual ranks
def test_tp_with_data_parallel_sharded_optimizer_and_recompute():
    """W = 2 copies of D = 2 x T = 2 (8 ranks), ZeRO-1 over each stage's replicas at each t,
    recomputed forwards (which repeat the forward's TP collectives)."""
    _exact(check_virtual(_cfg(data_parallel=2, shard_optimizer=True, recompute=True)))


@pytest.mark.slow  # three layouts of 4 virtual ranks
def test_the_losses_are_the_same_on_every_layout():
    """(D, W, T) in {(1,1,1), (2,1,2), (2,2,1), (4,1,1)}: one mini-batch of 16 sequences."""
    runs = {}
    for d, w, t in [(2, 1, 2), (2, 2, 1), (4, 1, 1)]:
        cfg = _cfg(stages=d, data_parallel=w, tensor_parallel=t, micro_batches=4 if w == 2 else 8)
        r = check_virtual(cfg)
        _exact(r)
        runs[(d, w, t)] = r
    ref = runs[(2, 1, 2)]["ref_losses"]  # (1, 1, 1): the single-process run of the same batch
    for r in runs.values():
        assert r["ref_losses"] == ref
        assert max(abs(a - b) / b for a, b in zip(r["losses"], ref)) < 1e-12


def test_a_recorded_tp_run_replays_under_the_strictest_nccl_model():
    """Every call of every rank, the TP collectives issued inside layers included, replayed
    with one stream per rank for p2p and collectives together (raises on a hang/mismatch)."""
    r = check_virtual(_cfg(steps=2), replay=True)
    _exact(r)
    assert r["replayed_calls"] > 1000


def test_bad_tensor_parallel_sizes_are_refused_before_anything_starts():
    with pytest.raises(UserError, match=r"--tensor-parallel 3: layer 1 \(GPT2Block\).*T=3 does "
                                        r"not divide"):
        _cfg(tensor_parallel=3).preflight()
    _cfg(model="bert-tiny").preflight()  # chimera's BERT has a plan (HF's BertForMaskedLM not yet)
    with pytest.raises(UserError, match="single-process training"):
        TrainConfig(schedule="none", stages=1, tensor_parallel=2)


def test_api_plans_are_checked():
    """A model-wide pattern that names no layer, and T > 1 without a plan, in one line."""
    from torch import nn

    import chimera.api as chimera
    from chimera.runtime.virtual import run_virtual

    def layers():
        return [nn.Sequential(nn.Linear(3, 8)), nn.Tanh(), nn.Sequential(nn.Linear(8, 1))]

    def body(plan):
        def rank(_):
            try:
                chimera.Pipeline(layers, nn.functional.mse_loss, "1f1b", stages=2,
                                 tensor_parallel=2, model=chimera.ModelOptions(tp_plan=plan))
            except UserError as exc:
                return str(exc)
        return run_virtual(4, rank)

    assert all("names no layer" in m for m in body({"lm.fc": "colwise"}))
    assert all("needs a tp_plan" in m for m in body(None))
    # a typo after the layer index: named nothing on any rank, refused on every rank
    assert all("'*.wieght' name no submodule" in m for m in body({"*.wieght": "colwise"}))
    # a style that cannot shard what it names (T=2 does not divide 3 input features), on
    # the ranks holding layer 0 only: every rank says so (the others would wait for them)
    said = body({"0.0": "rowwise", "2.0": "rowwise"})
    assert all("does not divide" in m for m in said), said
    assert said[1:] == ["rank 0: " + said[0]] * 3, said  # the first failing rank's words


# -- real processes -------------------------------------------------------------------------
ROOT = os.path.join(os.path.dirname(__file__), "..")


def _train(tmp_path, name: str, *args) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    cmd = [os.path.join(os.path.dirname(sys.executable), "chimera"), "train", "--dtype", "float64",
           "--no-progress", "--trace", "", "--png", "", "--log-json", str(log), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit(600), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def _close(a: list[dict], b: list[dict], tol: float = 1e-9) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= tol * abs(y[key]), (key, x, y)


@pytest.mark.slow
def test_cli_tp2_on_gloo_processes_equals_one_process(tmp_path):
    """`chimera train --tensor-parallel 2` on 4 gloo processes: the single-process losses and
    gradient norms of the same mini-batch (4 x 4 sequences)."""
    ref = _train(tmp_path, "ref", "--model", "hf-llama-tiny", "--schedule", "none", "--stages", "1",
                 "-B", "16", "--steps", "3")
    got = _train(tmp_path, "tp", "--model", "hf-llama-tiny", "-D", "2", "-T", "2", "-N", "4",
                 "-B", "4", "--steps", "3")
    _close(got, ref)


@pytest.mark.slow
def test_a_tp_checkpoint_resumes_at_another_t_and_in_one_process(tmp_path):
    """Saved at (D=2, T=2) after 2 steps; resumed at (D=2, T=1) and at one process: the next
    losses equal the uninterrupted run's."""
    import shutil

    layout = ["--model", "gpt2-tiny", "-N", "4", "-B", "2"]
    whole = _train(tmp_path, "whole", *layout, "-D", "2", "--steps", "4")
    ck = tmp_path / "ck"
    first = _train(tmp_path, "first", *layout, "-D", "2", "-T", "2", "--steps", "2",
                   "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    _close(first, whole[:2])
    for name, args in (("t1", ["-D", "2"]), ("one", ["--schedule", "none", "--stages", "1"])):
        folder = tmp_path / f"ck-{name}"  # each resume from the same step-2 checkpoint
        shutil.copytree(ck, folder)
        if name == "one":  # one micro-batch of the whole mini-batch
            args = args + ["-N", "1", "-B", "8"]
        again = _train(tmp_path, name, *layout, *args, "--steps", "4",
                       "--checkpoint-dir", str(folder), "--resume")
        _close(again, whole[2:])


def test_ranks_that_disagree_on_t_are_refused_on_every_rank():
    """4 ranks, two of them told T=2 (D=2), two T=1 (D=4): the world size fits both, so
    without the start-up agreement they would hang at their first mismatched collective."""
    from torch import nn

    import chimera.api as chimera
    from chimera.runtime.virtual import run_virtual

    def rank(r):
        d, t = (2, 2) if r < 2 else (4, 1)
        try:
            chimera.Pipeline([nn.Linear(4, 4) for _ in range(4)], nn.functional.mse_loss, "1f1b",
                             stages=d, tensor_parallel=t, model=chimera.ModelOptions(
                                 tp_plan=lambda i, layer: {"": "colwise"} if i % 2 == 0 else
                                 {"": "rowwise"}))
        except UserError as exc:
            return str(exc)

    said = run_virtual(4, rank)
    assert all("disagree on the layout" in m and "rank 2: D=4 W=1 T=1" in m for m in said), said


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "mistral", "gemma", "phi3", "qwen3"])
def test_hf_models_through_the_api_with_tp_train_as_one_process(arch):
    """``hf.load(model).pipeline(tensor_parallel=2)`` takes the model's own plan: GPT-2 with
    its tied wte/lm_head (each TP position sums its own shards of the tie across stages) and
    an odd vocabulary (37, padded to 38), Llama with GQA, Qwen2 (Llama's plan: its q/k/v
    biases cut with their columns; tied), Mistral (a sliding window of 4 in sequences of 8),
    Gemma (its scaled embedding and the head tied to it whole, the blocks sharded), Phi-3
    (HF's own plan: fused projections gathered, row-parallel ones given their whole input),
    Qwen3 (q, k, v gathered so that its q/k norms see every head); padded batches
    (token_mean loss). Phi-3 and Qwen3 on ZB-V (the weight-gradient half apart), the others
    on chimera.
    Losses, gradient norms and the whole state after 2 AdamW steps equal the HF model trained
    in one process."""
    import copy

    import torch

    import hf_models as hm
    from chimera import hf
    from chimera.runtime.virtual import run_virtual

    def batches(step):
        return hm.batch(arch, step, 8)

    ref = hm.build(arch)
    base = copy.deepcopy(ref)  # built once: ranks are threads sharing torch's global RNG
    opt = torch.optim.AdamW(ref.parameters(), lr=hm.LR, weight_decay=hm.DECAY, eps=hm.EPS)
    ref_out = []
    for step in range(2):
        inputs, labels = batches(step)
        opt.zero_grad()
        loss = hm.loss_of(arch, ref(**inputs).logits, labels)  # HF's loss, kept in float64
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_out.append((float(loss.detach()), float(norm)))
    want = {k: v.detach() for k, v in ref.state_dict().items()}

    def rank(_):
        model = hf.load(copy.deepcopy(base), dtype=torch.float64)
        pipe = model.pipeline(schedule="zb-v" if arch in ("phi3", "qwen3") else "chimera", stages=2,
                              tensor_parallel=2, micro_batches=4, micro_batch_size=2)
        popt = torch.optim.AdamW(pipe.parameters(), lr=hm.LR, weight_decay=hm.DECAY, eps=hm.EPS)
        out = []
        for step in range(2):
            inputs, labels = batches(step)
            popt.zero_grad()
            loss = pipe.step(inputs, labels)
            norm = pipe.clip_grad_norm_(1.0)
            popt.step()
            out.append((loss, float(norm)))
        return out, model.hf_state_dict(pipe.state_dict(all_ranks=True))

    rel, tol = (1e-12, hm.TOL) if arch != "gemma" else (1e-6, hm.TOL32)  # Gemma: float32 norms
    for out, state in run_virtual(4, rank):
        for (loss, norm), (ref_loss, ref_norm) in zip(out, ref_out):
            assert abs(loss - ref_loss) < rel * abs(ref_loss)
            assert abs(norm - ref_norm) < rel * abs(ref_norm)
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], **tol)


def test_replicated_parameters_start_equal_on_every_tp_rank():
    """Layers built from each rank's own RNG (a list made per rank without a seed): the TP
    ranks' replicated parameters (a LayerNorm, a row-parallel bias) take t = 0's values, as
    the replicas of a stage take their first member's; their gradients are equal, so they
    then stay equal."""
    import torch
    from torch import nn

    import chimera.api as chimera
    from chimera.runtime.virtual import run_virtual

    def rank(r):
        torch.manual_seed(1000 + r)  # (threads share torch's RNG: the lists differ anyway)
        layers = [nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4)), nn.Tanh(),
                  nn.Sequential(nn.Linear(4, 1))]
        plan = {"0.0": "colwise", "0.2": "rowwise"}
        pipe = chimera.Pipeline(layers, nn.functional.mse_loss, "1f1b", stages=2,
                                tensor_parallel=2, model=chimera.ModelOptions(tp_plan=plan))
        return {n: p.detach().clone() for n, p in pipe.named_parameters()
                if n.startswith(("0.1.", "0.2.bias", "2."))}

    held = run_virtual(4, rank)
    for a, b in ((0, 1), (2, 3)):  # the TP pairs of d = 0 and d = 1
        assert held[a].keys() == held[b].keys() and held[a]
        for name in held[a]:
            assert torch.equal(held[a][name], held[b][name]), name


def test_a_tp_collective_whose_peer_never_comes_ends_in_the_run_timeout():
    """A TP peer that died or hangs: the wait ends after the run's --comm-timeout in a
    CommTimeout naming this rank, the collective and the peer (not after the backend's own
    default, 30 minutes on gloo)."""
    import datetime
    import time

    import torch

    from chimera.runtime.p2p import CommTimeout
    from chimera.runtime.transport import current
    from chimera.runtime.virtual import run_virtual
    from chimera.tp import TPGroup

    def rank(r):
        transport = current()
        group = transport.new_group([0, 1])
        if r == 1:
            time.sleep(1.0)  # never joins
            return None
        tp = TPGroup(transport, group, 0, 2, datetime.timedelta(seconds=0.3))
        tp.all_reduce(torch.ones(3))

    with pytest.raises(CommTimeout, match=r"rank 0: tensor-parallel allreduce with peer rank 1 "
                                          r"timed out after 0.3s"):
        run_virtual(2, rank)


def test_a_tie_cut_two_ways_is_refused_on_every_rank():
    """An embedding sharded by vocabulary tied to a head left whole (in another stage)."""
    import torch
    from torch import nn

    import chimera.api as chimera
    from chimera.runtime.virtual import run_virtual

    def layers():
        emb, head = nn.Sequential(nn.Embedding(8, 4)), nn.Sequential(nn.Linear(4, 8, bias=False))
        head[0].weight = emb[0].weight
        return [emb, head]

    def rank(_):
        try:
            chimera.Pipeline(layers, lambda y, t: y.float().mean(), "1f1b", stages=2,
                             tensor_parallel=2,
                             model=chimera.ModelOptions(tp_plan={"0.0": "embedding_rowwise"}),
                             example_input=torch.zeros(1, 3, dtype=torch.long))
        except UserError as exc:
            return str(exc)

    said = run_virtual(4, rank)
    assert all(m and "tied weight 0.0.weight are cut differently" in m for m in said), said


@pytest.mark.slow
def test_a_tp_rank_killed_mid_step_ends_every_rank_naming_it(tmp_path):
    """Rank 1 (stage 0's second TP shard) dies by SIGKILL at the start of step 2: its TP peer
    and the next stage's ranks end well inside the step timeout, and the launcher's summary
    names rank 1 first, not a rank that noticed."""
    import time

    from limits import limit

    cmd = [os.path.join(os.path.dirname(sys.executable), "chimera"), "train", "--dtype", "float64",
           "--no-progress", "--trace", "", "--png", "", "--model", "hf-llama-tiny", "-D", "2",
           "-T", "2", "-N", "4", "-B", "4", "--steps", "50", "--comm-timeout", "300",
           "--fault", "kill:1:2"]
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit(600), cwd=tmp_path)
    took = time.monotonic() - start
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("chimera train: rank 1 failed first (killed by SIGKILL)"), r.stderr
    # a rank that noticed ends in one line whatever it raised (once under load: gloo refusing
    # a receive's post, which escaped as a traceback)
    assert "Traceback" not in r.stderr, r.stderr
    assert took < 300, f"the ranks waited out the step timeout ({took:.0f} s)"
