"""The planner with tensor parallelism (issue 35 point 7): pricing per TP rank, the (W, D, T)
search and its bounds, the CLI. No processes."""

import dataclasses
import io
import json
from contextlib import redirect_stdout

import pytest

from chimera.cli import main
from chimera.errors import UserError
from chimera.modelcfg import (get_config, get_sized_config, layer_param_counts, param_count,
                              flops_per_token)
from chimera.plan import Planner, PlanError, Workload, get_hardware
from chimera.plan.memory import block_activation_bytes, state_bytes
from chimera.plan.report import explain
from chimera.plan.search import Candidate
from chimera.plan.tensor import (collective_times, padded_vocab, rank_param_counts,
                                 tensor_sizes, tp_problem)
from chimera.schedules import get_scheme
from chimera.sim.cost import Link

FEW = ["1f1b", "chimera", "zb-h1", "interleaved"]


def planner(model="gpt2-small", gpus=8, batch=16, hw="h100", tensor=(1, 2, 4), names=FEW,
            memory=None, **overrides):
    cfg = get_sized_config(model, **overrides)
    work = Workload(cfg, gpus, batch, get_hardware(hw), memory_gib=memory, name=model,
                    tensor_parallel=tensor)
    return Planner(work, names)


def run_cli(*argv):
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


# -- T = 1 is what the planner gave before it knew T -----------------------------------------

# (model, P, G, hardware) -> top 3 of FEW as (variant, W, D, B, recompute, iteration s, bytes),
# recorded from the planner before tensor parallelism was added (commit 3ebbc0a)
BEFORE = {
    ("gpt2-small", 8, 32, "a100"): [
        ("interleaved v=4", 8, 1, 4, False, 0.0280844909469069, 2610831360.0),
        ("chimera Q=4 direct", 2, 4, 4, False, 0.028291234626906903, 2610831360.0),
        ("chimera Q=8 direct", 1, 8, 4, False, 0.02835117502342864, 2610831360.0)],
    ("gpt2-medium", 16, 64, "h100"): [
        ("chimera Q=8 direct", 2, 8, 4, False, 0.04883642790267873, 8112766976.0),
        ("interleaved v=4", 8, 2, 4, False, 0.05085825955172973, 5677514752.0),
        ("interleaved v=4", 4, 4, 4, False, 0.051103452645547984, 4485120000.0)],
    ("bert-48", 8, 64, "v100"): [
        ("interleaved v=4", 2, 4, 8, False, 0.17733866035515083, 4253548544.0),
        ("interleaved v=4", 4, 2, 8, False, 0.17840557123268927, 6663618560.0),
        ("chimera Q=8 direct", 1, 8, 8, False, 0.18140255690043078, 11526828032.0)],
    ("gpt2-paper", 32, 64, "p100"): [
        ("interleaved v=4", 4, 8, 2, False, 2.9990896800987077, 13305854976.0),
        ("chimera Q=4 doubling", 1, 32, 1, False, 3.077444767672841, 13235814400.0),
        ("chimera Q=4 halving", 1, 32, 2, False, 3.077444767672841, 13235814400.0)],
}


@pytest.mark.parametrize("case", list(BEFORE))
@pytest.mark.parametrize("node", [None, 8])
def test_t1_plans_are_unchanged(case, node):
    """T = 1, with or without a node size given: the very figures of before."""
    model, gpus, batch, hw = case
    work = Workload(get_config(model), gpus, batch, get_hardware(hw), name=model, gpus_per_node=node)
    top = Planner(work, FEW).run(top_k=3).top
    got = [(e.candidate.variant, e.candidate.width, e.candidate.depth, e.candidate.micro_batch,
            e.candidate.recompute, e.iteration_s, e.memory_bytes) for e in top]
    assert got == BEFORE[case]  # p100 has no intra-node links: a node of 8 changes nothing
    assert all(e.candidate.tensor == 1 for e in top)


def test_cli_without_gpus_per_node_prints_no_t_column():
    _, out = run_cli("plan", "--model", "gpt2-small", "--gpus", "8", "--global-batch", "32",
                     "--hardware", "a100", "--schemes", "1f1b,chimera", "--top", "2")
    assert " T " not in out.splitlines()[3] and "tensor parallel" not in out


# -- pricing one TP rank ----------------------------------------------------------------------

