"""Shared-memory call channels for Score calls that carry no tensor bytes (issue 12, target 3).

The Python half of the protocol in common/wire/shm_channel.h (the C++ client's half is
client/shm_channel.h; this module repeats the control region's offsets, in _Control). A request
whose row tensors all live in shared memory has the server on this host, so it need not cross
gRPC at all: the client writes the serialized ScoreRequest into a control region both processes
map, bumps request_seq and wakes the server's futex, then sleeps on the response_seq futex until
the answer is in the region. No HTTP/2 frames, no grpcio completion queue, no thread hand-off.

A Channel is a POSIX shared-memory object this process creates (mode 0600, a name with 64 random
bits so that no other client can race this one to claim it, unlinked once the server has mapped
it, so nothing is left in /dev/shm) plus an OpenSharedMemoryChannel call that keeps the server's
side alive; cancelling that call closes the server's side (and cancels a request in flight).

The call is made with grpcio's core calls, as SessionStream's (logitserve/_session.py, which says
why and checks they are there): a completion queue of its own, polled only by the thread that
opens or closes the channel. grpcio's public unary_stream call would keep the channel's polling
thread running for the call's whole life (it lives as long as the channel), and that thread then
takes a share of every other call's completions: measured on the 2-core build box, a health check
of the same client went from 130 to 165-260 us, and unary Score calls slowed alike.

Waiting: futex waits in slices of at most SLICE_S, each followed by a look at the deadline and at
the region's `closed` word (the server sets it when it stops serving). A call past its deadline
writes cancel_seq (the server stops the request at its next check), raises DeadlineExceeded and
its channel is discarded: the late answer must not be taken for the next call's.

Why x86_64 only: the words are read and written with plain loads and stores (ctypes), in program
order. x86's TSO keeps stores ordered with stores and loads with loads, which is all the protocol
needs (the request bytes are visible before request_seq; response_seq is read before the answer).
Weaker memory models (aarch64) need release/acquire barriers Python cannot issue, so there the
client keeps channels off (supported() is False) and uses session streams.

Thread safety: a Channel belongs to one thread at a time (ChannelPool hands each caller its own);
only _session.Deadlines touches it from another thread while it opens, through cancel(), which
grpcio allows. ChannelPool is thread-safe.

AsyncClient does not use channels: the futex wait blocks its thread, and on the event loop that
would stall every other task; its requests without tensor bytes go over session streams.
"""

import ctypes
import itertools
import mmap
import os
import platform
import secrets
import sys
import time

import grpc

from . import _pb, _session, _wire
from ._errors import DeadlineExceeded, error_for
from ._session import DEADLINE_DETAILS, _cygrpc

try:  # CPython's own shm_open / shm_unlink (multiprocessing.shared_memory's, minus its tracker)
    import _posixshmem
except ImportError:  # pragma: no cover - not a POSIX CPython
    _posixshmem = None

OPEN_METHOD = "/logitserve.v1.Scorer/OpenSharedMemoryChannel"
MAGIC = 0x3143534C  # "LSC1"
VERSION = 1
# The areas of a channel (client/shm_channel.h's defaults): 1 MiB holds any shared-memory request
# (a few hundred bytes) and 8 MiB the answer of thousands of rows with a large top_k; a request
# whose answer could be larger goes over gRPC. Untouched pages of the object cost no memory.
REQUEST_BYTES = 1 << 20
RESPONSE_BYTES = 8 << 20
HEADER_BYTES = 4096
PAGE = 4096
# The longest futex sleep before a waiter looks at its deadline and the `closed` word again (the
# server wakes the futex when it closes the channel; this bounds a missed wake).
SLICE_S = 0.05
# How long opening a channel may take when the call has no deadline (timeout=None): a server that
# accepts the call and never answers must not hold the client forever.
OPEN_TIMEOUT_S = 10.0
# Opening refused with one of these: fall back for this call only (the server's channel limit, a
# server going away or overloaded, a token the gRPC call will report). Any other code (a server
# without channels, one that cannot see this host's objects, ...) turns channels off for the pool.
_FALL_BACK_ONCE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
                   grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED)
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# The open call's operation batches: sending the request and reading the first message, and its
# status (which comes when the call ends).
_OPEN, _STATUS = "open", "status"

