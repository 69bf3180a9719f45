"""Tables, JSON and explanations of a plan (no torch)."""

from __future__ import annotations

from chimera.modelcfg import param_count
from chimera.plan.hardware import PlanError
from chimera.plan.search import Candidate, Evaluation, Planner, PlanResult, _needs_even_depth
from chimera.plan.shapes import is_reference
from chimera.plan.tensor import placement_problem
from chimera.plan.workload import divisors

GIB = 2**30
ASYNC_MARK = "*"


def _config(c: Candidate) -> str:
    return f"W={c.width} D={c.depth}{f' T={c.tensor}' if c.tensor > 1 else ''} " \
        f"B={c.micro_batch} N={c.micro_batches}" + (" rc" if c.recompute else "")


def _searches_tensor(result: PlanResult) -> bool:
    return result.workload.tensor_parallel != (1,)


def header(result: PlanResult) -> str:
    w, s = result.workload, result.stats
    hw = w.hardware
    tp = (f"; tensor parallel T in {{{', '.join(map(str, w.tensor_parallel))}}} inside nodes of "
          f"{hw.devices_per_node}" if _searches_tensor(result) else "")
    return (f"{w.name or w.model.kind}: {param_count(w.model) / 1e9:.2f} B parameters, "
            f"{w.model.n_layer} layers, d {w.model.d_model}, seq {w.model.seq_len}; "
            f"mini-batch {w.global_batch} on {w.gpus} x {hw.name} ({result.capacity / GIB:.1f} GiB "
            f"usable per rank, {hw.precision}){tp}\n"
            f"searched {s.candidates} configurations in {s.seconds:.1f} s: simulated {s.simulated}, "
            f"cut by time bound {s.cut_by_bound}, by memory bound {s.cut_by_memory_bound}, "
            f"out of memory {s.out_of_memory}, not buildable {s.invalid}")


def _row(rank: str, e: Evaluation, extra: str = "", tensor: bool = False) -> str:
    c = e.candidate
    name = c.variant + (ASYNC_MARK if e.asynchronous else "")
    t = f" {c.tensor:>2}" if tensor else ""
    return (f"{rank:>3} {name:<24} {c.width:>4} {c.depth:>3}{t} {c.micro_batch:>3} "
            f"{c.micro_batches:>4} {'yes' if c.recompute else 'no':>4} {e.iteration_s:>8.3f} "
            f"{e.throughput:>8.1f} {e.bubble_ratio:>6.1%} {e.memory_bytes / GIB:>7.2f} "
            f"{e.allreduce_share:>6.1%}{extra}")


def columns(tensor: bool = False) -> str:
    """The table's header line; a T column when the search spans tensor parallelism."""
    t = f" {'T':>2}" if tensor else ""
    return (f"{'#':>3} {'scheme':<24} {'W':>4} {'D':>3}{t} {'B':>3} {'N':>4} {'rc':>4} "
            f"{'iter s':>8} {'seq/s':>8} {'bubble':>6} {'GiB/rk':>7} {'allred':>6}")


COLUMNS = columns()


def table(result: PlanResult) -> str:
    """The top configurations, then the best of every scheme with the winner's speed-up."""
    tp = _searches_tensor(result)
    lines = [header(result), "", columns(tp)]
    lines += [_row(str(i + 1), e, tensor=tp) for i, e in enumerate(result.top)]
    win = result.top[0]
    lines += ["", "best per scheme (speed-up of #1 over it):", columns(tp) + f" {'#1 speed-up':>11}"]
    for e in sorted(result.best.values(), key=lambda e: e.iteration_s):
        lines.append(_row("", e, f" {e.iteration_s / win.iteration_s:>10.2f}x", tp))
    lines += ["", verdict(result)]
    missing = sorted(set(result.schemes) - set(result.best))
    if missing:
        lines.append(f"no configuration fits or builds for: {', '.join(missing)}")
    if any(e.asynchronous for e in list(result.best.values()) + result.top):
        lines.append(f"{ASYNC_MARK} asynchronous (PipeDream, 2BW): simulation only; stale weights, "
                     "not the same training as one device")
    lines.append("iter s: one iteration (mini-batch); bubble: idle share of compute streams; "
                 "allred: share of the iteration after the last compute (unhidden gradient sync)"
                 + ("; T: tensor-parallel ranks per pipeline rank (P = W*D*T), every figure "
                    "per TP rank" if tp else ""))
    return "\n".join(lines)


