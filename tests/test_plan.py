"""The planner: memory model, bounds, exact search, asynchronous schemes, CLI (no torch)."""

import dataclasses
import io
import json
import math
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

from chimera.cli import main
from chimera.ir import ScheduleError
from chimera.modelcfg import get_config, layer_param_counts
from chimera.passes import lower
from chimera.plan import Planner, PlanError, ProfileError, Workload, get_hardware, parse_profile
from chimera.plan.memory import (HeldActivations, block_activation_bytes, layer_activation_bytes,
                                 state_bytes)
from chimera.plan.report import _sweep, parts, why_faster
from chimera.plan.search import Candidate, Evaluation
from chimera.schedules import build, get_scheme, schemes
from chimera.schedules.asynchronous import steady_period
from chimera.sim import CostModel, simulate
from chimera.sim.engine import compile_schedule

SMALL = ["gpipe", "1f1b", "interleaved", "zb-h1", "gems", "chimera", "pipedream", "pipedream-2bw"]


def small_planner(gpus=8, batch=32, memory=None, names=SMALL, model="gpt2-small"):
    work = Workload(get_config(model), gpus, batch, get_hardware("a100"), memory_gib=memory,
                    name=model)
    return Planner(work, names)


@pytest.mark.slow
def test_plan_imports_no_torch(cli_env):
    code = ("import sys, chimera.plan, chimera.plan.report, chimera.cli.plan_cmd; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=cli_env)
    assert out.stdout.strip() == "False"


# -- memory model --------------------------------------------------------------------------

def test_block_activations_match_korthikanti():
    # sbh(34 + 5as/h) bytes: 16-bit activations, dropout masks (Korthikanti et al. 2022)
    cfg = get_config("bert-48", dropout=0.1)
    s, h, a, b = cfg.seq_len, cfg.d_model, cfg.n_head, 3
    assert block_activation_bytes(cfg, s * b, "mixed", flash=False) == s * b * h * (34 + 5 * a * s / h)


def test_block_activations_fp32_no_dropout_and_flash():
    cfg = get_config("gpt2-paper")  # dropout 0
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_head
    assert block_activation_bytes(cfg, s, "fp32", flash=False) == s * h * 16 * 4 + 4 * a * s * s
    assert block_activation_bytes(cfg, s, "fp32", flash=True) == s * h * 16 * 4


def test_layer_activations_embedding_and_head():
    cfg = get_config("gpt2-tiny")
    t, h, v = 10, cfg.d_model, cfg.vocab_size
    acts = layer_activation_bytes(cfg, t, "fp32", flash=False)
    assert len(acts) == cfg.n_layers_total
    assert acts[0] == t * (8 + 4 * h)  # token ids and the summed embedding
    assert acts[-1] == t * (2 * 4 * h + 4 * v)  # LayerNorm and matmul inputs, fp32 logits


def test_training_state_bytes_per_parameter():
    assert state_bytes(10, "fp32") == 10 * (4 + 4 + 8)
    assert state_bytes(10, "mixed") == 10 * (2 + 2 + 12)
    assert state_bytes(10, "fp32", weight_versions=3) == 10 * (3 * 4 + 4 + 8)


@pytest.mark.parametrize("name, d, n, expect", [
    ("gpipe", 4, 6, [6, 6, 6, 6]),
    ("1f1b", 4, 8, [4, 3, 2, 1]),
    ("pipedream", 4, 8, [4, 3, 2, 1]),
])
def test_held_activations_peaks(name, d, n, expect):
    held = HeldActivations.of(build(name, d, n))
    assert [held.peak(r, [1.0] * d) for r in range(d)] == expect


def test_chimera_memory_by_hand():
    """Two replicas per rank (stages r and D-1-r): their state plus peak activations."""
    pl = small_planner()
    c = next(c for c in pl.candidates() if c.scheme == "chimera" and c.depth == 4
             and c.micro_batch == 4 and dict(c.options) == {"pipes": 2, "strategy": "direct"}
             and not c.recompute)
    shape = pl.shape(c)
    sc = pl.stage_costs(c, shape)
    counts = layer_param_counts(pl.work.model)
    params = [sum(counts[i] for i in r) for r in sc.ranges]
    state = [state_bytes(params[r] + params[3 - r], "mixed") for r in range(4)]
    act = [shape.held.peak(r, list(sc.act_full)) for r in range(4)]
    assert pl.memory(c, shape, sc) == max(s + a for s, a in zip(state, act))
    assert act[0] >= 3 * min(sc.act_full)  # D/2 + 1 micro-batches at least on an outer rank


def test_recompute_keeps_inputs_and_one_stage():
    pl = small_planner()
    full = pl.pricing.stage_costs(4, 2, False)
    rc = pl.pricing.stage_costs(4, 2, True)
    hidden = 2 * pl.work.model.seq_len * pl.work.model.d_model * 2  # B*s*h 16-bit
    assert rc.act_kept[1:] == (hidden,) * 3 and rc.act_kept[0] == 2 * pl.work.model.seq_len * 8
    assert rc.act_full == full.act_full  # what the backward rebuilds, one micro-batch at a time
    assert rc.times.b == tuple(b + f for b, f in zip(full.times.b, full.times.f))  # backward redoes the forward


def test_pipedream_stashes_weight_versions():
    pl = small_planner(names=["pipedream", "pipedream-2bw"])
    for name, versions in (("pipedream", [4, 3, 2, 1]), ("pipedream-2bw", [2, 2, 2, 2])):
        c = next(c for c in pl.candidates() if c.scheme == name and c.depth == 4 and not c.recompute)
        shape = pl.shape(c)
        assert shape.schedule.micro_batches >= 4  # a steady-state window, whatever N is
        sc = pl.stage_costs(c, shape)
        expect = max(state_bytes(sc.params[r], "mixed", versions[r]) + shape.held.peak(r, sc.act_kept)
                     for r in range(4))
        assert pl.memory(c, shape, sc) == expect


# -- timing: the simulator paths the planner uses ---------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "chimera", "gems", "interleaved"])
def test_eager_sync_on_unlowered_equals_lowered(name):
    s = build(name, 4, 8)
    cost = CostModel(f=(1.0, 1.5, 1.0, 2.0) * (2 if name == "interleaved" else 1),
                     b=(2.0, 3.0, 2.5, 4.0) * (2 if name == "interleaved" else 1),
                     p2p_time=0.3, allreduce_time=1.7, data_parallel=2)
    lowered = simulate(lower(s), cost)
    fast = compile_schedule(s).times(cost, eager_sync=True)
    assert fast.makespan == pytest.approx(lowered.makespan)
    assert sorted(fast.collectives) == sorted(lowered.collectives)


@pytest.mark.parametrize("d, hop", [(4, 0.0), (4, 0.3), (6, 1.5)])
def test_steady_period_matches_simulated_1f1b(d, hop):
    cost = CostModel.unit(1, 2, p2p_time=hop)
    k, n = 6 * d, 3 * d
    short = simulate(lower(build("1f1b", d, k)), cost).makespan
    long = simulate(lower(build("1f1b", d, k + n)), cost).makespan
    assert (long - short) / n == pytest.approx(steady_period([3.0] * d, hop))


def test_async_schemes_are_simulation_only():
    assert not get_scheme("pipedream").runnable and not get_scheme("pipedream-2bw").runnable
    assert "pipedream" not in {s.name for s in schemes(runnable=True)}
    assert build("pipedream", 4, 4).params["asynchronous"]


# -- the search --------------------------------------------------------------------------

def _brute_force(pl):
    evals = [e for e in map(pl.evaluate, pl.candidates()) if e is not None]
    best = {}
    for e in evals:
        if e.candidate.scheme not in best or e.iteration_s < best[e.candidate.scheme]:
            best[e.candidate.scheme] = e.iteration_s
    return evals, best


def test_bounds_are_lower_bounds_and_search_is_exact():
    pl = small_planner(gpus=8, batch=16, names=["gpipe", "1f1b", "zb-h1", "chimera", "gems",
                                                "pipedream-2bw"])
    evals, best = _brute_force(pl)
    for e in evals:
        floor, mem = pl.lower_bounds(e.candidate)
        assert floor <= e.iteration_s * (1 + 1e-9), e.candidate
        assert mem <= e.memory_bytes * (1 + 1e-9), e.candidate
    result = pl.run(top_k=5)
    assert {k: e.iteration_s for k, e in result.best.items()} == pytest.approx(best)
    runnable = sorted(e.iteration_s for e in evals if get_scheme(e.candidate.scheme).runnable)
    assert [e.iteration_s for e in result.top] == pytest.approx(runnable[:5])


def test_every_returned_configuration_is_valid_fits_and_resimulates():
    pl = small_planner(gpus=8, batch=32, memory=6.0)
    result = pl.run(top_k=8)
    assert [e.iteration_s for e in result.top] == sorted(e.iteration_s for e in result.top)
    for e in result.top + list(result.best.values()):
        c = e.candidate
        assert c.width * c.depth == 8 and c.width * c.micro_batch * c.micro_batches == 32
        assert e.memory_bytes <= 6.0 * 2**30
        if c.scheme == "chimera":
            assert c.depth % 2 == 0
        if e.asynchronous:
            continue
        s = build(c.scheme, c.depth, c.micro_batches, **dict(c.options))
        sc = pl.stage_costs(c, pl.shape(c))
        cost = pl.pricing.cost_model(sc, c.depth, c.width, s.micro_scale)
        assert simulate(lower(s), cost).makespan == pytest.approx(e.iteration_s)


def test_backward_halving_needs_an_even_micro_batch():
    pl = small_planner(names=["chimera"])
    for c in pl.candidates():
        if dict(c.options).get("strategy") == "halving" and c.micro_batch % 2:
            assert pl.lower_bounds(c) is None and pl.evaluate(c) is None


def test_why_faster_reads_a_split_micro_batch_off_the_schedule():
    """The cause is the schedule's micro_scale (backward halving's 0.5), not an option's name."""
    c = Candidate("chimera", (), 4, 2, 4, 8, False)
    win = Evaluation(c, 1.0, 32.0, 0.1, 1.0, 0.0, 0.9)
    other = dataclasses.replace(win, candidate=dataclasses.replace(c, scheme="gems"),
                                iteration_s=2.0, compute_s=1.9, micro_scale=0.5)
    assert "parts of 2 sequences" in why_faster(win, other)
    assert "parts of" not in why_faster(win, dataclasses.replace(other, micro_scale=1.0))


@pytest.mark.parametrize("error, shown", [(PlanError("nothing fits"), False),
                                           (ValueError("a bug, not bad input"), True)])
def test_a_sweep_skips_what_does_not_fit_and_lets_a_bug_through(monkeypatch, error, shown):
    pl = small_planner(names=["1f1b"])

    def run(**kwargs):
        raise error

    monkeypatch.setattr(pl, "run", run)
    c = Candidate("1f1b", (), 4, 2, 4, 8, False)
    if shown:
        with pytest.raises(ValueError, match="a bug"):
            _sweep(pl, c, "D", lambda x: x.depth, lambda x: True)
    else:
        assert _sweep(pl, c, "D", lambda x: x.depth, lambda x: True) == []


def test_plan_prefers_the_lower_simulated_time():
    result = small_planner(gpus=8, batch=32, names=["1f1b", "chimera"]).run(top_k=3)
    win = result.top[0]
    assert win.iteration_s <= min(e.iteration_s for e in result.best.values())
    assert win.candidate.scheme == min(result.best.values(), key=lambda e: e.iteration_s).candidate.scheme


def test_profile_drives_the_costs():
    cfg = get_config("gpt2-tiny")
    layers = [{"forward_s": 0.001 * (i + 1), "backward_s": 0.002 * (i + 1), "activation_bytes": 1000,
               "output_bytes": 100} for i in range(cfg.n_layers_total)]
    profile = parse_profile({"schema": "chimera.profile/1", "micro_batch": 2, "layers": layers,
                             "p2p": {"alpha_s": 1e-5, "beta_bytes_per_s": 1e9},
                             "allreduce": {"alpha_s": 1e-5, "beta_bytes_per_s": 1e9}})
    work = Workload(cfg, 2, 8, get_hardware("cpu"), profile=profile)
    pl = Planner(work, ["1f1b"])
    sc = pl.pricing.stage_costs(1, 4, False)  # B=4: twice the measured B=2
    assert sc.times.f[0] == pytest.approx(2 * sum(x["forward_s"] for x in layers))
    assert pl.run(top_k=1).top


# -- the command line ----------------------------------------------------------------------

def run_cli(*argv):
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_cli_paper_bert_prints_a_table():
    code, out = run_cli("plan", "--model", "bert-48", "--gpus", "32", "--global-batch", "512",
                        "--hardware", "p100", "--top", "3", "--schemes", ",".join(SMALL))
    assert code == 0
    assert "mini-batch 512 on 32 x p100" in out and "best per scheme" in out
    for name in ("chimera", "gpipe", "1f1b", "gems", "pipedream-2bw*", "pipedream*"):
        assert name in out


def test_cli_paper_gpt2_json_smaller_p():
    code, out = run_cli("plan", "--model", "gpt2-paper", "--gpus", "64", "--global-batch", "64",
                        "--hardware", "p100", "--json", "--schemes", "1f1b,chimera,pipedream-2bw")
    data = json.loads(out)
    assert code == 0 and data["top"] and set(data["best_per_scheme"]) == {"1f1b", "chimera", "pipedream-2bw"}
    top = data["top"][0]
    assert top["W"] * top["D"] == 64 and top["memory_gib"] <= data["capacity_gib"]


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "7"], "no even divisor"),
    (["--memory", "0.01"], "no configuration fits"),
    (["--hardware", "tpu"], "unknown hardware"),
    (["--model", "gpt5"], "unknown model"),
    (["--gpus", "0"], "positive integer"),
    (["--global-batch", "-3"], "positive integer"),
    (["--memory", "-1"], "number > 0"),
    (["--gpus", "64", "--global-batch", "9"], "not divisible"),
    (["--profile", "/nonexistent.json"], "cannot read profile"),
    (["--schemes", "nope"], "unknown schedule"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    base = {"--model": "gpt2-small", "--gpus": "8", "--global-batch": "32", "--hardware": "a100"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    args = ["plan"] + [x for kv in base.items() for x in kv]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_profile_and_plan_errors_are_value_errors_not_schedule_errors():
    with pytest.raises(ProfileError, match="schema"):
        parse_profile({"micro_batch": 1})
    with pytest.raises(PlanError, match="layers"):
        Workload(get_config("gpt2-tiny"), 2, 2, get_hardware("cpu"), profile=parse_profile(
            {"schema": "chimera.profile/1", "micro_batch": 1,
             "layers": [{"forward_s": 1, "backward_s": 1, "activation_bytes": 0, "output_bytes": 0}],
             "p2p": {"alpha_s": 0, "beta_bytes_per_s": 1}, "allreduce": {"alpha_s": 0, "beta_bytes_per_s": 1}}))
    for error in (PlanError, ProfileError):
        assert issubclass(error, ValueError) and not issubclass(error, ScheduleError)


def _plan_vs_bench():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "plan_vs_bench.py")
    spec = importlib.util.spec_from_file_location("plan_vs_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ranking_comparison_of_plan_against_measurement():
    pvb = _plan_vs_bench()
    assert pvb.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert pvb.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    cmp = pvb.compare({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 1.0, "b": 1.01, "c": 0.5})
    # a-b are within the noise; a-c and b-c are separated and both ordered the other way
    assert cmp["separated_pairs"] == 2 and cmp["agreeing_pairs"] == 0
    assert cmp["measured_rank"] == {"c": 1, "a": 2, "b": 3}
    assert cmp["predicted_rank"]["a"] == 1
    # a scheme the planner cannot price, or a run that gave no figure, is left out
    cmp = pvb.compare({"a": 1.0, "b": float("nan"), "c": 3.0}, {"a": 1.0, "b": 2.0, "c": None})
    assert cmp["names"] == ["a"] and cmp["separated_pairs"] == 0
    assert math.isnan(pvb.kendall_tau([1, 1], [2, 2]))


def test_plan_prices_the_bench_layouts_from_a_profile():
    pvb = _plan_vs_bench()
    profile = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "profile-gpt2-bench.json")
    rows = [("chimera", {}), ("chimera", {"strategy": "doubling"}), ("1f1b", {}), ("interleaved", {})]
    for width in (1, 2):
        times = pvb.predict(profile, width, rows)
        assert set(times) == {"chimera", "chimera (doubling)", "1f1b", "interleaved"}
        assert all(0 < t < 10 for t in times.values())
        assert times["chimera"] < times["1f1b"]  # fewer bubbles on the same costs


def test_sharded_optimizer_saves_memory_costs_an_all_gather_and_keeps_bounds():
    """--shard-optimizer both: a sharded candidate holds less AdamW state where its stages have
    replicas (Chimera: 2W, the optimizer's 8 bytes a parameter split over them), pays the
    parameters' all-gather, and the bounds stay lower bounds (the search stays exact)."""
    work = Workload(get_config("gpt2-small"), 8, 16, get_hardware("a100"), name="gpt2-small")
    pl = Planner(work, ["1f1b", "chimera", "pipedream-2bw"], shard=(False, True))
    evals, best = _brute_force(pl)
    by = {e.candidate: e for e in evals}
    assert not any(c.shard for c in by if not get_scheme(c.scheme).runnable)
    sharded = [c for c in by if c.shard]
    assert sharded
    for c in sharded:
        plain = by[dataclasses.replace(c, shard=False)]
        e = by[c]
        if c.scheme == "chimera" or c.width > 1:  # time: test_sharding_trades_optimizer_...
            assert e.memory_bytes < plain.memory_bytes and e.iteration_s != plain.iteration_s
        else:  # one replica per stage and W=1: nothing to shard over
            assert e.memory_bytes == plain.memory_bytes and e.iteration_s == plain.iteration_s
        floor, mem = pl.lower_bounds(c)
        assert floor <= e.iteration_s * (1 + 1e-9) and mem <= e.memory_bytes * (1 + 1e-9)
    result = pl.run(top_k=5)
    assert {k: e.iteration_s for k, e in result.best.items()} == pytest.approx(best)


@pytest.mark.parametrize("bandwidth", [0.0, 1e9, 3e12])
def test_sharding_trades_optimizer_work_for_an_all_gather(bandwidth):
    """The time model prices each rank's optimizer step (one per replica it holds, memory-bound)
    and the collectives of a sharded replica (chimera.collectives: a reduce-scatter, then the
    all-gather its rank waits for, each half of the allreduce it replaces): sharded Chimera
    gains nothing when the step is free, is faster when it is slow, and the difference is
    those terms."""
    hw = dataclasses.replace(get_hardware("a100"), memory_bandwidth=bandwidth)
    work = Workload(get_config("gpt2-small"), 4, 16, hw, name="gpt2-small")
    pl = Planner(work, ["chimera"], shard=(False, True))
    c = Candidate("chimera", (("pipes", 2), ("strategy", "direct")), 4, 1, 1, 16, False)
    plain, sharded = pl.evaluate(c), pl.evaluate(dataclasses.replace(c, shard=True))
    shape = pl.shape(c)
    sc = pl.stage_costs(c, shape)
    cost = pl.pricing.cost_model(sc, 4, 1, 1.0, shard=True)
    unsharded = pl.pricing.cost_model(sc, 4, 1, 1.0, shard=False)
    steps = [sum(hw.optimizer_time(sc.params[s]) for _, s in held) for held in shape.replicas]
    gathers = [cost.gather(s, 4, 2) for s in range(4)]
    saved = [unsharded.sync(s, 4, 2) - cost.sync(s, 4, 2) for s in range(4)]
    assert saved == pytest.approx(gathers)  # the two halves of one allreduce
    diff = sharded.iteration_s - plain.iteration_s
    if bandwidth == 0.0:
        assert max(steps) == 0 and diff == pytest.approx(0.0, abs=max(gathers))
    if bandwidth == 1e9:
        assert min(steps) / 2 > max(gathers) and sharded.iteration_s < plain.iteration_s
    low = min(gathers) - max(saved) - max(steps) / 2 - 1e-12
    assert low <= diff <= max(gathers) - min(saved) - min(steps) / 2 + 1e-12


def test_the_explanation_parts_add_up_with_the_optimizer_priced():
    """compute (the optimizer step included), waits and unhidden sync sum to the iteration."""
    work = Workload(get_config("gpt2-small"), 4, 16, dataclasses.replace(get_hardware("a100"),
                    memory_bandwidth=1e10), name="gpt2-small")
    pl = Planner(work, ["chimera", "1f1b"], shard=(False, True))
    for c in [Candidate("chimera", (("pipes", 2), ("strategy", "direct")), 4, 1, 1, 16, False),
              Candidate("1f1b", (), 4, 1, 1, 16, False)]:
        for e in (pl.evaluate(c), pl.evaluate(dataclasses.replace(c, shard=True))):
            compute, waits, sync = parts(e)
            assert min(compute, waits, sync) >= 0
            assert compute + waits + sync == pytest.approx(e.iteration_s)


def test_plan_vs_bench_leaves_out_the_sharded_optimizer_rows(tmp_path):
    """A bench run holds sharded-optimizer rows (the bench's option, no schedule's): the
    planner comparison takes the plain rows only, each under its own label."""
    pvb = _plan_vs_bench()
    rows = [{"impl": "chimera", "schedule": "chimera", "options": {}, "median_step_s": 1.0},
            {"impl": "chimera", "schedule": "chimera", "options": {"shard": 1}, "median_step_s": 0.9},
            {"impl": "chimera", "schedule": "chimera", "options": {"strategy": "doubling"},
             "median_step_s": 1.1},
            {"impl": "torch", "schedule": "1f1b", "options": {}, "median_step_s": 1.2}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"results": rows}))
    pairs, times = pvb.measure_w1(1, str(path))
    assert pairs == [("chimera", {}), ("chimera", {"strategy": "doubling"})]
    assert times == {"chimera": 1.0, "chimera (doubling)": 1.1}


