"""Benchmarks, profiles and trace replay: the mechanics (never wall-clock figures).

- the bench harness runs a few rows of every kind for one step on a tiny model, and every row
  trains the same model on the same data (same first loss);
- a measured profile is valid for the one parser `chimera simulate --profile` and `chimera plan` use;
- replaying a trace reproduces the recorded makespan exactly when the recording is a
  simulation (so every cost is recovered), and loads and compares for a real run.
"""

import json
import math
import os

import pytest

from chimera.sim.replay import replay
from chimera.bench.rows import BenchConfig, all_rows, select_rows
from chimera.cli import main
from chimera.ir import ScheduleError
from chimera.passes import lower
from chimera.schedules import build
from chimera.sim import CostModel, simulate
from chimera.sim.profile import cost_from_profile, load_profile, parse_profile
from chimera.viz import save_trace

ROWS = ("single:none:threads=1", "single:none:threads=1:micro_batches=4", "chimera:chimera",
        "chimera:1f1b", "torch:1f1b", "torch:zbv")


@pytest.fixture(scope="module")
def tiny_bench():
    from chimera.bench.harness import measure
    from chimera.bench.report import assemble

    cfg = BenchConfig(model="gpt2-tiny", micro_batches=4, warmup=0, steps=2, rows=ROWS, memory=False)
    rows = select_rows(cfg)
    raw = measure(cfg, rows)
    return cfg, rows, assemble(cfg, rows, raw, 0.0, ((0, 0, 0), (0, 0, 0)))


def test_rows_cover_the_issue():
    ids = [r.id for r in all_rows(BenchConfig())]
    for want in ("single:none:threads=1", "single:none:threads=2", "chimera:chimera", "chimera:1f1b",
                 "chimera:gpipe", "chimera:interleaved", "torch:gpipe", "torch:1f1b",
                 "torch:interleaved", "torch:dualpipev", "torch:zbv"):
        assert want in ids
    assert [r.id for r in select_rows(BenchConfig(rows=("torch",)))] == [i for i in ids if i.startswith("torch:")]
    with pytest.raises(ScheduleError):
        select_rows(BenchConfig(rows=("nope",)))


@pytest.mark.slow
def test_bench_runs_every_kind_of_row(tiny_bench, tmp_path):
    from chimera.bench.report import markdown, save

    cfg, rows, data = tiny_bench
    assert not data["skipped"]
    assert [(r["impl"], r["schedule"]) for r in data["results"]] == [(r.impl, r.schedule) for r in rows]
    for r in data["results"]:
        for key in ("impl", "schedule", "stages", "median_step_s", "min_step_s", "max_step_s",
                    "peak_rss_mb", "peak_activation_mb"):
            assert key in r
        assert len(r["steps_s"]) == cfg.steps and r["min_step_s"] <= r["median_step_s"] <= r["max_step_s"]
        assert r["peak_activation_mb"] > 0
    losses = [r["first_loss"] for r in data["results"]]
    assert all(math.isclose(x, losses[0], rel_tol=1e-4) for x in losses), losses
    assert set(data["summary"]["met"]) and "| torch | 1f1b |" in markdown(data)
    paths = save(data, str(tmp_path))
    assert json.loads(open(paths[0]).read())["results"]
    assert open(paths[2], "rb").read()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_pipeline_rank_holds_fewer_activations_than_one_process(tiny_bench):
    res = {(r["impl"], r["schedule"]): r for r in tiny_bench[2]["results"]}
    single = res[("single", "none")]["peak_activation_mb"]
    assert res[("chimera", "1f1b")]["peak_activation_mb"] < single


