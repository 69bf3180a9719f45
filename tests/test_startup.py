"""`chimera generate` and `chimera export` start without importing torch.distributed.checkpoint
(which imports DTensor, sympy and torch.fx: seconds of start-up): a checkpoint's index and
model tensors are read directly (chimera.train.checkpoint.light), the same tensors DCP reads."""

import subprocess
import sys

import pytest
import torch

from limits import limit

from chimera.cli import main
from chimera.train.checkpoint import light
from chimera.train.checkpoint.disk import dcp_call, read_index, read_light_index, safe_reader
from chimera.train.checkpoint.state import load_model_state

TRAIN = ["train", "--seq-len", "16", "-B", "2", "--steps", "1", "--no-progress",
         "--trace", "", "--png", "", "--checkpoint-dir", "ck"]


def _dcp_state(step):
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in read_index(step).items()
             if k.startswith("model.")}
    dcp_call(0, "reading", dcp.load, state, storage_reader=safe_reader(step), no_dist=True)
    return {k[len("model."):]: v for k, v in state.items()}


def _same_as_dcp(step):
    fast = light.model_state(step, read_light_index(step))
    assert fast is not None, "the checkpoint was read through DCP, not directly"
    slow = _dcp_state(step)
    assert {k[len("model."):] for k in fast} == set(slow)
    for key, value in load_model_state(step).items():
        assert torch.equal(value, slow[key]) and value.dtype == slow[key].dtype, key


def test_model_tensors_read_directly_equal_dcps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*TRAIN, "--schedule", "none", "--stages", "1", "--dtype", "float64"]) == 0
    _same_as_dcp(next((tmp_path / "ck").glob("step-*")))


@pytest.mark.slow
def test_a_pipelined_checkpoint_reads_directly_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*TRAIN, "-D", "2", "-N", "2"]) == 0
    _same_as_dcp(next((tmp_path / "ck").glob("step-*")))


@pytest.mark.slow
def test_generate_does_not_import_dcp(tmp_path, monkeypatch, cli_env):
    monkeypatch.chdir(tmp_path)
    assert main([*TRAIN, "--schedule", "none", "--stages", "1"]) == 0
    code = ("import sys; from chimera.cli import main; "
            "main(['generate', '--checkpoint', 'ck', '--prompt', 'def ', '--max-new-tokens', '3']); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.checkpoint', "
            "'torch.distributed.tensor', 'sympy'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env,
                       capture_output=True, text=True, timeout=limit(300))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