@pytest.mark.parametrize("model, replicated", [("gpt2-medium", 6), ("llama-70b", 2)])
@pytest.mark.parametrize("t", [2, 4, 8])
def test_rank_parameters_are_the_sharded_slice_plus_the_replicated(model, replicated, t):
    """A block: everything but its norms (and GPT-2's two row-parallel biases) divided by T;
    the vocabulary tables by padded rows."""
    cfg = get_sized_config(model)
    full, rank = layer_param_counts(cfg), rank_param_counts(cfg, t)
    whole = replicated * cfg.d_model
    assert rank[1] * t - (t - 1) * whole == full[1]
    rows = padded_vocab(cfg, t) // t
    assert rank[0] == rows * cfg.d_model + (cfg.seq_len * cfg.d_model if cfg.kind == "gpt2" else 0)
    assert rank[-1] - rows * cfg.d_model == full[-1] - cfg.vocab_size * cfg.d_model  # the head's norm


def test_llama_70b_preset():
    cfg = get_sized_config("llama-70b")
    assert round(param_count(cfg) / 1e9, 2) == 68.98  # Llama 2 70B
    assert (cfg.kv_heads, cfg.ffn_width, cfg.gated) == (8, 28672, True)
    with pytest.raises(UserError, match="unknown model"):
        get_config("llama-70b")  # sized for the planner; chimera train cannot build it


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_activations_follow_korthikanti(t):
    """sbh(10 + 24/t + 5as/(ht)): 16-bit, dropout masks, no sequence parallelism."""
    cfg = get_config("gpt2-medium", dropout=0.1)
    s, h, a, b = cfg.seq_len, cfg.d_model, cfg.n_head, 2
    got = block_activation_bytes(cfg, s * b, "mixed", flash=False, tensor=t)
    assert got == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


def test_llama_block_activations_divide_inside_the_sub_blocks():
    cfg = get_sized_config("llama-70b")
    h, kv, f = cfg.d_model, cfg.d_model // 8, cfg.ffn_width
    one = block_activation_bytes(cfg, 1, "mixed", flash=True)
    eight = block_activation_bytes(cfg, 1, "mixed", flash=True, tensor=8)
    assert one == 2 * (4 * h + 2 * h + 2 * kv + 4 * f)
    assert eight == 2 * (4 * h + (2 * h + 2 * kv + 4 * f) / 8)


def test_stage_costs_divide_compute_and_add_collectives():
    """A stage at T: its layers' compute at FLOPs / T read at tokens / T (the embedding whole),
    the TP collectives in F and in B's input-gradient half, none in W; parameters, gradients and
    activations per rank."""
    pl = planner("gpt2-medium", tensor=(1, 4))
    hw, cfg = pl.work.hardware, pl.work.model
    tokens, t = 2 * cfg.seq_len, 4
    one, four = pl.pricing.stage_costs(2, 2, False), pl.pricing.stage_costs(2, 2, False, t)
    flops = flops_per_token(cfg)
    cf, cb = collective_times(cfg, tokens, "mixed", t, hw.allreduce_link(t))
    assert cf[1] == hw.allreduce_link(t).allreduce(tokens * cfg.d_model * 2, t) * 2  # 2 per block
    for s, r in enumerate(four.ranges):
        comp_f = sum(hw.layer_time(flops[i] * tokens / (1 if i == 0 else t), tokens / (1 if i == 0 else t))
                     for i in r)
        comp_b = sum(hw.layer_time(2 * flops[i] * tokens / (1 if i == 0 else t),
                                   tokens / (1 if i == 0 else t)) for i in r)
        assert four.tp_f[s] == pytest.approx(sum(cf[i] for i in r)) and four.tp_f[s] > 0
        assert four.times.f[s] == pytest.approx(comp_f + four.tp_f[s])
        assert four.times.i[s] == pytest.approx(comp_b / 2 + four.tp_b[s])
        assert four.times.w[s] == pytest.approx(comp_b / 2)
        assert four.times.b[s] == pytest.approx(comp_b + four.tp_b[s])
        assert four.times.f[s] < one.times.f[s]
        assert four.params[s] == sum(rank_param_counts(cfg, t)[i] for i in r) < one.params[s] / 3
        assert four.grad_bytes[s] == four.params[s] * 2
        assert four.act_full[s] < one.act_full[s]
    assert one.tp_f == () and one.tp_b == ()
    rc = pl.pricing.stage_costs(2, 2, True, t)  # the recomputed forward redoes its collectives
    assert rc.times.b == pytest.approx([b + f for b, f in zip(four.times.b, four.times.f)])


def test_memory_of_a_tp_candidate_is_one_ranks():
    pl = planner("gpt2-medium", tensor=(2,), names=["1f1b"])
    c = Candidate("1f1b", (), 2, 2, 2, 4, False, tensor=2)
    shape = pl.shape(c)
    sc = pl.stage_costs(c, shape)
    expect = max(state_bytes(sc.params[r], "mixed") + shape.held.peak(r, sc.act_kept) for r in range(2))
    assert pl.memory(c, shape, sc) == expect