def verdict(result: PlanResult) -> str:
    """Whether Chimera's placement (two weight copies, bidirectional) is the pick, against the
    best of the rest and torch's schedules (references the user could run instead)."""
    win = result.top[0]
    bidi = [e for e in result.best.values()
            if not is_reference(e.candidate.scheme) and _needs_even_depth(e.candidate.scheme)]
    refs = [e for e in result.best.values() if is_reference(e.candidate.scheme)]
    best_ref = min(refs, key=lambda e: e.iteration_s) if refs else None
    if not bidi:
        return "no scheme on Chimera's placement was searched or fits: it is not the pick here"
    best_bidi = min(bidi, key=lambda e: e.iteration_s)
    if best_bidi is win:
        against = (f"; torch's best, {best_ref.candidate.variant} ({_config(best_ref.candidate)}), "
                   f"takes {best_ref.iteration_s / win.iteration_s:.2f}x as long") if best_ref else ""
        return f"Chimera's placement is the pick: {win.candidate.variant}{against}"
    ratio = best_bidi.iteration_s / win.iteration_s
    who = (f"torch.distributed.pipelining's {win.candidate.variant[len('torch:'):]}, a schedule "
           f"you can run instead," if is_reference(win.candidate.scheme) else win.candidate.variant)
    by = f"{ratio:.2f}x faster than" if ratio >= 1.005 else "as fast as (within 0.5%)"
    return (f"Chimera's placement is NOT the pick here: {who} ({_config(win.candidate)}) is "
            f"{by} the best on it, {best_bidi.candidate.variant} ({_config(best_bidi.candidate)})")


def to_json(result: PlanResult) -> dict:
    w = result.workload

    def ev(e: Evaluation) -> dict:
        c = e.candidate
        return {"scheme": c.scheme, "options": dict(c.options), "variant": c.variant,
                "W": c.width, "D": c.depth, "T": c.tensor, "B": c.micro_batch, "N": c.micro_batches,
                "recompute": c.recompute, "shard_optimizer": c.shard, "iteration_s": e.iteration_s,
                "throughput_seq_per_s": e.throughput, "bubble_ratio": e.bubble_ratio,
                "memory_gib": e.memory_bytes / GIB, "allreduce_share": e.allreduce_share,
                "compute_s": e.compute_s, "asynchronous": e.asynchronous}

    s = result.stats
    return {"model": w.name, "params": param_count(w.model), "gpus": w.gpus,
            "global_batch": w.global_batch, "hardware": w.hardware.name,
            "tensor_parallel": list(w.tensor_parallel), "gpus_per_node": w.hardware.devices_per_node,
            "capacity_gib": result.capacity / GIB, "top": [ev(e) for e in result.top],
            "best_per_scheme": {k: ev(e) for k, e in sorted(result.best.items())},
            "verdict": verdict(result),
            "search": {"candidates": s.candidates, "simulated": s.simulated,
                       "cut_by_bound": s.cut_by_bound, "cut_by_memory_bound": s.cut_by_memory_bound,
                       "out_of_memory": s.out_of_memory, "invalid": s.invalid, "seconds": s.seconds}}


# -- explanations ---------------------------------------------------------------------------

def parts(e: Evaluation) -> tuple[float, float, float]:
    """(compute of the busiest rank, the rest of its time before the last compute ends (bubbles,
    p2p waits), unhidden allreduce): they add up to the iteration."""
    sync = e.allreduce_share * e.iteration_s
    return e.compute_s, max(0.0, e.iteration_s - e.compute_s - sync), sync


def why_faster(win: Evaluation, other: Evaluation) -> str:
    """One line: how much faster ``win`` is than ``other``, and the term that differs most."""
    a, b = parts(win), parts(other)
    names = ("busiest rank computes", "busiest rank waits (bubbles, p2p)", "unhidden allreduce")
    k = max(range(3), key=lambda i: b[i] - a[i])
    c = other.candidate
    if other.iteration_s < win.iteration_s:
        return (f"  {other.iteration_s / win.iteration_s:.2f}x against {c.variant} ({_config(c)}, "
                f"{other.iteration_s:.3f} s), which is faster"
                + (": asynchronous, it never flushes (waits {:.2f} s vs {:.2f} s) and trains with "
                   "stale weights".format(b[1], a[1]) if other.asynchronous else ""))
    reason = f"{names[k]} {a[k]:.2f} s vs {b[k]:.2f} s"
    if k == 0:
        reason += _compute_cause(win, other)
    elif k == 1:
        reason += f" (bubble {win.bubble_ratio:.0%} vs {other.bubble_ratio:.0%})"
    return (f"  {other.iteration_s / win.iteration_s:.2f}x over {c.variant} ({_config(c)}, "
            f"{other.iteration_s:.3f} s): {reason}")


def _compute_cause(win: Evaluation, other: Evaluation) -> str:
    a, b = win.candidate, other.candidate
    causes = []
    if b.recompute and not a.recompute:
        causes.append("it needs recomputation to fit")
    if b.micro_batch < a.micro_batch:
        causes.append(f"its micro-batch B={b.micro_batch} runs less efficiently")
    if other.micro_scale < win.micro_scale:  # e.g. backward halving's half micro-batches
        causes.append(f"its schedule runs each micro-batch in parts of "
                      f"{b.micro_batch * other.micro_scale:g} sequences, less efficiently")
    if b.depth != a.depth:
        causes.append(f"its cut into D={b.depth} stages is less even")
    return f" ({'; '.join(causes)})" if causes else ""


