"""Where commands and benchmark scripts write by default: out/ of the current folder, never
benchmarks/results/ (the committed figures the README quotes, rewritten only on purpose)."""

import importlib.util
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from chimera.cli import build_parser
from limits import limit


def _outdir():
    spec = importlib.util.spec_from_file_location("outdir", ROOT / "benchmarks" / "outdir.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chimera_bench_writes_to_out_by_default():
    assert build_parser().parse_args(["bench"]).out == "out"
    assert build_parser().parse_args(["bench", "--out", "benchmarks/results"]).out == "benchmarks/results"


def test_a_benchmark_script_takes_out_from_its_arguments():
    out_dir = _outdir().out_dir
    argv = ["x.py", "8", "--out", "benchmarks/results", "16"]
    assert out_dir(argv) == "benchmarks/results" and argv == ["x.py", "8", "16"]
    argv = ["x.py", "--out=somewhere", "--quick"]
    assert out_dir(argv) == "somewhere" and argv == ["x.py", "--quick"]
    assert out_dir(["x.py", "--quick"]) == "out"


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_no_benchmark_script_defaults_to_the_committed_results(script):
    """No script joins a path under its own folder's results/ to write to (reading the committed
    profile is allowed: plan_vs_bench's RESULTS)."""
    text = (ROOT / "benchmarks" / script).read_text()
    for line in text.splitlines():
        code = line.split("#")[0]
        if re.search(r'(__file__|HERE|ROOT)\S*\)?, "results"', code) and "RESULTS =" not in code:
            pytest.fail(f"benchmarks/{script} writes under benchmarks/results by default: {line.strip()}")
        if "default=" in code and "benchmarks/results" in code:
            pytest.fail(f"benchmarks/{script} defaults to benchmarks/results: {line.strip()}")


@pytest.mark.slow
def test_a_script_run_from_the_repo_root_leaves_the_committed_results_alone(tmp_path):
    committed = ROOT / "benchmarks" / "results" / "scheme_table_D4_N4.md"
    before = committed.read_bytes() if committed.exists() else None
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scheme_table.py"), "4", "4"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=limit(120))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "scheme_table_D4_N4.md").is_file()
    assert (committed.read_bytes() if committed.exists() else None) == before