@pytest.mark.parametrize("link", [Link(3e-6, 360e9), Link(5e-6, 48e9)])
def test_tp_communication_grows_with_t(link):
    cfg = get_config("gpt2-medium")
    per_block = [collective_times(cfg, 4096, "mixed", t, link) for t in (1, 2, 4, 8)]
    assert [f[1] for f, _ in per_block][0] == 0.0
    for (f0, b0), (f1, b1) in zip(per_block, per_block[1:]):
        assert all(x1 > x0 for x0, x1 in zip(f0[1:], f1[1:]))  # blocks and the head's loss
        assert all(x1 > x0 for x0, x1 in zip(b0[1:], b1[1:]))
        assert f1[0] > f0[0] and b1[0] == 0.0  # the embedding: forward only
    assert link.all_gather(1e6, 4) == link.allreduce(1e6, 4) / 2


def test_tp_comm_of_an_evaluation_counts_each_action():
    """1F1B at D=2: each rank runs N forwards and N backwards of its one stage."""
    pl = planner("gpt2-medium", tensor=(1, 4), names=["1f1b"])
    c = Candidate("1f1b", (), 2, 1, 2, 4, False, tensor=4)
    e = pl.evaluate(c)
    sc = pl.stage_costs(c, pl.shape(c))
    assert pl.tp_comm(e) == pytest.approx(max(4 * (f + b) for f, b in zip(sc.tp_f, sc.tp_b)))
    rc = dataclasses.replace(c, recompute=True)  # the recomputed forward's collectives too
    sc = pl.stage_costs(rc, pl.shape(rc))
    assert pl.tp_comm(pl.evaluate(rc)) == pytest.approx(max(4 * (2 * f + b) for f, b in zip(sc.tp_f, sc.tp_b)))
    assert pl.tp_comm(pl.evaluate(dataclasses.replace(c, tensor=1, width=4))) == 0.0


def test_p2p_crosses_nodes_when_a_pipeline_of_d_times_t_does():
    pl = planner("gpt2-medium", gpus=16, tensor=(4, 8))
    hw = pl.work.hardware
    inside = pl.pricing.cost_model(pl.pricing.stage_costs(2, 1, False, 4), 2, 2, 1.0)
    across = pl.pricing.cost_model(pl.pricing.stage_costs(2, 1, False, 8), 2, 1, 1.0)
    assert inside.p2p == hw.intra_p2p and across.p2p == hw.p2p


# -- the search ---------------------------------------------------------------------------------

def test_t_divides_the_node_p_and_the_model():
    paper = get_config("gpt2-paper")  # 20 heads: no T = 8
    assert tensor_sizes(paper, 64, 8) == (1, 2, 4)
    assert tensor_sizes(get_sized_config("llama-70b"), 64, 8) == (1, 2, 4, 8)
    assert tensor_sizes(get_sized_config("llama-70b"), 64, 4) == (1, 2, 4)
    assert tensor_sizes(get_config("gpt2-medium"), 12, 8) == (1, 2, 4)  # T | P
    assert tensor_sizes(get_config("bert-48"), 64, 8) == (1,)
    assert tensor_sizes(get_config("gpt2-medium", dropout=0.1), 64, 8) == (1,)
    assert "20 heads" in tp_problem(paper, 8)
    assert "key/value heads" in tp_problem(get_sized_config("llama-70b", n_head=64, n_kv_head=2), 4)
    for bad, message in (((8,), "20 heads"), ((16,), "GPUs per node"), ((0,), "positive")):
        with pytest.raises(PlanError, match=message):
            Workload(paper, 64, 64, get_hardware("h100"), tensor_parallel=bad)


def test_every_candidate_lays_out_p_as_w_d_t():
    pl = planner("gpt2-medium", gpus=16, batch=32, tensor=(1, 2, 4, 8))
    seen = set()
    for c in pl.candidates():
        assert c.width * c.depth * c.tensor == 16 and c.tensor in (1, 2, 4, 8)
        seen.add(c.tensor)
    assert seen == {1, 2, 4, 8}