def explain(planner: Planner, result: PlanResult) -> str:
    """Why the winner wins: its time budget, each other scheme's best, and its D, B, recompute."""
    win = result.top[0]
    c = win.candidate
    comp, idle, sync = parts(win)
    mean = (1 - win.bubble_ratio) * win.iteration_s
    uneven = " and an uneven cut" if comp > 1.02 * mean else ""
    lines = [f"why {c.variant} {_config(c)} wins ({win.iteration_s:.3f} s per iteration):",
             f"  its busiest rank computes {comp:.3f} s and waits {idle:.3f} s, then {sync:.3f} s of "
             f"allreduce is not hidden; ranks compute {mean:.3f} s on average (bubble "
             f"{win.bubble_ratio:.0%}: fill and drain{uneven}); {win.memory_bytes / GIB:.2f} of "
             f"{result.capacity / GIB:.2f} GiB on the fullest rank"]
    if win.asynchronous:  # only when nothing synchronous was searched or fits
        sync_best = min((e for e in result.best.values() if not e.asynchronous),
                        key=lambda e: e.iteration_s, default=None)
        lines.append("  it is asynchronous: no flush, so no fill and drain bubbles, and its allreduce "
                     "overlaps the next iteration; the price is stale weights (not synchronous SGD)")
        if sync_best:
            lines.append(f"  the best synchronous configuration is {sync_best.candidate.variant} "
                         f"{_config(sync_best.candidate)} at {sync_best.iteration_s:.3f} s")
    lines.append("against the best of every other scheme:")
    for e in sorted(result.best.values(), key=lambda e: e.iteration_s):
        if e.candidate.scheme != c.scheme:
            lines.append(why_faster(win, e))
    lines += _sweep(planner, c, "D", lambda x: x.depth, lambda x: x.tensor == c.tensor)
    sizes = divisors(c.micro_batch * c.micro_batches)  # B values at this W
    near = set(sizes[max(0, sizes.index(c.micro_batch) - 1):sizes.index(c.micro_batch) + 2])
    same = lambda x: x.depth == c.depth and x.tensor == c.tensor  # noqa: E731
    lines += _sweep(planner, c, "B", lambda x: x.micro_batch,  # the neighbours: smaller B means
                    lambda x: same(x) and x.micro_batch in near)  # many more actions
    lines += _sweep(planner, c, "recompute", lambda x: x.recompute,
                    lambda x: same(x) and x.micro_batch == c.micro_batch)
    if _searches_tensor(result) or c.tensor > 1:
        lines += _tensor_lines(planner, result)
    return "\n".join(lines)


def _tensor_lines(planner: Planner, result: PlanResult) -> list[str]:
    """Why this T: the best plan at T = 1, T/2, T and 2T, each with its compute, the part of
    it that is TP collectives, and its memory; or why it does not fit or was not searched."""
    win, work = result.top[0], planner.work
    t = win.candidate.tensor
    out = [f"why T={t} (tensor parallel; the best of every scheme at each T):"]
    for size in sorted({1, max(1, t // 2), t, 2 * t}):
        if size not in work.tensor_parallel:
            why = placement_problem(work.model, size, work.gpus, work.hardware.devices_per_node)
            out.append(f"  T={size}: not searched ({why or 'not asked for'})")
            continue
        try:
            e = planner.run(top_k=1, only=lambda x: x.tensor == size).top[0]
        except PlanError as exc:  # nothing fits at this T: the error says what the least needs
            out.append(f"  T={size}: {exc}")
            continue
        comp, idle, sync = parts(e)
        mark = "  <- chosen" if size == t else f"  ({e.iteration_s / win.iteration_s:.2f}x)"
        out.append(f"  T={size}: {e.iteration_s:.3f} s ({e.candidate.variant} {_config(e.candidate)}; "
                   f"compute {comp:.2f} s, of it TP collectives {planner.tp_comm(e):.2f} s; wait "
                   f"{idle:.2f}, allreduce {sync:.2f} s; {e.memory_bytes / GIB:.1f} of "
                   f"{result.capacity / GIB:.1f} GiB){mark}")
    return out


def _sweep(planner: Planner, c: Candidate, label: str, key, where) -> list[str]:
    """The winner's scheme, best per value of ``key`` (among candidates ``where`` allows)."""
    try:
        res = planner.run(top_k=1, group=key, only=lambda x: x.scheme == c.scheme and where(x))
    except PlanError:  # nothing of the winner's scheme fits at these values
        return []
    if len(res.best) < 2:
        return []
    at = ([] if label == "D" else [f"D={c.depth}"]) + ([f"T={c.tensor}"] if c.tensor > 1 else [])
    out = [f"{c.scheme} at each {label}" + (f" ({', '.join(at)})" if at else "") + ":"]
    for value, e in sorted(res.best.items()):
        comp, idle, sync = parts(e)
        mark = "  <- chosen" if key(c) == value else ""
        out.append(f"  {label}={value}: {e.iteration_s:.3f} s ({e.candidate.variant} {_config(e.candidate)}; "
                   f"compute {comp:.2f}, wait {idle:.2f}, allreduce {sync:.2f} s, "
                   f"{e.memory_bytes / GIB:.1f} GiB){mark}")
    return out