@pytest.mark.slow
def test_profile_prices_a_schedule(tmp_path, capsys):
    from chimera.bench.profiler import build_profile

    data = build_profile("gpt2-tiny", 2, repeat=1, link_repeat=1)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    assert len(data["layers"]) == 8 and all(x["forward_s"] > 0 for x in data["layers"])
    assert main(["simulate", "-s", "chimera", "-D", "2", "-N", "4", "--profile", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    profile = parse_profile(data)  # what the writer writes, the one parser reads
    cost = cost_from_profile(profile, lower(build("chimera", 2, 4)))
    assert out["makespan"] >= 4 * (sum(cost.f) + sum(cost.b)) / 2 > 0
    assert len(profile.layers) == 8 and profile.split
    # the trainer's AdamW measured; a rank's step is priced per replica it holds
    assert profile.optimizer_s_per_byte > 0 and all(x > 0 for x in cost.optimizer)


@pytest.mark.parametrize("name,kw,costs", [
    ("chimera", {}, dict(f=(1.0, 1.2, 0.9, 1.1), b=(2.0, 2.1, 1.9, 2.3))),
    ("1f1b", {}, dict(f=(1.0,), b=(2.0,))),
    ("interleaved", {"chunks": 2}, dict(f=(1.0,), b=(2.0,))),
    ("zb-v", {}, dict(f=(1.0,), b=(2.0,))),
])
def test_replay_of_a_simulated_trace_is_exact(tmp_path, name, kw, costs):
    schedule = lower(build(name, 4, 8, **kw))
    timeline = simulate(schedule, CostModel(**costs, p2p_time=0.25, allreduce_time=1.5))
    path = tmp_path / "sim.json"
    save_trace(timeline, path)
    r = replay(str(path))
    assert r.predicted.makespan == pytest.approx(timeline.makespan, rel=1e-9)
    assert r.cost.p2p_time == pytest.approx(0.25)


def test_simulate_from_trace_cli(tmp_path, capsys):
    timeline = simulate(lower(build("chimera", 4, 4)), CostModel.unit(1, 2, p2p_time=0.1))
    save_trace(timeline, tmp_path / "t.json")
    assert main(["simulate", "--from-trace", str(tmp_path / "t.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_makespan_s"] == pytest.approx(out["measured_makespan_s"])
    old = json.loads((tmp_path / "t.json").read_text())
    del old["otherData"]["lowered_schedule"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit):
        main(["simulate", "--from-trace", str(tmp_path / "old.json")])


@pytest.mark.slow
def test_replay_of_a_recorded_run(tmp_path):
    from chimera.train import TrainConfig
    from chimera.train.launch import launch
    from chimera.train.report import measured_timeline

    cfg = TrainConfig(schedule="chimera", stages=2, micro_batches=4, steps=2, progress=False)
    result = launch(cfg)
    timeline = measured_timeline(cfg.build_schedule(), result)
    assert timeline.meta["aligned"] and timeline.meta["step_s"] > 0
    assert all(e.cpu is not None for e in timeline.events)
    save_trace(timeline, tmp_path / "run.json")
    wall, cpu = (replay(str(tmp_path / "run.json"), clock) for clock in ("wall", "cpu"))
    # what the replay compares with: first start to last end of the step's actions (the
    # timeline's own makespan also counts the time before the first action began)
    span = max(e.end for e in timeline.events) - min(e.start for e in timeline.events)
    assert wall.measured_makespan == pytest.approx(span, rel=1e-3)
    # exact parts only: how close a prediction comes to the wall clock depends on the load
    # of the machine, so no ratio of wall times is asserted (issue 13)
    again = replay(str(tmp_path / "run.json"), "wall")
    assert again.predicted.makespan == wall.predicted.makespan  # a function of the trace
    assert again.cost == wall.cost
    schedule = cfg.build_schedule()
    assert sorted(str(e.action) for e in wall.predicted.events) == \
        sorted(str(a) for prog in schedule.programs for a in prog)  # every action, once
    for costs in (wall.cost.f, wall.cost.b):  # each a median of actions inside the step
        assert all(0 < c <= span for c in costs), costs
    assert wall.predicted_step_s >= wall.predicted.makespan
    # thread CPU time never exceeds wall time, action by action (1 ms: clock granularity)
    for c, w in zip(cpu.cost.f + cpu.cost.b, wall.cost.f + wall.cost.b):
        assert c <= w + 1e-3


def test_replay_with_profile_links_prices_the_allreduce_over_the_trace_width(tmp_path):
    profile = load_profile(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                                        "profile-gpt2-bench.json"))
    timeline = simulate(lower(build("chimera", 2, 4)), CostModel.unit(1, 2))
    replays = {}
    for width in (1, 2):
        timeline.meta["data_parallel"] = width
        save_trace(timeline, tmp_path / f"w{width}.json")
        replays[width] = replay(str(tmp_path / f"w{width}.json"), "wall", profile)
    assert replays[1].cost.data_parallel == 1 and replays[2].cost.data_parallel == 2
    # the same stage replicas, allreduced over twice the ranks: never cheaper
    assert replays[2].predicted.makespan >= replays[1].predicted.makespan
