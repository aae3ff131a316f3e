"""The native send path: Score calls whose row arrays go from numpy memory to gRPC without a copy
and without the GIL (issue 12; client/python/native/native_call.h says why and how).

grpcio copies each request message into a slice while it holds the GIL, after this package's own
copy of the arrays into the message's bytes, which caps one Python process at about 300 K bf16
H 4096 rows a second on the H200 host (docs/PERFORMANCE.md, "the Python client's native send
path"). The library here is a small C ABI over gRPC C++: a call's message is a list of buffers
(the encoded ScoreRequest prefix and each row array as it is), sent in place, and every call into
it releases the GIL (ctypes does), so the client's sender threads really run in parallel.

It is optional. Client and AsyncClient use it for Score calls that carry array bytes (unary, and
every chunk of a pipelined call) when it loads: the wheel the build makes ships it
(logitserve/_native/), or $LOGITSERVE_NATIVE_LIB names it; LOGITSERVE_NATIVE=0 or native=False
keeps grpcio for them. Everything else (ListHeads, streams, session / shared-memory calls) stays
on grpcio, whose channel and this one are separate connections to the same target.

Lifetime: gRPC may reference a call's arrays until its transport lets go of them, which can be
after the call completed (a cancelled chunk's frames may still be in a socket write). Each
NativeCall keeps its arrays alive until the library says they are released; the channel frees
released calls when the next call starts and when it closes.
"""

import ctypes
import os
import threading
import time

import grpc
import numpy as np

from . import _wire

ABI_VERSION = 1
_LIB_FILE = "liblogitserve_native.so"

_load_lock = threading.Lock()
_lib = None
_load_error = None
_loaded = False


def _declare(lib):
    c_int, c_double, c_size_t = ctypes.c_int, ctypes.c_double, ctypes.c_size_t
    c_char_p, c_void_p = ctypes.c_char_p, ctypes.c_void_p
    pp_char = ctypes.POINTER(c_char_p)
    lib.ls_native_abi_version.restype = c_int
    lib.ls_native_abi_version.argtypes = []
    lib.ls_channel_create.restype = c_void_p
    lib.ls_channel_create.argtypes = [c_char_p, c_int, c_char_p, c_char_p, c_char_p, c_int,
                                      pp_char, pp_char, ctypes.POINTER(ctypes.c_int64),
                                      c_char_p, c_size_t]
    lib.ls_channel_destroy.restype = None
    lib.ls_channel_destroy.argtypes = [c_void_p]
    lib.ls_call_start.restype = c_void_p
    lib.ls_call_start.argtypes = [c_void_p, c_char_p, c_int, ctypes.POINTER(c_void_p),
                                  ctypes.POINTER(c_size_t), c_double, c_int, pp_char, pp_char]
    lib.ls_call_wait.restype = c_int
    lib.ls_call_wait.argtypes = [c_void_p]
    lib.ls_call_cancel.restype = None
    lib.ls_call_cancel.argtypes = [c_void_p]
    lib.ls_call_message.restype = c_char_p
    lib.ls_call_message.argtypes = [c_void_p]
    lib.ls_call_response.restype = c_void_p
    lib.ls_call_response.argtypes = [c_void_p, ctypes.POINTER(c_size_t)]
    lib.ls_call_released.restype = c_int
    lib.ls_call_released.argtypes = [c_void_p]
    lib.ls_call_free.restype = None
    lib.ls_call_free.argtypes = [c_void_p]


def library_path():
    """Where the library is looked for: $LOGITSERVE_NATIVE_LIB, else the package's _native/."""
    return os.environ.get("LOGITSERVE_NATIVE_LIB") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "_native", _LIB_FILE)


def library():
    """The loaded library, or None when it is off (LOGITSERVE_NATIVE=0), absent or unusable
    (load_error() says why). Loaded once per process."""
    global _lib, _load_error, _loaded
    with _load_lock:
        if _loaded:
            return _lib
        _loaded = True
        if os.environ.get("LOGITSERVE_NATIVE", "1") == "0":
            _load_error = "LOGITSERVE_NATIVE=0"
            return None
        path = library_path()
        if not os.path.isfile(path):
            _load_error = "%s not found" % path
            return None
        try:
            lib = ctypes.CDLL(path)
            _declare(lib)
            version = lib.ls_native_abi_version()
        except (OSError, AttributeError) as e:
            _load_error = "%s: %s" % (path, e)
            return None
        if version != ABI_VERSION:
            _load_error = "%s has ABI %d, this package needs %d" % (path, version, ABI_VERSION)
            return None
        _lib = lib
        return _lib


def load_error():
    """Why library() returned None ("" when it loaded or was not tried)."""
    return _load_error or ""


def _strings(values):
    arr = (ctypes.c_char_p * max(1, len(values)))()
    for i, v in enumerate(values):
        arr[i] = None if v is None else (v if isinstance(v, bytes) else str(v).encode())
    return arr


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class NativeRpcError(grpc.RpcError):
    """A failed native call, shaped like grpcio's: code() (a grpc.StatusCode) and details()."""

    def __init__(self, code, details):
        super().__init__(details)
        self._code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def __str__(self):
        return "%s: %s" % (self._code.name, self._details)


