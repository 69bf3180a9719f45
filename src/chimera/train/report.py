"""Turn a run's result (rank 0's JSON) into figures, a measured timeline and a summary."""

from __future__ import annotations

import math
import statistics

from chimera.ir import Action, Schedule
from chimera.sim import RankStats, Timeline
from chimera.sim.timeline import Event


def measured_timeline(schedule: Schedule, result: dict) -> Timeline | None:
    """The traced step as a Timeline in seconds, from every rank's recorded actions.

    Each rank records times from its own start of the step; where the ranks also sent that
    start on the wall clock (``t0``), their events are shifted onto one time axis. ``meta``
    keeps the measured step time, so a trace of it can be replayed against it.
    """
    ranks = (result.get("ranks") or [])[:schedule.ranks]  # data replica 0 is drawn
    if not ranks or not any(r["records"] for r in ranks):
        return None
    starts = [r.get("t0") for r in ranks]
    base = min(starts) if None not in starts else None
    events, stats = [], []
    for rank, data in enumerate(ranks):
        shift = 0.0 if base is None else starts[rank] - base
        busy = 0.0
        for text, start, end, cpu in data["records"]:
            action = Action.parse(text)
            events.append(Event(rank, action, start + shift, end + shift, cpu))
            if action.op.is_compute:
                busy += end - start
        stats.append(RankStats(rank, busy, 0.0, float(len(schedule.placement.held(rank)))))
    makespan = max(e.end for e in events)
    meta = {"source": "measured", "aligned": base is not None,
            "data_parallel": max(1, len(result["ranks"]) // schedule.ranks)}
    traced = _traced_step(result)
    if traced is not None:
        meta.update(step=traced["step"], step_s=traced["seconds"])
    return Timeline(schedule, events, makespan, stats, unit="s", meta=meta)


def _traced_step(result: dict) -> dict | None:
    cfg, steps = result.get("config", {}), result.get("steps") or []
    want = cfg.get("trace_step")
    want = cfg.get("steps", len(steps)) - 1 if want is None else want
    return next((s for s in steps if s.get("step") == want), None)


def throughput(result: dict, skip: int = 2) -> tuple[float, float]:
    """(median tokens/s, median step seconds) over the steps after ``skip`` warm-up steps."""
    steps = result["steps"][skip:] or result["steps"]
    secs = statistics.median(s["seconds"] for s in steps)
    return steps[0]["tokens"] / secs, secs


def summary(result: dict, schedule: Schedule | None) -> str:
    cfg = result["config"]
    tok_s, step_s = throughput(result)
    losses = [s["loss"] for s in result["steps"]]
    lines = [
        f"trained {cfg['model']} with {cfg['schedule']} on D={cfg['stages']} x W={cfg['data_parallel']} "
        f"process(es) for {len(losses)} steps",
        f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}",
    ]
    held = [(s["step"] + 1, s["val_loss"]) for s in result["steps"] if s.get("val_loss") is not None]
    if held:
        lines.append(f"  held-out loss {held[0][1]:.4f} after {held[0][0]} steps -> {held[-1][1]:.4f} "
                     f"after {held[-1][0]} (perplexity {perplexity(held[0][1]):.2f} -> "
                     f"{perplexity(held[-1][1]):.2f}; {cfg.get('eval_batches')} mini-batches of "
                     "the held-out split)")
    lines += [
        f"  throughput {tok_s:,.0f} tokens/s (median step {step_s * 1000:.1f} ms after warm-up)",
    ]
    if result.get("model_flops_per_token") and result.get("peak_flops"):
        ranks = len(result["ranks"])
        used = tok_s * result["model_flops_per_token"] / (ranks * result["peak_flops"])
        lines.append(f"  model FLOPs utilization {used:.2%} of {result['peak_flops']:.3g} FLOP/s "
                     f"per rank x {ranks} (--peak-flops)")
    if schedule is not None:
        t = measured_timeline(schedule, result)
        if t is not None:
            lines.append(f"  measured bubble ratio {t.bubble_ratio:.1%} of step "
                         f"{cfg['trace_step'] if cfg['trace_step'] is not None else cfg['steps'] - 1} "
                         f"(1 - compute time / (ranks x step time): the optimizer step's tail and "
                         "p2p waits count as bubble)")
    rss = ", ".join(f"{r['peak_rss_mb']:.0f}" for r in result["ranks"])
    lines.append(f"  peak memory per rank (RSS, MB): {rss}")
    optim = [r.get("optimizer_state_bytes") for r in result["ranks"]]
    if all(b is not None for b in optim):
        lines.append("  optimizer state per rank (MB): " + ", ".join(f"{b / 2**20:.2f}" for b in optim)
                     + (" (sharded over each stage's replicas)" if cfg.get("shard_optimizer") else ""))
    cuda = [r.get("peak_cuda_mb") for r in result["ranks"] if r.get("peak_cuda_mb") is not None]
    if cuda:
        lines.append("  peak CUDA memory per rank (MB): " + ", ".join(f"{c:.0f}" for c in cuda))
    return "\n".join(lines)


def perplexity(loss: float) -> float:
    """exp(loss) of a mean cross-entropy in nats: inf past float range (a diverged run), NaN
    for NaN."""
    return math.inf if loss > 700 else math.exp(loss)