def test_references_are_ranked_beside_ours_and_the_verdict_says_when_chimera_is_not_the_pick():
    """Issue 36: schedules the user could run instead (torch's, built by a factory the caller
    gives: the planner imports no torch) join the ranking; the verdict names the pick."""
    from chimera.plan.report import table, to_json, verdict

    work = Workload(get_config("gpt2-small"), 8, 32, get_hardware("a100"), name="gpt2-small")
    made = []

    def zbv(depth, n):
        made.append((depth, n))
        return build("zb-v", depth, n)
    result = Planner(work, ["chimera"], (False,), references={"torch:zbv": zbv}).run(5)
    assert made and set(result.best) == {"chimera", "torch:zbv"}
    ours, ref = result.best["chimera"], result.best["torch:zbv"]
    text = verdict(result)
    if ours.iteration_s <= ref.iteration_s:
        assert text.startswith("Chimera's placement is the pick") and "torch:zbv" in text
    else:
        assert "NOT the pick" in text and "you can run instead" in text
    assert "torch:zbv" in table(result) and to_json(result)["verdict"] == text
    alone = Planner(work, ["1f1b"], (False,), references={"torch:zbv": zbv}).run(3)
    assert "no scheme on Chimera's placement" in verdict(alone)


def test_cli_plan_ranks_the_torch_schedules_named_and_refuses_unknown_ones():
    code, out = run_cli("plan", "--model", "gpt2-small", "--gpus", "4", "--global-batch", "16",
                        "--hardware", "a100", "--schemes", "chimera,torch:zbv", "--recompute", "off",
                        "--json")
    data = json.loads(out)
    assert code == 0 and set(data["best_per_scheme"]) == {"chimera", "torch:zbv"}
    assert "pick" in data["verdict"]
    with pytest.raises(SystemExit):
        main(["plan", "--model", "gpt2-small", "--gpus", "4", "--global-batch", "16",
              "--hardware", "a100", "--schemes", "chimera,torch:nope"])