_SYS_FUTEX = 202  # x86_64 (aarch64's 98 is never needed: see the module docstring)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: waiter and waker are two processes
_WAKE_ALL = 0x7FFFFFFF


class _Control(ctypes.Structure):
    """The control region's header (common/wire/shm_channel.h: offsets in bytes, little-endian,
    naturally aligned; the padding puts the client's and the server's futex words on separate
    cache lines). layout_ok() checks these offsets against the protocol's."""

    _fields_ = [
        ("magic", ctypes.c_uint32),              # 0    client, before opening
        ("version", ctypes.c_uint32),            # 4
        ("request_capacity", ctypes.c_uint64),   # 8
        ("response_capacity", ctypes.c_uint64),  # 16
        ("claimed", ctypes.c_uint32),            # 24   server (compare-and-swap)
        ("_pad0", ctypes.c_char * 36),
        ("request_seq", ctypes.c_uint32),        # 64   client; futex word
        ("cancel_seq", ctypes.c_uint32),         # 68   client
        ("request_bytes", ctypes.c_uint64),      # 72   client
        ("timeout_us", ctypes.c_uint64),         # 80   client; 0 = no deadline
        ("_pad1", ctypes.c_char * 40),
        ("response_seq", ctypes.c_uint32),       # 128  server; futex word
        ("status_code", ctypes.c_int32),         # 132  server; a gRPC code, 0 = OK
        ("response_bytes", ctypes.c_uint64),     # 136  server
        ("closed", ctypes.c_uint32),             # 144  server: 1 once it serves no more
    ]


LAYOUT = {"magic": 0, "version": 4, "request_capacity": 8, "response_capacity": 16, "claimed": 24,
          "request_seq": 64, "cancel_seq": 68, "request_bytes": 72, "timeout_us": 80,
          "response_seq": 128, "status_code": 132, "response_bytes": 136, "closed": 144}


def layout_ok():
    return all(getattr(_Control, name).offset == offset for name, offset in LAYOUT.items())


def _round_up(n):
    return -(-n // PAGE) * PAGE


REQUEST_AREA = HEADER_BYTES
RESPONSE_AREA = HEADER_BYTES + _round_up(REQUEST_BYTES)
TOTAL_BYTES = RESPONSE_AREA + _round_up(RESPONSE_BYTES)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = None


def supported():
    """Whether this process can use channels: Linux on x86_64 (see the module docstring), with
    CPython's shm_open and libc's syscall()."""
    global _syscall
    if _syscall is not None:
        return True
    if (not sys.platform.startswith("linux") or platform.machine() != "x86_64"
            or _posixshmem is None or not layout_ok()):
        return False
    try:
        f = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return False
    # ctypes releases the GIL for the call: other threads run while this one sleeps.
    f.restype = ctypes.c_long
    f.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_uint32)
    _syscall = f
    return True


class Refused(Exception):
    """The channel could not be opened: `code` (a grpc.StatusCode) and `details` say why."""

    def __init__(self, code, details):
        super().__init__("%s: %s" % (code.name, details))
        self.code = code
        self.details = details


class Broken(Exception):
    """The server closed the channel before it answered: discard it; the call may go over gRPC."""


_keys = itertools.count()


