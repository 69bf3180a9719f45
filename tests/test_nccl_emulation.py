"""Training under the NCCL emulation (CHIMERA_EMULATE_NCCL) equals plain gloo; bad orders hang.

One spawned process group per world size (2, 4 and 8 ranks) runs every configuration of
that size with the device path's plan (CHIMERA_DEVICE_PLAN: buckets, reduce-scatters): each
schedule is built once, then trained two steps on plain gloo and under the emulation in
every stream mode (per pair, per rank, and strict: p2p and collectives on one stream; the
Mailbox's transport swapped between runs, the weights restored), and every rank compares
its losses and gradients with the plain run. The world
of two also runs the old receive order (each receive posted right before its wait), which
gloo completes and the emulation must stop with a CommTimeout, a pair of ranks whose k-th
messages disagree, and allreduces on two groups issued in opposite orders. Last, ``chimera
train`` under CHIMERA_EMULATE_NCCL=pair, and =strict with the device plan, gives the losses
of the plain run.
"""

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from chimera.check.comm_plan import Message, Post
from chimera.ir import Action, Op
from chimera.passes import lower
from chimera.runtime.executor import MicroData
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.context import ExecOptions, RunContext, RuntimeOptions
from chimera.runtime.nccl_emulation import ENV, MODES, NcclEmulation, p2p_transport
from chimera.runtime.p2p import CommTimeout, wait_work
from chimera.runtime.nccl_emulation import DEVICE_PLAN_ENV
from chimera.runtime.pipeline import PipelineRuntime
from chimera.runtime.transport import TorchDist, Transport
from chimera.schedules import build
from chimera.check.validate import validate
from ranks import run_ranks
from limits import limit

WIDTH, B, STEPS, TIMEOUT_S = 4, 2, 2, limit(60.0)
D2 = [("chimera", {}, 4), ("chimera", {"strategy": "doubling"}, 4),
      ("chimera", {"strategy": "halving"}, 2), ("1f1b", {}, 4), ("interleaved", {"chunks": 2}, 4),
      ("zb-h1", {}, 4), ("zb-v", {}, 4), ("dualpipev", {}, 4), ("dualpipe", {}, 4),
      ("chimera-zb", {}, 4), ("chimera", {"shard": True}, 4)]
D4 = [("chimera", {}, 4), ("chimera", {"strategy": "doubling"}, 8),
      ("chimera", {"strategy": "halving"}, 4), ("chimera", {"pipes": 4}, 8), ("1f1b", {}, 4),
      ("interleaved", {"chunks": 2}, 4), ("zb-h1", {}, 4), ("zb-v", {}, 8),
      ("dualpipev", {}, 8), ("dualpipe", {}, 8), ("chimera-zb", {}, 8),
      ("1f1b", {"shard": True}, 4)]
WORLDS = {2: [(2, 1, D2)], 4: [(4, 1, D4), (2, 2, D2)], 8: [(4, 2, D4)]}


def _stage(stage: int) -> nn.Module:
    torch.manual_seed(100 + stage)  # every replica of a stage starts from the same weights
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double()


def _runtime(name, opts, stages, n, dp, timeout_s=TIMEOUT_S) -> PipelineRuntime:
    """``opts`` go to the generator, except ``shard``: a sharded optimizer (reduce-scatters
    at the Launches, all-gathers after the step, all through the emulation's stream)."""
    opts = dict(opts)
    shard = opts.pop("shard", False)
    schedule = validate(lower(build(name, stages, n, **opts)))
    grid = ProcessGrid(schedule.placement, dp, dist.get_rank())
    rows = int(B * schedule.micro_scale)
    # the options as a run takes them: its CHIMERA_* variables (set by the worker)
    context = RunContext(TorchDist(), options=RuntimeOptions.from_env(comm_timeout=timeout_s))
    return PipelineRuntime(schedule, grid, _stage, nn.functional.mse_loss, context,
                           ExecOptions(shard_optimizer=shard), rows,
                           example=torch.zeros(rows, WIDTH, dtype=torch.float64))


