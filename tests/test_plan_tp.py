"""The planner with tensor parallelism (issue 35 point 7): pricing per TP rank. No processes."""

import io
from contextlib import redirect_stdout

import pytest

from chimera.cli import main
from chimera.errors import UserError
from chimera.modelcfg import (get_config, get_sized_config, layer_param_counts, param_count,
                              flops_per_token)
from chimera.plan import Planner, PlanError, Workload, get_hardware
from chimera.plan.memory import block_activation_bytes
from chimera.plan.tensor import (collective_times, padded_vocab, rank_param_counts,
                                 tensor_sizes, tp_problem)
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


@pytest.mark.parametrize("link", [Link(3e-6, 360e9), Link(5e-6, 48e9)])
def test_tp_communication_grows_with_t(link):
    cfg = get_config("gpt2-medium")
    per_block = [collective_times(cfg, 4096, "mixed", t, link) for t in (1, 2, 4, 8)]
    assert [f[1] for f, _ in per_block][0] == 0.0
    for (f0, b0), (f1, b1) in zip(per_block, per_block[1:]):
        assert all(x1 > x0 for x0, x1 in zip(f0[1:], f1[1:]))  # blocks and the head's gather
        assert all(x1 > x0 for x0, x1 in zip(b0[1:], b1[1:]))
        assert f1[0] > f0[0] and b1[0] == 0.0  # the embedding: forward only
    assert link.all_gather(1e6, 4) == link.allreduce(1e6, 4) / 2


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