class _OpenCall:
    """The OpenSharedMemoryChannel call on a completion queue of its own (see the module
    docstring). Polled by the thread that owns the channel; cancel() may come from any thread."""

    def __init__(self, channel, request, metadata):
        metadata = tuple(metadata)
        self._code = self._details = None
        self._due = {_OPEN, _STATUS}  # batches started and not yet seen on the queue
        self._dead = False  # grpcio destroyed the queue (a signal interrupted a poll)
        self._call = channel._channel.segregated_call(
            _cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, OPEN_METHOD.encode(), None,
            None, metadata, None,
            (((_cygrpc.SendInitialMetadataOperation(metadata, 0),
               _cygrpc.SendMessageOperation(request, 0),
               _cygrpc.SendCloseFromClientOperation(0),
               _cygrpc.ReceiveInitialMetadataOperation(0),
               _cygrpc.ReceiveMessageOperation(0)), _OPEN),
             ((_cygrpc.ReceiveStatusOnClientOperation(0),), _STATUS)),
            None)

    def _next(self):
        try:
            event = self._call.next_event()
        except BaseException:
            self._dead = True
            self._due.clear()
            raise
        self._due.discard(event.tag)
        if event.tag == _STATUS:
            op = event.batch_operations[0]
            details = op.details()
            self._code = _CODES.get(op.code(), grpc.StatusCode.UNKNOWN)
            self._details = details.decode("utf-8", "replace") if isinstance(
                details, bytes) else (details or "")
        return event

    def wait_for_first_message(self):
        """Whether the server sent its first message (it serves the channel); False when the
        call ended without one (status() says why)."""
        while _OPEN in self._due:
            event = self._next()
            if event.tag == _OPEN:
                return event.success and event.batch_operations[4].message() is not None
        return False

    def status(self):
        """(grpc.StatusCode, details) of a call that ended (waits for its status)."""
        while _STATUS in self._due:
            self._next()
        if self._code is None:  # the queue is gone
            return grpc.StatusCode.UNKNOWN, "the channel call failed"
        if self._code == grpc.StatusCode.OK:
            return grpc.StatusCode.UNAVAILABLE, "the server ended the channel call unserved"
        return self._code, self._details

    def cancel(self):
        try:
            self._call.cancel(_cygrpc.StatusCode.cancelled, "shared-memory channel closed")
        except ValueError:  # the call is over
            pass

    def close(self):
        """Cancels the call and drains its queue (so grpcio frees the call)."""
        if self._due and not self._dead:
            self.cancel()
            while self._due and not self._dead:
                self._next()


