"""The launcher contract: a signal to `chimera train`, or its death, ends every rank within
seconds and leaves the newest checkpoint intact (issue 13, case 1)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from chimera.models import get_config

from chimera.train import checkpoint as ckpt
from limits import limit

# every test starts `chimera train` processes and signals them: make test-slow
pytestmark = pytest.mark.slow


def children(pid):
    """Every process whose parent is ``pid`` (from /proc: no psutil)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def start_training(cli_env, data, tmp_path, ignore_sigint=False):
    log = tmp_path / "log.jsonl"
    argv = [sys.executable, "-m", "chimera", "train", "--steps", "100000", "--micro-batch-size", "2",
            "--no-progress", "--data", data, "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "1", "--keep-checkpoints", "2", "--log-json", str(log),
            "--png", str(tmp_path / "t.png"), "--trace", str(tmp_path / "t.json")]
    # a script's `chimera train &` starts with SIGINT ignored
    # otherwise as from a terminal: SIGINT at its default whatever the suite inherited (a
    # suite started as a background job of a shell without job control ignores SIGINT, and
    # a launcher keeps a signal ignored that it was started with, as `cmd &` asks)
    mode = signal.SIG_IGN if ignore_sigint else signal.SIG_DFL
    pre = lambda: signal.signal(signal.SIGINT, mode)  # noqa: E731
    proc = subprocess.Popen(argv, env=cli_env, preexec_fn=pre, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "err.txt", "w"))
    deadline = time.monotonic() + limit(120)
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig, ignore_sigint, code", [
    (signal.SIGINT, False, 130), (signal.SIGTERM, False, 143), (signal.SIGKILL, True, -9)],
    ids=["SIGINT", "SIGTERM", "SIGKILL-of-a-background-launcher"])
def test_a_signal_to_the_launcher_ends_every_rank(data, tmp_path, sig, ignore_sigint, code, cli_env):
    proc = start_training(cli_env, data, tmp_path, ignore_sigint)
    ranks = children(proc.pid)
    try:
        assert len(ranks) >= 2
        os.kill(proc.pid, sig)
        sent = time.monotonic()
        # the launcher stops its ranks in STOP_S (5 s) and exits: seconds on an idle machine;
        # the margin is for a loaded one (20 s was once too short beside two test suites and
        # a CPU hog); the bug this guards against waited forever
        assert proc.wait(timeout=limit(60)) == code, (tmp_path / "err.txt").read_text()
        while any(alive(r) for r in ranks) and time.monotonic() - sent < 30:
            time.sleep(0.05)
        gone = time.monotonic() - sent
        assert not any(alive(r) for r in ranks), f"ranks alive {gone:.1f} s after {sig.name}"
    finally:
        for pid in [proc.pid, *ranks]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    newest = ckpt.latest(tmp_path / "ck")
    assert newest is not None
    ckpt.verify(newest, "gpt2-tiny", ckpt.model_fingerprint(get_config("gpt2-tiny")))
    if sig != signal.SIGKILL:
        err = (tmp_path / "err.txt").read_text().strip().splitlines()
        assert err[-1].startswith(f"chimera train: interrupted by {sig.name}") and "Traceback" not in "".join(err)
        assert str(newest) in err[-1]


def test_the_watchdog_alone_ends_an_orphan(tmp_path, cli_env):
    """Where PR_SET_PDEATHSIG is missing, the parent-id watchdog ends the worker."""
    code = ("import os, sys, time, threading\n"
            "from chimera.runtime import workers\n"
            "workers._set_pdeathsig = lambda sig: None\n"
            "parent = os.getppid()\n"
            "workers.bind_to_parent(parent)\n"
            "print(os.getpid(), flush=True)\n"
            "time.sleep(3600)\n")
    # a middle process starts the worker and is then SIGKILLed: the worker is orphaned
    middle = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               f"p = subprocess.Popen([sys.executable, '-c', {code!r}])\n"
                               "time.sleep(3600)\n"], env=cli_env, stdout=subprocess.PIPE)
    worker = None
    try:
        worker = int(middle.stdout.readline())  # printed once bound to its parent
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait()
        deadline = time.monotonic() + limit(10)
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        for pid in (middle.pid, worker):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_process_on_the_same_directory_is_refused(cli_env, data, tmp_path):
    """Two `chimera train` processes on one --checkpoint-dir at once (issue 13, case 2): the
    second ends with one line naming the running one, and the first's checkpoints stay
    intact and its own."""
    proc = start_training(cli_env, data, tmp_path)
    try:
        argv = [sys.executable, "-m", "chimera", "train", "--steps", "2", "--no-progress",
                "--data", data, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every",
                "1", "--resume", "--png", str(tmp_path / "u.png"), "--trace", str(tmp_path / "u.json")]
        second = subprocess.run(argv, env=cli_env, capture_output=True, text=True, timeout=limit(120))
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "is in use by run" in lines[0], lines
        assert proc.poll() is None  # the first run goes on
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=limit(30))
    newest = ckpt.latest(tmp_path / "ck")
    ckpt.verify(newest, "gpt2-tiny", ckpt.model_fingerprint(get_config("gpt2-tiny")))
