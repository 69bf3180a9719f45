"""When a rank dies or a schedule hangs, every rank ends promptly with a picture of where it
was, and torchrun's restart resumes from the last checkpoint to the same parameters."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from chimera.check.comm_plan import plan_comm
from chimera.ir import Op
from chimera.passes import lower
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.p2p import CommTimeout, Mailbox
from chimera.schedules import build
from chimera.train import TrainConfig
from chimera.train.checkpoint import latest, load_model_state
from chimera.runtime import workers
from chimera.runtime.workers import free_port
from chimera.train.launch import launch
from limits import limit, whole

COMMON = ["--dtype", "float64", "--micro-batch-size", "2", "--no-progress"]


def pictures(tmp_path):
    return ["--png", str(tmp_path / "t.png"), "--trace", str(tmp_path / "t.json")]


def start_rank(cli_env, rank, port, args, tmp_path, fault=None):
    """One rank as torchrun would start it (RANK, WORLD_SIZE, MASTER_* set)."""
    env = {**cli_env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if fault:
        env["CHIMERA_FAULT"] = fault
    err = open(tmp_path / f"err{rank}.txt", "w")
    return subprocess.Popen([sys.executable, "-m", "chimera", "train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=err)


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_kill_9_of_one_rank_ends_the_others_promptly(data, tmp_path, cli_env):
    log = tmp_path / "log.jsonl"
    comm = whole(60)  # a bound on a hang: the death must be seen well before it
    args = [*COMMON, "--data", data, "--steps", "300", "--comm-timeout", str(comm),
            "--log-json", str(log), *pictures(tmp_path)]
    port = free_port()
    procs = [start_rank(cli_env, r, port, args, tmp_path) for r in (0, 1)]
    try:
        deadline = time.monotonic() + limit(150)
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert procs[0].poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        rc = procs[0].wait(timeout=comm)  # the comm timeout: it must end well before
        detected = time.monotonic() - killed
    finally:
        stop(procs)
    err = (tmp_path / "err0.txt").read_text()
    print(f"rank 0 exited {detected:.2f}s after kill -9 of rank 1")
    assert rc == 1 and detected < comm / 2, (rc, detected, err)
    assert "Traceback" not in err
    first = err.splitlines()[0]
    assert first.startswith("chimera train: rank 0:") and "peer rank 1" in first, err
    assert "marked:" in err and "P0 |" in err


@pytest.mark.slow
def test_mismatched_schedule_times_out_with_the_grid(data, tmp_path, cli_env):
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "chimera", "train", *COMMON, "--data", data,
                        "--steps", "3", "--comm-timeout", "3", *pictures(tmp_path)],
                       env={**cli_env, "CHIMERA_FAULT": "deadlock:1"}, capture_output=True, text=True,
                       timeout=limit(180))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "Timed out waiting 3000ms" in r.stderr  # the wait that hit --comm-timeout
    lines = [l for l in r.stderr.splitlines() if l.startswith("chimera train: rank ")]
    reports = [l for l in lines if " failed first (" not in l]  # each rank's own line
    assert reports and all("peer rank" in l for l in reports), r.stderr
    assert lines[-1].startswith("chimera train: rank ") and " failed first (" in lines[-1], r.stderr
    assert "marked:" in r.stderr and "where each rank was" in r.stderr
    print(f"deadlock reported after {time.monotonic() - start:.1f}s (start-up included)")


@pytest.mark.slow
def test_torchrun_restart_resumes_to_the_same_parameters(data, tmp_path, cli_env):
    steps = ["--steps", "6", "--checkpoint-every", "2"]
    ref = TrainConfig(dtype="float64", micro_batch_size=2, data=data, steps=6, checkpoint_every=2,
                      checkpoint_dir=str(tmp_path / "ref"), log_json=str(tmp_path / "ref.jsonl"),
                      progress=False)
    launch(ref)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-id", "chimera-test",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "chimera", "train", *COMMON,
           "--data", data, *steps, "--checkpoint-dir", str(tmp_path / "run"), "--resume",
           "--log-json", str(tmp_path / "run.jsonl"), *pictures(tmp_path)]
    r = subprocess.run(cmd, env={**cli_env, "CHIMERA_FAULT": "kill:1:3"}, capture_output=True,
                       text=True, timeout=limit(240))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exitcode: -9" in r.stderr  # the first attempt did die

    def losses(name):
        return [json.loads(l)["loss"] for l in (tmp_path / name).read_text().splitlines()]
    assert losses("run.jsonl") == losses("ref.jsonl")  # bit-identical, step by step
    got = load_model_state(latest(tmp_path / "run"))
    want = load_model_state(latest(tmp_path / "ref"))
    assert latest(tmp_path / "run").name == "step-00000006"
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("where", ["recv", "allreduce", "first"])
def test_the_report_marks_any_position(where):
    """Wherever a rank stops (a receive, the allreduce at STEP, its first action)."""
    from types import SimpleNamespace

    from chimera.passes import lower
    from chimera.runtime.p2p import CommTimeout
    from chimera.runtime.transport import Transport
    from chimera.schedules import build
    from chimera.train.faults import explain

    schedule = lower(build("chimera", 4, 8))
    program = schedule.programs[1]
    action = {"recv": next(a for a in program if a.op.name == "RECV_B"), "allreduce": None,
              "first": program[0]}[where]
    exc = CommTimeout("rank 1: it failed", 1, action, 2, "gradient allreduce of stage 2")
    nobody = Transport()  # no store to post positions to: the picture alone
    text = str(explain(exc, schedule, SimpleNamespace(d=1, w=0, rank=1, world=4), nobody))
    assert text.splitlines()[0] == "rank 1: it failed"
    assert "marked:" in text and ">" in text and "P3 |" in text


@pytest.mark.parametrize("rank,world,want", [(0, 2, "peer rank 1"), (1, 3, "peer ranks 0, 2"),
                                             (5, 64, "its 63 peers (ranks 0-63)"), (0, 1, "no peer")])
def test_a_failed_collective_names_its_peers(rank, world, want):
    from chimera.train import faults

    from chimera.runtime.transport import Transport

    class World(Transport):  # only who is who: the collective itself fails below
        def is_initialized(self):
            return True

        def get_rank(self, group=None):
            return rank

        def get_world_size(self, group=None):
            return world

    def broken():
        raise RuntimeError("Connection reset by peer")
    transport = World()
    assert faults._peers(transport, rank, None) == want
    with pytest.raises(faults.CommTimeout,
                       match=re.escape(f"rank {rank}: the loss with {want} failed")):
        faults.collective(transport, "the loss", broken)


class _ClosedTransport:
    """gloo's isend and irecv when the peer's socket is already closed: they raise at the
    call (seen for irecv in the TP kill drill: the receive's post, not its wait)."""

    matches_by_tag = True  # as gloo's

    def isend(self, tensor, dst, tag):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1234")

    def irecv(self, tensor, src, tag):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")


def test_a_send_refused_at_once_names_the_peer():
    """A dead peer can make ``isend`` itself fail (not its wait): that is the same one-line
    peer error as a failed wait, which the launcher reports without a traceback."""
    plan = plan_comm(lower(build("1f1b", 2, 2)))
    grid = ProcessGrid(plan.schedule.placement, 1, 0)
    box = Mailbox(plan, grid, lambda m: (4,), torch.float32, torch.device("cpu"), None,
                  _ClosedTransport())
    send = next(a for a in plan.schedule.programs[0] if a.op is Op.SEND_F)
    with pytest.raises(CommTimeout, match=r"rank 0: p0s0SEND_F0 with peer rank 1 failed: "
                                          r"\[gloo.*Connection closed by peer") as info:
        box.send(send, torch.zeros(4))
    assert info.value.peer == 1 and info.value.action == send


def test_a_receive_refused_at_its_post_names_the_receive_and_the_peer():
    plan = plan_comm(lower(build("1f1b", 2, 2)))
    grid = ProcessGrid(plan.schedule.placement, 1, 1)
    box = Mailbox(plan, grid, lambda m: (4,), torch.float32, torch.device("cpu"), None,
                  _ClosedTransport())
    with pytest.raises(CommTimeout, match=r"rank 1: p0s1RECV_F0 with peer rank 0 failed: "
                                          r"\[gloo.*Connection closed by peer") as info:
        box.post(box.order[0])
    assert info.value.peer == 0 and str(info.value.action) == "p0s1RECV_F0"


def _gloo(text):
    return f"[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] {text} [127.0.0.1]:20166"


# what a rank that notices a peer's death can raise, wherever the runtime does not turn it into
# a CommTimeout itself
NOTICED = [RuntimeError(_gloo("Connection closed by peer")),
           RuntimeError(_gloo("Read error: Connection reset by peer")),
           RuntimeError("Timed out waiting 3000ms for recv operation to complete"),
           torch.distributed.DistBackendError("NCCL communicator was aborted"),
           torch.distributed.DistNetworkError("sendBytes failed: Broken pipe"),
           torch.distributed.DistStoreError("wait timeout after 1500ms, keys: /chimera/position/1"),
           ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe"),
           ConnectionRefusedError(111, "Connection refused"), TimeoutError(),
           ValueError("the store's socket was closed by peer")]


def _rank_failing_with(monkeypatch, exc, data):
    """``launch._spawn_entry`` in this process, its rank failing with ``exc`` mid-run (no
    group, no model: the handler is the subject)."""
    from chimera.train import launch

    def fail(*args):
        raise exc
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")  # _spawn_entry sets them: restored after the test
    monkeypatch.setattr(launch, "keep_freed_memory", lambda mode: False)
    monkeypatch.setattr(launch, "_init_group", lambda *args: None)
    monkeypatch.setattr(launch, "Trainer", lambda *args: None)
    monkeypatch.setattr(launch, "_train", fail)
    threads = torch.get_num_threads()
    try:
        launch._spawn_entry(1, 2, TrainConfig(data=data, progress=False), 0, "", None)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("exc", NOTICED, ids=lambda e: type(e).__name__)
def test_every_error_of_a_rank_that_noticed_a_peer_gone_is_one_line_and_exit_75(
        exc, monkeypatch, capsys, data):
    with pytest.raises(SystemExit) as ended:
        _rank_failing_with(monkeypatch, exc, data)
    assert ended.value.code == workers.PEER_EXIT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"chimera train: rank 1: communication failed, a peer gone or a wait "
                          f"past --comm-timeout ({type(exc).__name__}"), err


