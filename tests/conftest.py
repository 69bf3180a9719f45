"""Fixtures the test modules share, and the ``--regen-goldens`` flag.

- ``cli_env`` / ``run_cli``: the environment of a ``python -m chimera`` subprocess (this
  checkout's ``src`` first on the path, no fault injection inherited) and a runner for one;
- ``data``: a small text corpus on disk (60 kB of the standard library's argparse source);
- ``limits.limit(seconds)`` (``tests/limits.py``): every time limit a test puts on processes
  (a subprocess, spawned ranks, a hand-written deadline, a comm timeout that only bounds a
  hang), scaled by the machine's load and ``CHIMERA_TEST_TIME_SCALE``;
- ``regen_goldens``: true under ``pytest --regen-goldens``, when the golden files are
  rewritten from the current code instead of compared (``tests/test_golden_schedules.py``).

Ranks for a test come from ``tests/ranks.py`` (``run_ranks``: virtual ranks in this process,
or spawned gloo processes where the transport or the processes are the subject). Every test
that starts processes (spawned ranks, ``run_cli``, ``python -c``) carries
``@pytest.mark.slow``: ``make test`` leaves them out (but for one ``chimera schedules``
smoke run), ``make test-slow`` runs them. A slow test that starts no process (a sweep's
largest cases) carries ``@pytest.mark.sweep`` too: ``make test-slow`` runs those first, on two
workers, and the process-starting rest serially (their time limits assume no test beside them).

``make test`` runs on two pytest-xdist workers (``-n 2 --dist loadfile``: a module's tests,
and so its module fixtures, stay in one worker); a worker then takes its share of the cores
for torch's intra-op threads (``pytest_configure``) instead of every worker taking them all.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from limits import limit

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def pytest_configure(config):
    """Under xdist, torch's intra-op threads per worker: the cores over the workers (at least
    one), so two workers on two cores do not each spin two threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_addoption(parser):
    parser.addoption("--regen-goldens", action="store_true",
                     help="rewrite tests/golden/*.txt from the current generators instead of "
                          "comparing against them")


@pytest.fixture(scope="session")
def regen_goldens(request) -> bool:
    return request.config.getoption("--regen-goldens")


@pytest.fixture(scope="session")
def cli_env() -> dict[str, str]:
    """``os.environ`` with this checkout's ``src`` on PYTHONPATH and CHIMERA_FAULT unset."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("CHIMERA_FAULT", None)
    return env


@pytest.fixture(scope="session")
def run_cli(cli_env):
    """``run_cli(*args, timeout=300)``: ``python -m chimera *args``, output captured as text
    (``timeout``: seconds on an idle machine, scaled by ``limits.limit``)."""
    def run(*args, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "chimera", *map(str, args)], capture_output=True,
                              text=True, timeout=limit(timeout), env=env or cli_env)
    return run


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> str:
    """A 60 kB text file: enough sequences of the tiny models for training and a held-out 5%."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_bytes(Path(argparse.__file__).read_bytes()[:60_000])
    return str(path)