def _data(rt: PipelineRuntime, step: int) -> MicroData:
    """This rank's share of a mini-batch that is the same on every rank (as api.Pipeline)."""
    s, grid, rows = rt.schedule, rt.grid, rt.rows
    total = rows * s.micro_batches * grid.data_parallel
    g = torch.Generator().manual_seed(step)
    x = torch.randn(total, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(total, WIDTH, generator=g, dtype=torch.float64)
    data = MicroData(weights={m: rows / total for m in range(s.micro_batches)})
    held, lo = set(grid.held()), grid.w * s.micro_batches * rows
    for m, pipe in enumerate(s.micro_pipe):
        sl = slice(lo + m * rows, lo + (m + 1) * rows)
        if (pipe, 0) in held:
            data.inputs[m] = x[sl]
        if (pipe, s.stages - 1) in held:
            data.targets[m] = y[sl]
    return data


def _use(rt: PipelineRuntime, transport: Transport) -> None:
    """Route the runtime's p2p and stage allreduces through ``transport`` (instead of one per
    run via the env var: a runtime per mode would triple the start-up collectives)."""
    rt.executor.mailbox.transport = rt.sync.transport = transport


def _train(rt: PipelineRuntime, transport: Transport) -> tuple[list[float], list[torch.Tensor]]:
    """STEPS SGD steps through ``transport``: global losses and the last step's gradients."""
    _use(rt, transport)
    opt = torch.optim.SGD([t for t, _ in rt.optimizer_parameters()], lr=0.1)
    losses = []
    for step in range(STEPS):
        rt.zero_grad()
        loss = rt.run(_data(rt, step)).detach().to(torch.float64).reshape(1)
        dist.all_reduce(loss)
        losses.append(float(loss))
        if rt.shards:  # the reduce-scatter left each replica its slice: gather the rest
            rt.gather_gradients()
        grads = [g.flat.clone() for g in rt.grads.values()]
        opt.step()
        rt.gather_parameters()  # sharded: prefetched, waited for at the next first forward
    rt.finish_gather()  # before the caller closes the transport
    return losses, grads


def _compare(name, opts, stages, n, dp) -> dict:
    rt = _runtime(name, opts, stages, n, dp)
    start = [p.detach().clone() for p in rt.parameters()]
    base_losses, base_grads = _train(rt, TorchDist())
    out = {"config": f"{name} {opts} D={stages} N={n} W={dp}", "losses": base_losses}
    for mode in MODES:
        with torch.no_grad():
            for p, p0 in zip(rt.parameters(), start):
                p.copy_(p0)
        emulation = NcclEmulation(TorchDist(), mode)
        losses, grads = _train(rt, emulation)
        emulation.close()
        out[mode] = {"losses": losses, "messages": sum(emulation.sent.values()),
                     "collectives": dict(emulation.kinds), "sharded": bool(rt.shards),
                     "grad_err": max((float((a - b).abs().max()) for a, b in zip(grads, base_grads)
                                      if a.numel()), default=0.0)}
    return out


def _late_posts(program, stages: int) -> list:
    """The old order: every receive posted right before its wait (what crossed on NCCL)."""
    out = []
    for step in program:
        if isinstance(step, Post):
            continue
        if isinstance(step, Action) and step.op in (Op.RECV_F, Op.RECV_B):
            out.append(Post(Message.of(step, stages)))
        out.append(step)
    return out


def _late_order(mode: str) -> dict:
    """chimera D=2 N=4 with late posts: gloo completes it, the emulation times out."""
    rt = _runtime("chimera", {}, 2, 4, 1, timeout_s=3.0)
    rt.program = _late_posts(rt.program, rt.schedule.stages)
    plain, _ = _train(rt, TorchDist())
    emulation = NcclEmulation(TorchDist(), mode)
    _use(rt, emulation)
    try:
        rt.run(_data(rt, 0))
        error = None
    except CommTimeout as exc:
        error = {"rank": exc.rank, "action": str(exc.action), "peer": exc.peer, "message": str(exc)}
    emulation.close()
    dist.barrier()  # both ranks gave up; every gloo message was matched, the group is usable
    return {"plain_losses": plain, "error": error}


def _disagreeing_order(mode: str) -> str:
    """Rank 0 sends tags 1 then 2, rank 1 receives 2 then 1: fine on gloo, not on NCCL."""
    emulation, other = NcclEmulation(TorchDist(), mode), 1 - dist.get_rank()
    a, b = torch.ones(3), torch.zeros(3)
    if dist.get_rank() == 0:
        works = [emulation.isend(a, other, 1), emulation.isend(a, other, 2)]
    else:
        works = [emulation.irecv(b, other, 2), emulation.irecv(a, other, 1)]
    timeout = datetime.timedelta(seconds=10)
    try:
        wait_work(works[0], timeout, dist.get_rank(), "first message", other)
        message = "no error"
    except CommTimeout as exc:
        message = str(exc)
    emulation.close()
    dist.barrier()
    return message


def _allreduce_orders(mode: str) -> dict:
    """Two groups over both ranks: one order everywhere completes; opposite orders complete
    on gloo (a thread per group) but not under the emulation (one collective stream)."""
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    rank, out = dist.get_rank(), {}
    for order in ("same", "crossed"):
        seq = [0, 1] if order == "same" or rank == 0 else [1, 0]
        emulation = NcclEmulation(TorchDist(), mode)
        tensors = {g: torch.full((3,), float(rank + 1 + 10 * g)) for g in seq}
        works = {g: emulation.all_reduce(tensors[g], group=groups[g], async_op=True) for g in seq}
        try:
            for g in seq:
                wait_work(works[g], datetime.timedelta(seconds=3), rank, f"allreduce {g}", 1 - rank)
            out[order] = [float(tensors[g][0]) for g in (0, 1)]
        except CommTimeout as exc:
            out[order] = str(exc)
        emulation.close()
        dist.barrier()
    plain = [dist.all_reduce(torch.ones(1), group=groups[g], async_op=True)
             for g in ([0, 1] if rank == 0 else [1, 0])]
    out["plain_crossed"] = all(w.wait() for w in plain)
    return out


def _from_env() -> list[str]:
    """What CHIMERA_EMULATE_NCCL selects (the runtime asks p2p_transport per Mailbox)."""
    seen = []
    for value in ("", "rank", "pair", "bogus"):
        os.environ[ENV] = value
        try:
            t = p2p_transport(TorchDist(), RuntimeOptions.from_env())
            seen.append(getattr(t, "mode", type(t).__name__))
            if isinstance(t, NcclEmulation):
                t.close()
        except ValueError as exc:
            seen.append(str(exc))
    del os.environ[ENV]
    return seen


def _worker(rank, world) -> dict:
    # every runtime takes the device path's plan: buckets (several per stage at 64 bytes) and
    # reduce-scatters, the collectives a GPU run issues
    os.environ[DEVICE_PLAN_ENV] = "64"
    results = [_compare(name, opts, stages, n, dp)
               for stages, dp, rows in WORLDS[world] for name, opts, n in rows]
    report = {"compare": results}
    if world == 2:
        report["late"] = {mode: _late_order(mode) for mode in MODES}
        report["disagree"] = {mode: _disagreeing_order(mode) for mode in MODES}
        report["from_env"] = _from_env()
        report["allreduce"] = _allreduce_orders("pair")
    return report


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_worker, 2, processes=True)  # the emulation over real gloo


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_training_under_emulation_equals_gloo(world, world2):
    reports = world2 if world == 2 else run_ranks(_worker, world, processes=True)
    expected = sum(len(rows) for _, _, rows in WORLDS[world])
    for report in reports:
        assert len(report["compare"]) == expected
        for c in report["compare"]:
            for mode in MODES:
                assert c[mode]["losses"] == pytest.approx(c["losses"], rel=1e-12), (c["config"], mode)
                assert c[mode]["grad_err"] < 1e-12, (c["config"], mode)
                assert c[mode]["messages"] >= STEPS, (c["config"], mode)  # it really went through
                kinds = c[mode]["collectives"]
                if c[mode]["sharded"]:  # reduce-scatters and all-gathers, no allreduce
                    assert kinds.get("reduce-scatter", 0) >= STEPS, (c["config"], mode, kinds)
                    assert kinds.get("all-gather", 0) >= STEPS, (c["config"], mode, kinds)
                    assert "allreduce" not in kinds, (c["config"], mode, kinds)
            assert c["losses"][1] != c["losses"][0], c["config"]  # the step changed the weights