def test_an_error_of_the_rank_itself_keeps_its_traceback(monkeypatch, capsys, data):
    with pytest.raises(ZeroDivisionError):  # a bug: workers._bound prints it, exit code 1
        _rank_failing_with(monkeypatch, ZeroDivisionError("division by zero"), data)
    assert capsys.readouterr().err == ""


def _ranks_of(launcher: subprocess.Popen) -> list[int]:
    """The pids of a local launcher's ranks, rank order (started in order: pids ascend)."""
    children = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher.pid and spawned:
            children.append(int(pid))
    return sorted(children)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_rank_1_is_named_not_the_rank_that_noticed(data, tmp_path, cli_env):
    log = tmp_path / "log.jsonl"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "chimera", "train", *COMMON, "--data", data, "--steps", "300",
         "--log-json", str(log), *pictures(tmp_path)],
        env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + limit(120)
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        ranks = _ranks_of(launcher)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGTERM)
        _, err = launcher.communicate(timeout=limit(120))
    finally:
        stop([launcher])
    assert launcher.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("chimera train: rank 1 failed first (killed by SIGTERM)"), err


def test_the_start_up_gets_the_rendezvous_timeout_and_the_steps_the_comm_timeout(monkeypatch):
    import datetime

    import torch.distributed as dist

    from chimera.train.launch import _init_group
    from chimera.train.sections import Run

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    seen = []
    real = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *a, **kw: seen.append(kw["timeout"]) or real(*a, **kw))
    _init_group("gloo", 0, 1, Run(comm_timeout=3, rendezvous_timeout=120), torch.device("cpu"))
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert seen == [datetime.timedelta(seconds=120)]  # connecting: the start-up's limit
        assert backend.options._timeout == datetime.timedelta(seconds=3)  # the steps': --comm-timeout
    finally:
        dist.destroy_process_group()


