"""The runtime keeps freed CPU memory in the process (glibc mallopt), unless told not to."""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PROBE = "from chimera.runtime.allocator import keep_freed_memory as k; print(k(), k())"


def _probe(**env) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_tunes_glibc_once():
    assert _probe() == "True True"


def test_opt_out():
    assert _probe(CHIMERA_MALLOC="default") == "False False"
