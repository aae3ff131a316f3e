"""logitserve._malloc: the client's glibc malloc policy (keep large freed blocks for reuse), when
it applies, and that it removes the page faults a pipelined call's buffers cost otherwise."""

import os
import subprocess
import sys

import pytest

from logitserve import _malloc

# A pipelined call's pattern: a window of 4 MiB blocks (request bytes, grpcio's copies) alive
# together, then freed, again and again. Every page is written, as a copy into it would.
_CHURN = r"""
import os, resource, sys
import logitserve
from logitserve import _malloc
if sys.argv[1] == "policy":
    print(_malloc.keep_large_allocations(), file=sys.stderr)
def window():
    blocks = [bytes([i]) * (4 << 20) for i in range(8)]
    del blocks
window()  # the first round may fault wherever memory comes from
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ROUNDS = 10
for _ in range(ROUNDS):
    window()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults / (ROUNDS * 8 * (4 << 20) // 4096))
"""


def _faults_per_page(mode):
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    for name in _malloc._USER_ENV:
        env.pop(name, None)
    env["LOGITSERVE_KEEP_LARGE_ALLOCATIONS"] = "1" if mode == "policy" else "0"
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip()), out.stderr.strip()


def _glibc():
    import ctypes
    try:
        ctypes.CDLL(None).gnu_get_libc_version
        return True
    except (OSError, AttributeError):
        return False


@pytest.mark.skipif(not _glibc(), reason="the policy is glibc's")
def test_policy_removes_the_page_faults_of_reused_large_blocks():
    # Without it, glibc trims the freed window back to the kernel (or mmaps each block afresh)
    # and every page faults again on reuse; with it, the heap keeps the memory.
    default, _ = _faults_per_page("default")
    kept, state = _faults_per_page("policy")
    assert state == "set"
    assert default > 0.5, "glibc no longer re-faults this pattern (%.2f faults per page)" % default
    assert kept < 0.05, "%.3f faults per page with the policy (%.2f without)" % (kept, default)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_policy_defers_to_the_users_settings():
    assert _malloc._why_not({}) is None
    # Tunables that are not malloc's thresholds leave it on.
    assert _malloc._why_not({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None
    assert _malloc._why_not({"LOGITSERVE_KEEP_LARGE_ALLOCATIONS": "0"}).startswith("off")
    assert _malloc._why_not({"LOGITSERVE_KEEP_LARGE_ALLOCATIONS": "off"}).startswith("off")
    for env in ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
                {"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.mmap_threshold=65536"},
                {"MALLOC_TRIM_THRESHOLD_": "1"}, {"MALLOC_MMAP_MAX_": "0"}):
        assert _malloc._why_not(env) == "left to the user's malloc settings", env


def test_client_option_turns_it_off():
    # In a fresh process: the first client decides, once.
    code = ("import logitserve\nfrom logitserve import _malloc\n"
            "c = logitserve.Client('127.0.0.1:1', keep_large_allocations=False)\n"
            "assert _malloc.state() is None, _malloc.state()\n"
            "c.close()\n"
            "c = logitserve.Client('127.0.0.1:1')\n"
            "print(_malloc.state())\n")
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    env.pop("LOGITSERVE_KEEP_LARGE_ALLOCATIONS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                         text=True)
    assert out.stdout.strip() == ("set" if _glibc() else "not glibc")
