"""Watching a run (issue 25): --tensorboard event files read back with tensorboard's own
EventAccumulator, model FLOPs utilization against a stated peak, perplexity in the summary."""

import math

import pytest

from chimera.ir import Action, Op
from chimera.runtime.executor import ActionRecord
from chimera.train import ConfigError, TrainConfig, build
from chimera.train.launch import launch
from chimera.train.report import summary
from chimera.train.watch import mfu, model_flops_per_token, stage_seconds

PEAK = 2e9  # a stated peak, so that the utilization is a number of this test's own


@pytest.fixture(scope="module")
def watched(tmp_path_factory, data):
    logdir = tmp_path_factory.mktemp("tb")
    cfg = TrainConfig(data=data, steps=3, eval_every=2, eval_batches=1, progress=False,
                      micro_batch_size=2, tensorboard=str(logdir), peak_flops=PEAK)
    result = launch(cfg)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}
    return cfg, result, scalars


@pytest.mark.slow
def test_the_event_file_holds_every_scalar(watched):
    _, _, scalars = watched
    expected = {"train/loss", "train/perplexity", "train/lr", "train/grad_norm", "train/step_s",
                "train/tokens", "train/tokens_per_s", "train/mfu", "train/skipped", "eval/loss",
                "eval/perplexity", "eval/seconds",
                "stage0/compute_s", "stage0/comm_s", "stage1/compute_s", "stage1/comm_s",
                "rank0/comm_s", "rank1/comm_s", "rank0/peak_rss_mb", "rank1/peak_rss_mb"}
    assert expected <= set(scalars), expected - set(scalars)
    for tag in expected - {"eval/loss", "eval/perplexity", "eval/seconds"}:
        assert [s for s, _ in scalars[tag]] == [1, 2, 3], tag  # x: optimizer steps done
    assert [s for s, _ in scalars["eval/loss"]] == [2, 3]


@pytest.mark.slow
def test_the_scalars_are_the_runs_values(watched):
    cfg, result, scalars = watched
    steps = result["steps"]
    value = lambda tag: [v for _, v in scalars[tag]]  # noqa: E731
    assert value("train/loss") == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    assert value("train/lr") == pytest.approx([s["lr"] for s in steps], rel=1e-6)
    assert value("train/perplexity") == pytest.approx([math.exp(s["loss"]) for s in steps], rel=1e-5)
    assert value("eval/loss") == pytest.approx([s["val_loss"] for s in steps[1:]], rel=1e-6)
    assert value("train/tokens") == [s["tokens"] for s in steps]
    assert value("eval/seconds") == pytest.approx([s["eval_seconds"] for s in steps[1:]], rel=1e-5)
    assert value("eval/perplexity") == pytest.approx([math.exp(s["val_loss"]) for s in steps[1:]],
                                                     rel=1e-5)
    flops = model_flops_per_token(build.model_source(cfg))
    want = [s["tokens"] * flops / (s["seconds"] * 2 * PEAK) for s in steps]
    assert value("train/mfu") == pytest.approx(want, rel=1e-5)
    assert value("train/tokens_per_s") == pytest.approx([s["tokens"] / s["seconds"] for s in steps],
                                                        rel=1e-5)
    # every stage computed in every step (the ranks' clocks differ: no bound by rank 0's step)
    for tag in ("stage0/compute_s", "stage1/compute_s"):
        assert all(v > 0 for v in value(tag)), tag
    for tag in ("stage0/comm_s", "stage1/comm_s", "rank0/comm_s", "rank1/comm_s"):
        assert all(v >= 0 for v in value(tag)), tag
    rss = [r["peak_rss_mb"] for r in result["ranks"]]
    assert [value(f"rank{r}/peak_rss_mb")[-1] for r in (0, 1)] == pytest.approx(rss, rel=0.05)


def test_stage_seconds_sort_compute_and_communication():
    def rec(text, start, end):
        return ActionRecord(Action.parse(text), start, end, 0.0)
    records = [rec("p0s0F0", 0, 1), rec("p0s0SEND_F0", 1, 1.5), rec("p1s1F1", 1.5, 3.5),
               rec("p1s1B1", 3.5, 4), rec("p1s1RECV_B1", 4, 4.25), rec("p0s0SYNC", 4.25, 4.5),
               rec("STEP", 4.5, 5.5)]
    assert records[-1].action.op is Op.STEP
    assert stage_seconds(records, 2) == [1.0, 2.5, 0.75, 0.25, 1.0]


def test_mfu_counts_three_forwards_per_token(data):
    from chimera.modelcfg import flops_per_token

    source = build.model_source(TrainConfig(data=data))
    assert model_flops_per_token(source) == 3 * sum(flops_per_token(source.config))
    assert mfu(tokens=1000, seconds=2.0, flops_per_token=6e6, ranks=2, peak=1e9) == 1.5


@pytest.mark.slow
def test_the_summary_shows_perplexity_and_utilization(watched):
    cfg, result, _ = watched
    text = summary(result, cfg.build_schedule())
    held = [s["val_loss"] for s in result["steps"] if s.get("val_loss") is not None]
    assert f"perplexity {math.exp(held[0]):.2f} -> {math.exp(held[-1]):.2f}" in text
    assert "model FLOPs utilization" in text and "2e+09 FLOP/s per rank x 2" in text


def test_tensorboard_without_the_package_is_refused(data, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="--tensorboard needs the tensorboard package"):
        TrainConfig(data=data, tensorboard=str(tmp_path)).preflight()


def test_perplexity_of_a_diverged_loss_is_inf_not_an_overflow():
    from chimera.train.report import perplexity

    assert perplexity(0.0) == 1.0 and perplexity(math.log(50.0)) == pytest.approx(50.0)
    assert perplexity(1e4) == math.inf and math.isnan(perplexity(math.nan))