class NativeCall:
    """One unary call in flight, with the grpcio future methods the client uses: result()
    (blocks without the GIL; returns the decoded response or raises NativeRpcError) and
    cancel()."""

    __slots__ = ("_channel", "_handle", "_keep", "_decode", "_consumed", "_cancelled", "_waiting")

    def __init__(self, channel, handle, keep, decode):
        self._channel = channel
        self._handle = handle
        self._keep = keep  # the buffers gRPC may read until the call is released
        self._decode = decode
        self._consumed = False
        self._cancelled = False
        self._waiting = False

    def result(self):
        lib = self._channel.lib
        with self._channel.lock:
            handle = self._handle
            if handle is None or self._consumed:
                raise NativeRpcError(grpc.StatusCode.CANCELLED.value[0],
                                     "the call's result was read or its channel closed")
            self._waiting = True  # the channel frees no call a thread waits on
        code = lib.ls_call_wait(handle)
        size = ctypes.c_size_t()
        with self._channel.lock:  # the channel frees only consumed or cancelled calls
            self._waiting = False
            message = lib.ls_call_message(handle).decode("utf-8", "replace")
            data = ctypes.string_at(lib.ls_call_response(handle, ctypes.byref(size)), size.value)
            self._consumed = True
        if code != 0:
            raise NativeRpcError(code, message)
        return self._decode(data)

    def cancel(self):
        with self._channel.lock:
            if self._handle is not None:
                self._cancelled = True
                self._channel.lib.ls_call_cancel(self._handle)

    def _release_if_done(self, force=False):
        """Frees the call when gRPC is done with its buffers and nobody will read its result
        (force: also an unread one); returns whether it did. Under the channel's lock."""
        if self._waiting or not (self._consumed or self._cancelled or force):
            return False
        if not self._channel.lib.ls_call_released(self._handle):
            return False
        self._channel.lib.ls_call_free(self._handle)
        self._handle = None
        self._keep = None
        return True


class NativeChannel:
    """A gRPC C++ channel to `target` with the grpcio-style channel options `options` ((key,
    int or str) pairs) and `tls` (None or a TlsConfig)."""

    def __init__(self, lib, target, options, tls=None):
        self.lib = lib
        self.lock = threading.Lock()
        self._calls = []  # every call not yet freed
        keys = [k for k, _ in options]
        strs = [v if isinstance(v, (str, bytes)) else None for _, v in options]
        ints = (ctypes.c_int64 * max(1, len(options)))(
            *[0 if isinstance(v, (str, bytes)) else int(v) for _, v in options])
        error = ctypes.create_string_buffer(512)
        pem = lambda v: None if v is None else (v if isinstance(v, bytes) else v.encode())  # noqa
        self._handle = lib.ls_channel_create(
            target.encode(), 1 if tls is not None else 0,
            pem(tls.root_certs) if tls else None, pem(tls.client_cert) if tls else None,
            pem(tls.client_key) if tls else None, len(options), _strings(keys), _strings(strs),
            ints, error, len(error))
        if not self._handle:
            raise ValueError("native channel to %s: %s" % (target, error.value.decode()))

    def unary(self, method, decode):
        return NativeMethod(self, method, decode)

    def start(self, method, pieces, timeout, metadata, decode):
        """Starts a call of `method` whose message is the concatenation of `pieces` (bytes and
        C-contiguous numpy arrays), kept alive until gRPC releases them."""
        n = len(pieces)
        addrs = (ctypes.c_void_p * max(1, n))()
        sizes = (ctypes.c_size_t * max(1, n))()
        for i, p in enumerate(pieces):
            if isinstance(p, bytes):
                addrs[i] = ctypes.cast(ctypes.c_char_p(p), ctypes.c_void_p).value
                sizes[i] = len(p)
            else:
                if not p.flags.c_contiguous:  # never from _wire.pieces; kept correct anyway
                    p = pieces[i] = np.ascontiguousarray(p)
                addrs[i] = p.ctypes.data
                sizes[i] = p.nbytes
        md_keys = _strings([k for k, _ in metadata])
        md_values = _strings([v for _, v in metadata])
        with self.lock:
            if self._handle is None:
                raise ValueError("the native channel is closed")
            self._calls = [c for c in self._calls if not c._release_if_done()]
        # The library reads <= 0 as "no deadline": an expired one stays a (tiny) deadline.
        seconds = 0.0 if timeout is None else max(float(timeout), 1e-6)
        handle = self.lib.ls_call_start(self._handle, method.encode(), n, addrs, sizes, seconds,
                                        len(metadata), md_keys, md_values)
        call = NativeCall(self, handle, pieces, decode)
        with self.lock:
            self._calls.append(call)
        return call

    def close(self, wait_s=5.0):
        """Cancels what is in flight and frees the channel once gRPC has released every call's
        buffers (at most wait_s seconds; past that the channel and those buffers are kept for
        the life of the process rather than freed under gRPC)."""
        with self.lock:
            if self._handle is None:
                return
            for c in self._calls:
                self.lib.ls_call_cancel(c._handle)
        deadline = time.monotonic() + wait_s
        while True:
            with self.lock:
                self._calls = [c for c in self._calls if not c._release_if_done(force=True)]
                if not self._calls:
                    self.lib.ls_channel_destroy(self._handle)
                    self._handle = None
                    return
            if time.monotonic() >= deadline:
                _KEPT.append(self)
                return
            time.sleep(0.001)


_KEPT = []  # channels whose calls were still in gRPC's hands at close (see NativeChannel.close)


class NativeMethod:
    """A unary method on a NativeChannel, called like grpcio's: method(request, timeout=...,
    metadata=...) blocks and returns the decoded response; method.future(...) returns a
    NativeCall. `request` is a WireRequest (its arrays are sent in place) or a protobuf
    message."""

    def __init__(self, channel, method, decode):
        self._channel = channel
        self._method = method
        self._decode = decode

    @property
    def channel(self):
        return self._channel

    def future(self, request, timeout=None, metadata=()):
        return self._channel.start(self._method, _wire.pieces(request), timeout, metadata,
                                   self._decode)

    def __call__(self, request, timeout=None, metadata=()):
        return self.future(request, timeout, metadata).result()