def test_a_rendezvous_that_times_out_is_one_line(monkeypatch):
    from chimera.train.launch import RendezvousFailed, _init_group
    from chimera.train.sections import Run

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(RendezvousFailed) as exc:  # rank 1 never comes
        _init_group("gloo", 0, 2, Run(comm_timeout=300, rendezvous_timeout=1), torch.device("cpu"))
    message = str(exc.value)
    assert message.startswith("rank 0: the 2 ranks did not all connect at start-up "
                              "(--rendezvous-timeout 1s): ") and "\n" not in message, message


@pytest.mark.slow
def test_a_rank_alone_at_start_up_ends_with_one_line_not_a_traceback(data, tmp_path, cli_env):
    args = [*COMMON, "--data", data, "--steps", "2", "--rendezvous-timeout", "2",
            "--comm-timeout", "1", *pictures(tmp_path)]
    rank = start_rank(cli_env, 0, free_port(), args, tmp_path)  # WORLD_SIZE 2: rank 1 never comes
    try:
        rc = rank.wait(timeout=limit(120))
    finally:
        stop([rank])
    err = (tmp_path / "err0.txt").read_text()
    assert rc == 1 and "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("chimera train:")]
    assert lines == [l for l in err.splitlines() if l.strip()] and len(lines) == 1, err
    assert "did not all connect at start-up (--rendezvous-timeout 2s)" in lines[0], err