class Channel:
    """One control region and the OpenSharedMemoryChannel call that serves it.

    Channel(...) creates the region, opens the call on the grpc `channel` with `metadata`, and
    waits until `deadline` (time.monotonic()) for the server's first message; it raises Refused
    when the server does not serve it by then. call() posts one request; close() cancels the
    call and unmaps the region."""

    def __init__(self, channel, metadata, deadlines, deadline, spin_s=0.0):
        self.timed_out = False  # set by `deadlines` when the open took too long
        self.closed = False  # the server closed the channel
        self._call = None
        self._spin_s = spin_s
        self._seq = 0
        self._ts = _Timespec()
        key = "/logitserve-channel-%d-%d-%s" % (os.getpid(), next(_keys), secrets.token_hex(8))
        fd = _posixshmem.shm_open(key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.ftruncate(fd, TOTAL_BYTES)  # zero-filled: claimed = 0, the seqs 0
                self._mm = mmap.mmap(fd, TOTAL_BYTES)  # MAP_SHARED, read-write
            finally:
                os.close(fd)  # the mapping keeps the object
            # The header as a ctypes view: its fields read and write the shared words in place.
            # It holds an export of the mmap, released by close() before unmapping (so the
            # mmap cannot be closed under a view still in use). No local variable refers to it:
            # an exception's traceback would keep it alive past close().
            self._ctl = _Control.from_buffer(self._mm)
            self._request_word = ctypes.addressof(self._ctl) + LAYOUT["request_seq"]
            self._response_word = ctypes.addressof(self._ctl) + LAYOUT["response_seq"]
            self._ctl.request_capacity = REQUEST_BYTES
            self._ctl.response_capacity = RESPONSE_BYTES
            self._ctl.version = VERSION
            self._ctl.magic = MAGIC
            self._open(channel, metadata, deadlines, deadline, key)
        except BaseException:
            self.close()
            raise
        finally:
            _posixshmem.shm_unlink(key)  # the server has it mapped, or never will

    def _open(self, channel, metadata, deadlines, deadline, key):
        # No deadline on the call: it lives as long as the channel. The wait for its first
        # message is bounded by `deadlines`, which cancels the call at `deadline`.
        request = _pb.pb2().OpenSharedMemoryChannelRequest(key=key).SerializeToString()
        try:
            self._call = _OpenCall(channel, request, metadata)
        except ValueError:  # grpcio's "channel closed"
            raise Refused(grpc.StatusCode.CANCELLED, "the client is closing") from None
        if not deadlines.arm(self, deadline):  # the pool is closing
            raise Refused(grpc.StatusCode.CANCELLED, "the client is closing")
        try:
            served = self._call.wait_for_first_message()
        finally:
            deadlines.disarm(self)
        if self.timed_out:  # cancelled (perhaps just as the message came): too late either way
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "opening the channel took too long")
        if not served:
            code, details = self._call.status()
            raise Refused(code, details)

    def cancel(self):
        """Cancels the channel's call (any thread); the server then closes its side."""
        if self._call is not None:
            self._call.cancel()

    def close(self):
        if self._call is not None:
            self._call.close()
        self._ctl = None  # releases the mmap export
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view still alive somewhere: unmapped when it is collected
                pass

    def call(self, wire, deadline):
        """Posts the ScoreRequest bytes `wire` (at most REQUEST_BYTES) and waits until `deadline`
        (time.monotonic(), None = no limit) for the answer: (status code, the answer's bytes: a
        ScoreResponse when the code is 0, else the error message). Raises DeadlineExceeded or
        Broken; after either (or any exception) the channel must be closed."""
        n = len(wire)
        self._mm[REQUEST_AREA:REQUEST_AREA + n] = wire
        self._ctl.request_bytes = n
        self._ctl.timeout_us = 0 if deadline is None else max(
            1, int((deadline - time.monotonic()) * 1e6))
        seq = self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._ctl.request_seq = seq  # last: the request above is complete once it is seen
        _syscall(_SYS_FUTEX, self._request_word, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
        try:
            answered = self._wait(seq, deadline)
        except BaseException:  # a signal's exception mid-wait: the request may still run
            self._ctl.cancel_seq = seq
            raise
        if not answered:
            self._ctl.cancel_seq = seq  # the server stops it at its next check
            if self.closed:
                raise Broken()
            raise DeadlineExceeded(DEADLINE_DETAILS)
        n = min(self._ctl.response_bytes, RESPONSE_BYTES)
        # A copy: the next call's answer overwrites the area.
        return self._ctl.status_code, self._mm[RESPONSE_AREA:RESPONSE_AREA + n]

    def _wait(self, seq, deadline):
        """Whether response_seq reached `seq` before `deadline` (False also when the server
        closed the channel first: self.closed)."""
        ctl = self._ctl
        if self._spin_s:  # holds the GIL: only worth it when the answer is due within the spin
            until = time.monotonic() + self._spin_s
            while ctl.response_seq != seq and time.monotonic() < until:
                pass
        ts = self._ts
        while True:
            seen = ctl.response_seq
            if seen == seq:
                return True
            if ctl.closed:
                self.closed = True
                return ctl.response_seq == seq
            left = SLICE_S
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
                if left <= 0:
                    return False
            ts.tv_sec, ts.tv_nsec = 0, int(left * 1e9)  # left <= SLICE_S < 1 s
            # Returns on a wake, when the word is no longer `seen`, on a signal or at the
            # timeout; the loop reads the word again in every case.
            _syscall(_SYS_FUTEX, self._response_word, _FUTEX_WAIT, seen, ctypes.byref(ts), None,
                     0)


_BOUNDS = {}  # ScoreRequest bytes -> response_bytes_bound (cleared when full)
_BOUNDS_MAX = 256


def response_bytes_bound(wire):
    """The most bytes the answer to the ScoreRequest bytes `wire` can serialize to, as
    ResponseBytesBound in client/shm_channel.cc: every packed float / int32 output at its full
    size (4 bytes a value; top-k ids as int32 varints, up to 5), the per-sequence outputs, and an
    allowance for tags, lengths and scalars. Kept per request bytes: a caller repeating a request
    parses it once."""
    bound = _BOUNDS.get(wire)
    if bound is not None:
        return bound
    m = _pb.pb2().ScoreRequest.FromString(wire)
    n = m.hidden.shape[0] if len(m.hidden.shape) else (
        m.logits.shape[0] if len(m.logits.shape) else 0)
    k = 0  # target ids per row
    if m.HasField("target_ids"):
        shape = m.target_ids.shape
        k = max(0, shape[1]) if len(shape) >= 2 else 1
    per_row_outputs = 6  # entropies, KLs, JSD: at most these, 4 bytes each
    per_seq = 2 * (4 * (k + per_row_outputs) + 8 + 64)  # sums and means
    bound = (max(0, n) * (4 * k + 9 * m.top_k + 4 * per_row_outputs) +
             len(m.sequence_lengths) * per_seq + len(m.request_id.encode()) + 4096)
    if len(_BOUNDS) >= _BOUNDS_MAX:
        _BOUNDS.clear()
    _BOUNDS[wire] = bound
    return bound


class ChannelPool(_session.IdlePool):
    """The idle channels of one Client (at most `size` kept, one per concurrent caller).

    score(request, timeout) answers one request without tensor bytes (a WireRequest) over an idle
    channel or a new one: the ScoreResponse, or the request's own error raised as a unary call
    raises it (the same LogitserveError type, code and message). It returns None when the call
    should go over gRPC instead: channels are off, the request or its largest answer does not fit
    a channel, a channel could not be opened, the server closed it, or the server answered
    UNAVAILABLE (draining: the gRPC path's retries with backoff apply). A call past its deadline
    raises DeadlineExceeded (its channel is discarded)."""

    def __init__(self, channel, metadata, size, spin_us=0):
        super().__init__(size)  # its deadline watchdog bounds the opens
        self._channel = channel
        self._metadata = tuple(metadata)
        self._spin_s = max(0, spin_us) / 1e6
        self._pid = os.getpid()
        self.usable = supported() and _session.supported(channel)

    def score(self, request, timeout):
        wire = _wire.serialize(request)
        if len(wire) > REQUEST_BYTES or response_bytes_bound(wire) > RESPONSE_BYTES:
            return None
        channel = None
        with self._lock:
            if self._closed or not self.usable:
                return None
            if self._pid != os.getpid():
                # A forked child: the idle channels are its parent's, and posting into one
                # would cross the parent's calls. Forgotten, not closed (the parent's to close).
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                channel = self._idle.pop()
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        if channel is None:
            try:
                channel = Channel(self._channel, self._metadata, self._deadlines,
                                  deadline if deadline is not None else now + OPEN_TIMEOUT_S,
                                  self._spin_s)
            except Refused as e:
                if e.code not in _FALL_BACK_ONCE:
                    self.usable = False
                return None
            except OSError:  # this host gives us no shared-memory object: session streams will do
                self.usable = False
                return None
        try:
            code, data = channel.call(wire, deadline)
        except Broken:
            channel.close()
            return None
        except BaseException:  # DeadlineExceeded, or a signal's exception: the channel is done
            channel.close()
            raise
        if code == _UNAVAILABLE:
            channel.close()
            return None
        if code:
            self._put_back(channel)
            raise error_for(code, data.decode("utf-8", "replace"))
        try:
            response = _wire.parse_score_response(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: the channel is off track
            channel.close()
            raise error_for(grpc.StatusCode.INTERNAL,
                            "the shared-memory channel's answer does not parse") from None
        self._put_back(channel)
        return response

