"""Fixtures the test modules share, and the ``--regen-goldens`` flag.

- ``cli_env`` / ``run_cli``: the environment of a ``python -m chimera`` subprocess (this
  checkout's ``src`` first on the path, no fault injection inherited) and a runner for one;
- ``data``: a small text corpus on disk (60 kB of the standard library's argparse source);
- ``spawn_world``: run a worker on W spawned gloo ranks and collect what each rank saved;
- ``regen_goldens``: true under ``pytest --regen-goldens``, when the golden files are
  rewritten from the current code instead of compared (``tests/test_golden_schedules.py``).

Long tests carry ``@pytest.mark.slow``: ``make test`` runs every test, ``make test-fast``
leaves those out.
"""

import argparse
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


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
    """``run_cli(*args, timeout=300)``: ``python -m chimera *args``, output captured as text."""
    def run(*args, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "chimera", *map(str, args)], capture_output=True,
                              text=True, timeout=timeout, env=env or cli_env)
    return run


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> str:
    """A 60 kB text file: enough sequences of the tiny models for training and a held-out 5%."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_bytes(Path(argparse.__file__).read_bytes()[:60_000])
    return str(path)


@pytest.fixture(scope="session")
def spawn_world(tmp_path_factory):
    """``spawn_world(worker, world)``: ``worker(rank, world, out=PATH)`` on ``world`` spawned gloo
    ranks (``chimera.spawn``, the API's launcher), each saving what it found with ``torch.save(x, f"{out}.{rank}")``;
    returns those objects in rank order."""
    def run(worker, world: int) -> list:
        import torch  # not at the top: most test modules never load torch

        from chimera.runtime.launch_local import spawn

        out = str(tmp_path_factory.mktemp(f"world{world}") / "result")
        spawn(functools.partial(worker, out=out), world=world)
        return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]
    return run