def test_a_workers_gloo_group_connects_on_its_own_limit_then_takes_the_work_timeout():
    import datetime

    import torch.distributed as dist

    from chimera.runtime import workers

    for timeout_s, want in ((4.0, datetime.timedelta(seconds=4)), (None, dist.default_pg_timeout)):
        with workers.hosted_store(1) as store, workers.gloo_group(0, 1, store, timeout_s=timeout_s):
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            assert backend.options._timeout == want


# torch's C++ warning when a rank writes to a store whose host is gone (rank 0, when it hosted it)
STORE_WARNING = ("sendBytes failed", "TCPStore.cpp", "Broken pipe", "Exception raised from",
                 "frame #")


@pytest.mark.slow
def test_rank_0_killed_mid_step_leaves_the_store_up_and_is_named_first(data, tmp_path, cli_env):
    """The launcher hosts the rendezvous store, so rank 1 posts its position after rank 0 (the
    store's host under env://) died: no C++ warning block, and its report says where each
    rank was."""
    r = subprocess.run([sys.executable, "-m", "chimera", "train", *COMMON, "--data", data,
                        "--steps", "50", "--fault", "kill:0:2", *pictures(tmp_path)],
                       env=cli_env, capture_output=True, text=True, timeout=limit(240))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert not [l for l in out.splitlines() if any(w in l for w in STORE_WARNING)], out
    assert "Traceback" not in out
    assert r.stderr.strip().splitlines()[-1].startswith(
        "chimera train: rank 0 failed first (killed by SIGKILL); then rank 1 (failed on "
        "communication"), out
    assert "where each rank was" in out and "  rank 0: no report" in out, out


def _store_after_rank_0_died(rank, world):
    import torch.distributed as dist

    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.barrier()  # fails: rank 0 is gone
    except RuntimeError:
        pass
    store = dist.distributed_c10d._get_default_store()
    store.set("after", "rank 0 died")
    raise RuntimeError(f"the store answered: {store.get('after').decode()}")


@pytest.mark.slow
def test_spawn_s_store_outlives_rank_0(capfd):
    import chimera.api as chimera

    with pytest.raises(chimera.SpawnError) as info:
        chimera.spawn(_store_after_rank_0_died, world=2)
    errors = {e["rank"]: e["error"] for e in info.value.errors}
    assert errors[0].startswith("killed by SIGKILL"), errors
    assert errors[1] == "RuntimeError: the store answered: rank 0 died", errors
    err = capfd.readouterr().err
    assert not [l for l in err.splitlines() if any(w in l for w in STORE_WARNING)], err


def test_a_spawned_rank_that_cannot_join_the_group_is_reported_not_a_traceback(monkeypatch, tmp_path):
    """chimera.spawn's rank whose ``init_process_group`` raises (a store gone, a port taken)
    writes its report for the launcher (one line there) and exits 1, as its function's own
    failure does; the function never runs."""
    import pickle
    from chimera.runtime import launch_local

    def refused(*args, **kwargs):
        raise RuntimeError("connect() timed out")

    monkeypatch.setattr(launch_local.dist, "init_process_group", refused)
    monkeypatch.setattr(launch_local.workers, "store_client", lambda *a: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")  # _entry sets them: restored after the test
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as ended:
            launch_local._entry(1, 2, pickle.dumps(print), 0, "gloo", str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert ended.value.code == 1
    report = json.loads((tmp_path / "1.json").read_text())
    assert "connect() timed out" in report["error"]
    assert "rank 1 could not join the process group (gloo, 2 ranks)" in report["error"]