def test_bounds_stay_lower_bounds_with_t_and_the_search_is_exact():
    pl = planner("gpt2-medium", gpus=8, batch=16, tensor=(1, 2, 4, 8),
                 names=["1f1b", "chimera", "zb-h1", "pipedream-2bw"])
    evals = [e for e in map(pl.evaluate, pl.candidates()) if e is not None]
    assert {e.candidate.tensor for e in evals} == {1, 2, 4, 8}
    best = {}
    for e in evals:
        c = e.candidate
        floor, mem = pl.lower_bounds(c)
        assert floor <= e.iteration_s * (1 + 1e-9), c
        assert pl.quick_floor(c) <= e.iteration_s * (1 + 1e-9), c
        assert mem <= e.memory_bytes * (1 + 1e-9), c
        key = (c.scheme, c.tensor)
        best[key] = min(best.get(key, e.iteration_s), e.iteration_s)
    result = pl.run(top_k=5, group=lambda c: (c.scheme, c.tensor))
    assert {k: e.iteration_s for k, e in result.best.items()} == pytest.approx(best)
    runnable = sorted(e.iteration_s for e in evals if get_scheme(e.candidate.scheme).runnable)
    assert [e.iteration_s for e in result.top] == pytest.approx(runnable[:5])


def test_a_model_that_does_not_fit_at_t1_gets_t_above_1():
    """64 GPUs and 26 layers: at T = 1 a stage holds at least 1/16 of the model (D <= 26), at
    T = 4 a quarter of that."""
    def make(tensor, memory=None):
        return planner("gpt2-medium", gpus=64, batch=64, tensor=tensor, names=["1f1b"], memory=memory)

    def least(tensor):
        pl = make(tensor)
        return min(e.memory_bytes for e in map(pl.evaluate, pl.candidates()) if e) / 2**30

    need, need4 = least((1,)), least((4,))
    assert need4 < need / 2
    limit = (need + need4) / 2
    with pytest.raises(PlanError, match="no configuration fits"):
        make((1,), limit).run(top_k=1)
    result = make((1, 2, 4, 8), limit).run(top_k=3)
    assert all(e.candidate.tensor > 1 and e.memory_bytes <= limit * 2**30 for e in result.top)


def test_explain_says_why_this_t():
    pl = planner("gpt2-medium", gpus=8, batch=16, tensor=(1, 2, 4), names=["1f1b", "chimera"])
    text = explain(pl, pl.run(top_k=2))
    t = pl.run(top_k=1).top[0].candidate.tensor
    assert f"why T={t}" in text and "<- chosen" in text.split(f"why T={t}")[1]
    assert "TP collectives" in text
    assert "T=8: not searched" in text or t < 4  # 2T beyond what was asked for


# -- the command line ------------------------------------------------------------------------------

def test_cli_gpus_per_node_searches_t_and_explains():
    code, out = run_cli("plan", "--model", "gpt2-paper", "--gpus", "16", "--global-batch", "32",
                        "--hardware", "h100", "--gpus-per-node", "8", "--schemes", "1f1b,chimera",
                        "--top", "3", "--explain")
    assert code == 0 and "tensor parallel T in {1, 2, 4}" in out
    assert out.splitlines()[3].split()[:6] == ["#", "scheme", "W", "D", "T", "B"]
    assert "why T=" in out and "T=4: " in out
    _, out = run_cli("plan", "--model", "gpt2-paper", "--gpus", "16", "--global-batch", "32",
                     "--hardware", "h100", "--tensor-parallel", "4", "--schemes", "1f1b",
                     "--top", "1", "--explain")
    assert "T=8: not searched (T=8 does not divide the 20 heads)" in out
    assert "T=1: not searched (not asked for)" in out


def test_cli_json_has_t_and_a_fixed_t():
    code, out = run_cli("plan", "--model", "llama-70b", "--gpus", "64", "--global-batch", "64",
                        "--hardware", "h100", "--tensor-parallel", "8", "--schemes", "1f1b",
                        "--recompute", "on", "--json", "--top", "2")
    data = json.loads(out)
    assert code == 0 and data["tensor_parallel"] == [8] and data["gpus_per_node"] == 8
    assert all(e["T"] == 8 and e["W"] * e["D"] * 8 == 64 for e in data["top"])


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel", "8"], "does not divide the 20 heads"),
    (["--tensor-parallel", "x"], "comma-separated integers"),
    (["--tensor-parallel", "2", "--gpus-per-node", "1"], "GPUs per node"),
    (["--model", "bert-48", "--tensor-parallel", "2"], "BERT"),
])
def test_cli_bad_t_exits_2_with_one_line(argv, message, capsys):
    base = {"--model": "gpt2-paper", "--gpus": "16", "--global-batch": "32", "--hardware": "h100"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit) as exc:
        main(["plan"] + [x for kv in base.items() for x in kv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
