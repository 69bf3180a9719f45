"""--compile without a working compiler (issue 38): refused in one line before any rank starts,
naming the cause and the fix; a compile failure the check cannot foresee ends a rank with one
line, not torch's traceback. Inductor looks for its C++ compiler in
``torch._inductor.config.cpp.cxx`` (from $CXX): the tests point it at a missing binary and at
one that cannot build."""

import shutil

import pytest
import torch
import torch._inductor.config as inductor

from chimera.cli import main
from chimera.train import ConfigError, TrainConfig, compiler
from chimera.train.launch import run_rank


def cxx(path: str):
    """Inductor's compiler search pointed at ``path`` (``config.patch``: monkeypatch's undo
    would delete the entry from inductor's config)."""
    return inductor.patch({"cpp.cxx": (None, path)})


def cfg(data, **kw):
    return TrainConfig(**{**dict(schedule="none", stages=1, steps=1, micro_batch_size=2,
                                 data=data, progress=False, compile=True, device="cpu"), **kw})


def train(capsys, data, *extra) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--compile", "--device", "cpu", "--steps", "1", "--data", data,
              "--no-progress", "--png", "", "--trace", "", *extra])
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


def test_a_missing_compiler_is_refused_before_any_rank_starts(data, capsys):
    for extra in ((), ("--schedule", "1f1b", "--stages", "2")):  # one process, or ranks
        with cxx("/nonexistent/g++"):
            code, err = train(capsys, data, *extra)
        assert code == 2 and len(err) == 1, err
        assert "--compile: no working C++ compiler" in err[0] and "/nonexistent/g++" in err[0]
        assert "apt-get install g++" in err[0] and "drop --compile" in err[0]


def test_a_compiler_that_cannot_build_is_named_with_its_error(data, tmp_path):
    fake = tmp_path / "fake-g++"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\n'
                    'echo "probe.cpp:1: fatal error: cmath: No such file or directory" >&2\nexit 1\n')
    fake.chmod(0o755)
    with cxx(str(fake)), pytest.raises(ConfigError, match=r"fake-g\+\+ cannot build a test "
                                                          r"program \(probe.cpp:1: fatal error: "
                                                          r"cmath.*drop --compile"):
        cfg(data).preflight()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
def test_a_working_compiler_passes(data):
    with cxx("g++"):
        cfg(data).preflight()


def test_cuda_needs_triton_and_a_c_compiler(monkeypatch):
    import torch.utils._triton as triton_probe

    monkeypatch.setattr(triton_probe, "has_triton", lambda: False)
    with pytest.raises(ConfigError, match="triton package is missing.*drop --compile"):
        compiler.check("cuda")
    monkeypatch.setattr(triton_probe, "has_triton", lambda: True)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"C compiler \(\$CC, else gcc or clang\).*install gcc"):
        compiler.check("cuda")


@pytest.fixture
def fresh_inductor(monkeypatch, tmp_path):
    """Nothing compiled before counts: an empty cache folder, no FX graph cache, no frames."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    with inductor.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


def test_a_compile_failure_is_said_in_one_line(fresh_inductor):
    with cxx("/nonexistent/g++"), pytest.raises(Exception) as raised:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
    failed = compiler.explain(raised.value)
    assert isinstance(failed, compiler.CompileFailed), raised.value
    text = str(failed)
    assert "\n" not in text and "InvalidCxxCompiler" in text
    assert "apt-get install g++" in text and "drop --compile" in text
    assert compiler.explain(ValueError("x")) is None  # any other error keeps its traceback


@pytest.mark.slow
def test_a_compile_failure_in_a_rank_is_one_line(data, fresh_inductor):
    """Past the check (the compiler went away after it): the rank's error is one line."""
    with cxx("/nonexistent/g++"), pytest.raises(compiler.CompileFailed) as failed:
        run_rank(0, 1, cfg(data), None)  # the preflight is launch's
    text = str(failed.value)
    assert "\n" not in text and text.startswith("rank 0: --compile:") and "InvalidCxxCompiler" in text
