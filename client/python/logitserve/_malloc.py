"""Keeping large freed allocations in the process (glibc malloc), so that sending many-MiB
requests does not page-fault on every call.

Each request chunk lives twice in the client's heap: the serialized bytes this package builds and
grpcio's own copy of them into a gRPC slice (grpcio copies every message it sends). Both are a few
MiB and freed as soon as the chunk is on the wire. Under glibc's default policy such blocks are
served by fresh mmap()s, or from heap memory that free() has just trimmed back to the kernel, so
every call faults every page in again: the kernel zeroes each 4 KiB page on its first touch, and
grpcio's copy does so while it holds the GIL. Measured on the 2-core build machine (CPU backend,
4 MiB chunks, 4096-dim bf16 rows): 3.5 K-12.6 K page faults and 1.4-2.4 ms of client CPU per MiB
sent, against 2-340 faults and 0.8-0.95 ms/MiB with the settings below
(docs/performance-history.md, "The Python client's CPU per byte").

keep_large_allocations() fixes glibc's two thresholds instead of letting them float:
  M_MMAP_THRESHOLD = 32 MiB  blocks below it come from the heap, not from a fresh mmap. 32 MiB is
                             the largest value glibc accepts on 64-bit and the value its own
                             dynamic threshold reaches after the process frees one 32 MiB block.
  M_TRIM_THRESHOLD = 256 MiB free() gives heap memory back to the kernel only when more than this
                             lies free at the top of an arena (a pipelined call has up to
                             streams x depth x chunk x 2 = 64 MiB in flight; 64 MiB was measured
                             to be too little, 128 MiB enough).
The cost: a process keeps up to 256 MiB of freed heap per malloc arena for reuse, and blocks of
128 KiB-32 MiB come from the heap rather than from mmap (glibc's own dynamic threshold does the
same once the process has freed a large block). Setting either threshold turns glibc's dynamic
adjustment off for both, which is why both are set.

It runs once per process, when the first Client or AsyncClient is created, and does nothing when
the process is not on glibc, when the user chose a malloc policy (GLIBC_TUNABLES naming
glibc.malloc.mmap_threshold / trim_threshold / mmap_max, or MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_MAX_ set), or when LOGITSERVE_KEEP_LARGE_ALLOCATIONS=0
(or Client(keep_large_allocations=False)).
"""

import ctypes
import os
import sys
import threading

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20

_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold",
                  "glibc.malloc.mmap_max")
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_")

_lock = threading.Lock()
_state = None  # what keep_large_allocations() did, once it ran


def _why_not(environ):
    """The reason to leave malloc alone, or None."""
    if environ.get("LOGITSERVE_KEEP_LARGE_ALLOCATIONS", "1").strip().lower() in ("0", "false",
                                                                                 "no", "off"):
        return "off (LOGITSERVE_KEEP_LARGE_ALLOCATIONS)"
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(t in tunables for t in _USER_TUNABLES) or any(e in environ for e in _USER_ENV):
        return "left to the user's malloc settings"
    if not sys.platform.startswith("linux"):
        return "not glibc"
    return None


def keep_large_allocations(environ=None):
    """Applies the policy above once per process; returns what was done (a short string, also
    in the module's `state()`)."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        why = _why_not(os.environ if environ is None else environ)
        if why is None:
            try:
                libc = ctypes.CDLL(None)
                libc.gnu_get_libc_version  # glibc only (musl has mallopt but not these knobs)
                mallopt = libc.mallopt
            except (OSError, AttributeError):
                why = "not glibc"
        if why is None:
            mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            mallopt.restype = ctypes.c_int
            ok = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and
                  mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
            why = "set" if ok else "mallopt refused"
        _state = why
        return _state


def state():
    """None before the first client; else keep_large_allocations()'s answer."""
    return _state
