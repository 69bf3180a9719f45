"""The README's code blocks run as written: each Python block pasted into a file of its own and
run with `python FILE` (as a reader does: spawning needs the file's `__main__` guard), and the
shell blocks that run on a laptop in seconds run line by line in a fresh folder. The other
shell blocks are named below with why they are not run here (their commands are parsed by
tests/test_docs.py). Slow: each starts processes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from limits import limit
from conftest import ROOT

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# shell blocks not run here, by their first line, and why
NOT_RUN = {  # the first key a block's first line starts with
    "make demo": "builds a virtual environment",
    "chimera train --model hf-llama-tiny -D 2 -T 2": "starts 4 processes for tensor parallelism "
                                                     "(tests/test_tp_pipeline.py runs it)",
    "chimera train ": "trains for minutes (the CLI tests run one step of each of its commands)",
    "chimera tokenize --data corpus/": "reads a corpus/ folder the reader brings",
    "# 2 nodes x 4 GPUs": "needs two nodes with GPUs",
    "# a checkpoint every 50 steps": "trains 400 steps",
    "chimera judge": "needs the checkpoints of the block before",
    "chimera tokenize --vocab-size 1024": "trains a Llama for 200 steps",
    "# LoRA adapters": "trains for minutes (tests/test_lora*.py run it)",
    "chimera bench": "measures for minutes",
}


def _blocks(lang: str) -> list:
    text = (ROOT / "README.md").read_text()
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) == lang:
            line = text[:match.start()].count("\n") + 2
            found.append(pytest.param(match.group(2), id=f"README.md:{line}"))
    return found


def _skip_reason(body: str) -> str | None:
    first = body.strip().splitlines()[0]
    return next((why for start, why in NOT_RUN.items() if first.startswith(start)), None)


@pytest.mark.slow
@pytest.mark.parametrize("body", _blocks("python"))
def test_a_python_block_runs_pasted_into_a_file(body, tmp_path, cli_env):
    (tmp_path / "snippet.py").write_text(body)
    r = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=cli_env,
                       capture_output=True, text=True, timeout=limit(600))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("body", _blocks("bash"))
def test_a_shell_block_runs_as_written(body, tmp_path, cli_env):
    why = _skip_reason(body)
    if why is not None:
        pytest.skip(why)
    # `chimera` and `python` of this interpreter's environment, importing this checkout
    env = {**cli_env, "PATH": f"{Path(sys.executable).parent}:{cli_env.get('PATH', '')}"}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=limit(600))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_every_block_not_run_is_still_in_the_readme():
    """Each NOT_RUN entry names a shell block the README has (a stale entry would hide a new
    block of the same start), and some blocks do run."""
    firsts = [param.values[0].strip().splitlines()[0] for param in _blocks("bash")]
    for start in NOT_RUN:
        assert any(first.startswith(start) for first in firsts), start
    assert sum(_skip_reason(param.values[0]) is None for param in _blocks("bash")) >= 2
    assert _blocks("python")


@pytest.mark.slow
def test_training_with_the_progress_bar_leaves_no_semaphore(run_cli, tmp_path):
    """tqdm's default lock is a multiprocessing one, whose semaphore a spawned rank left behind
    ("resource_tracker: There appear to be 1 leaked semaphore objects"): the bar now takes a
    thread lock."""
    r = run_cli("train", "--steps", "2", "--seq-len", "16", "-B", "2", "--trace", "", "--png", "",
                "--progress")
    assert r.returncode == 0, r.stderr
    assert "step/s" in r.stderr and "leaked semaphore" not in r.stderr