@pytest.mark.slow
def test_crossing_sends_time_out_under_emulation(world2):
    for rank, report in enumerate(world2):
        for mode in MODES:
            late = report["late"][mode]
            assert len(late["plain_losses"]) == STEPS  # gloo buffers and matches by tag
            err = late["error"]
            assert err is not None, (rank, mode)
            assert err["rank"] == rank and err["peer"] == 1 - rank
            assert "RECV" in err["action"] and err["action"] in err["message"]
            assert f"rank {rank}" in err["message"] and "timed out" in err["message"]


@pytest.mark.slow
def test_messages_matched_by_order_not_tag(world2):
    for report in world2:
        for mode in MODES:
            assert "NCCL would match it with tag" in report["disagree"][mode], mode


@pytest.mark.slow
def test_allreduces_in_crossed_orders_hang(world2):
    for rank, report in enumerate(world2):
        got = report["allreduce"]
        assert got["same"] == [3.0, 23.0]  # (1 + 2) and (11 + 12): sums of both ranks
        assert got["plain_crossed"] is True
        assert f"rank {rank}: allreduce" in got["crossed"] and "timed out" in got["crossed"]


@pytest.mark.slow
def test_env_var_selects_the_transport(world2):
    seen = world2[0]["from_env"]
    assert seen[:3] == ["TorchDist", "rank", "pair"]
    assert seen[3].startswith("NCCL emulation 'bogus': choose one of pair, rank, strict") and ENV in seen[3]


def _train_cli(cli_env, tmp_path, env_value, device_plan=""):
    log = tmp_path / f"log-{env_value or 'plain'}-{device_plan}.jsonl"
    env = dict(cli_env)
    env.pop(ENV, None)
    env[DEVICE_PLAN_ENV] = device_plan
    if env_value:
        env[ENV] = env_value
    r = subprocess.run([sys.executable, "-m", "chimera", "train", "--steps", "2", "--no-progress",
                        "--log-json", str(log)], capture_output=True, text=True, timeout=limit(300), env=env)
    assert r.returncode == 0, r.stderr
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_cli_train_under_emulation(tmp_path, cli_env):
    plain = _train_cli(cli_env, tmp_path, None)
    assert _train_cli(cli_env, tmp_path, "pair") == pytest.approx(plain, rel=1e-6)
    # the device path's buckets (4 KiB: several per stage) on one stream per rank
    assert _train_cli(cli_env, tmp_path, "strict", "4096") == pytest.approx(plain, rel=1e-6)
