"""The runtime keeps freed CPU memory in the process (glibc mallopt), unless told not to."""

import platform
import subprocess
import sys

import pytest
from limits import limit

# each test probes a fresh interpreter (per-process allocator state): make test-slow
pytestmark = pytest.mark.slow

# as an entry point calls it: with the run's option, which CHIMERA_MALLOC may set
PROBE = ("from chimera.runtime.allocator import keep_freed_memory as k\n"
         "from chimera.runtime.context import RuntimeOptions as O\n"
         "m = O.from_env().malloc; print(k(m), k(m))")


def _probe(cli_env, **env) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=limit(60),
                       env={**cli_env, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_tunes_glibc_once(cli_env):
    assert _probe(cli_env) == "True True"


def test_opt_out(cli_env):
    assert _probe(cli_env, CHIMERA_MALLOC="default") == "False False"
