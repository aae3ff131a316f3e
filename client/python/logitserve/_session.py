"""Long-lived ScoreStreams for Score calls that carry no tensor bytes (issue 12, target 3).

A request whose row tensors all live in shared memory is a few hundred bytes, and a unary call
spends most of its fixed cost on a new HTTP/2 stream, headers, a deadline and a server call
object. Client sends such a request as one message of a ScoreStream kept open between calls
instead (the C++ client's client/session_stream.h, in Python).

Why grpcio's core calls and not `channel.stream_stream`: a grpcio stream call reads its request
iterator on a thread of its own and delivers answers from the channel's polling thread, so each
request is handed between threads (each time taking the GIL) three times: caller -> iterator thread,
polling thread -> iterator thread (write done), polling thread -> caller (answer). Measured on the
2-core build box against the real server, that made a streamed call cost more client CPU than a
unary one (docs/performance-history.md, "Python session streams"). A SessionStream is what
grpcio's own blocking unary call is made of: a call with a completion queue of its own
(`segregated_call`), written to and polled by the calling thread alone, so a request and its
answer never leave that thread. Those are grpcio internals (`grpc._cython.cygrpc`);
`supported()` checks that they are there, and without them (or when a stream cannot be started)
Client simply stays unary.

Deadline: the stream has none; each call has its own. grpcio's completion queue cannot be
polled with a timeout, so a per-client watchdog thread (`Deadlines`) cancels the stream of a call
whose deadline passed: the call then reports DEADLINE_EXCEEDED, and the stream is discarded (the
request may still run on the server; a unary call's cancellation would have stopped it).

Thread safety: a SessionStream belongs to one thread at a time (SessionPool hands each caller its
own); only `Deadlines` touches it from another thread, through cancel(), which grpcio allows.
SessionPool and Deadlines are thread-safe.

AsyncClient: AioSessionPool, the same with grpc.aio's public stream API (on the event loop a
stream call costs no extra threads, and a loop timer cancels a call's stream at its deadline).
"""

import asyncio
import threading
import time

import grpc
import grpc.aio

from . import _wire
from ._errors import DeadlineExceeded, error_for

try:  # grpcio's core binding: internal, so every use below is guarded by supported()
    from grpc._cython import cygrpc as _cygrpc
except ImportError:  # pragma: no cover - a grpcio without the Cython core
    _cygrpc = None

# The tags of a stream's operations (any hashable value works for grpcio).
_STATUS, _INITIAL_METADATA, _EXCHANGE, _HALF_CLOSE = (
    "status", "initial_metadata", "exchange", "half_close")
# How long close() waits for the server to end a half-closed stream before cancelling it.
CLOSE_GRACE_S = 2.0
# Details of the error a call past its deadline raises (grpcio's own for a unary call).
DEADLINE_DETAILS = "Deadline Exceeded"


def supported(channel):
    """Whether this grpcio has the core calls SessionStream is built on."""
    core = getattr(channel, "_channel", None)
    return (_cygrpc is not None and hasattr(core, "segregated_call") and all(
        hasattr(_cygrpc, name) for name in (
            "SendInitialMetadataOperation", "ReceiveInitialMetadataOperation",
            "ReceiveStatusOnClientOperation", "SendMessageOperation", "ReceiveMessageOperation",
            "SendCloseFromClientOperation", "PropagationConstants", "StatusCode")))


class Broken(Exception):
    """The stream failed (or was never usable): discard it; the call may go unary."""


class SessionStream:
    """One ScoreStream call, written and polled by one thread at a time.

    call() sends one ScoreRequest and returns the server's ScoreStreamResponse for it (a
    _wire.StreamResponse: the response, or the request's own error in status_code /
    status_message). It raises DeadlineExceeded when `deadline` passed first and Broken when
    the stream failed; in both cases the stream is finished (cancelled and drained) and must
    be dropped."""

    def __init__(self, channel, metadata, deadlines):
        self._deadlines = deadlines
        self._due = set()  # tags of operations started and not yet seen on the queue
        self._arrived = {}  # tag -> event, seen and not awaited yet
        self._dead = False  # grpcio destroyed the queue (a signal interrupted a poll)
        self.broken = False
        self.timed_out = False  # set by Deadlines
        self.final_status = None  # the call's status code (an int) once it is over
        flags = 0  # no wait_for_ready: fail fast, as the unary calls do
        self._call = channel._channel.segregated_call(
            _cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS,
            _wire.SCORE_STREAM_METHOD.encode(), None, None, tuple(metadata), None,
            (((_cygrpc.SendInitialMetadataOperation(tuple(metadata), flags),
               _cygrpc.ReceiveStatusOnClientOperation(0)), _STATUS),
             ((_cygrpc.ReceiveInitialMetadataOperation(0),), _INITIAL_METADATA)),
            None)
        self._due.update((_STATUS, _INITIAL_METADATA))

    def _start(self, operations, tag):
        try:
            started = self._call.operate(operations, tag)
        except ValueError:  # a call error from the core (the call is over)
            started = False
        if not started:
            raise Broken()
        self._due.add(tag)

    def _next(self):
        """Polls one event of the stream's queue (there is at least one due)."""
        try:
            event = self._call.next_event()
        except BaseException:
            # A signal handler raised inside the poll: grpcio has destroyed the call's queue.
            self._dead = True
            self._due.clear()
            self.broken = True
            raise
        self._due.discard(event.tag)
        self._arrived[event.tag] = event
        if event.tag == _STATUS:  # the call is over
            self.broken = True
            for op in event.batch_operations:
                if hasattr(op, "code"):  # the ReceiveStatusOnClient operation
                    self.final_status = op.code()
        return event

    def _await(self, tag):
        while tag not in self._arrived:
            if tag not in self._due:
                raise Broken()
            self._next()
        event = self._arrived.pop(tag)
        if not event.success:
            self.broken = True
        return event

    def call(self, wire, deadline):
        """Sends the ScoreStreamRequest bytes `wire`; waits until `deadline` (time.monotonic(),
        None = no limit) for the answer."""
        if self.broken:
            raise Broken()
        message = None
        armed = deadline is not None and self._deadlines.arm(self, deadline)
        try:
            # Write and read as one batch: one operate() and one event per call (grpcio takes
            # a lock and notifies a condition for each).
            self._start((_cygrpc.SendMessageOperation(wire, 0),
                         _cygrpc.ReceiveMessageOperation(0)), _EXCHANGE)
            event = self._await(_EXCHANGE)
            if event.success:  # both done
                message = event.batch_operations[1].message()  # None: the stream ended
        except Broken:
            pass
        finally:
            if armed:
                self._deadlines.disarm(self)
        if message is None or self.broken or self.timed_out:
            # An answer that came just as the watchdog cancelled the stream is still the answer.
            self.abort()
            if message is None:
                if self.timed_out:
                    raise DeadlineExceeded(DEADLINE_DETAILS)
                raise Broken()
        return _wire.parse_stream_response(message)

    def cancel(self):
        """Cancels the call (any thread); its operations then complete at once."""
        try:
            self._call.cancel(_cygrpc.StatusCode.cancelled, "session stream closed")
        except ValueError:
            pass

    def abort(self):
        """Cancels the call and drains its queue."""
        self.broken = True
        if self._due and not self._dead:
            self.cancel()
            self._drain()

    def close(self, grace=CLOSE_GRACE_S):
        """Ends the stream cleanly: half-closes it and waits up to `grace` seconds for the
        server to finish it (then cancels); a broken stream is cancelled. Drains the queue."""
        if self._dead or not self._due:
            return
        if self.broken:
            self.abort()
            return
        self.broken = True
        try:
            self._start((_cygrpc.SendCloseFromClientOperation(0),), _HALF_CLOSE)
        except Broken:
            self.abort()
            return
        armed = self._deadlines.arm(self, time.monotonic() + grace)
        if not armed:  # the watchdog is gone (the client is closing): do not wait unbounded
            self.cancel()
        try:
            self._drain()
        finally:
            if armed:
                self._deadlines.disarm(self)

    def _drain(self):
        while self._due and not self._dead:
            self._next()
        self._arrived.clear()


class Deadlines:
    """A watchdog thread that cancels the streams of calls past their deadline (see the module
    docstring). arm() / disarm() bracket each call; the thread starts with the first arm()."""

    def __init__(self):
        self._cond = threading.Condition()
        self._armed = {}  # stream -> deadline (time.monotonic())
        self._wake_at = None  # when the thread wakes next (None: when notified)
        self._thread = None
        self._closed = False

    def arm(self, stream, deadline):
        """Watches `stream` until disarm(); False once closed (not watched)."""
        with self._cond:
            if self._closed:
                return False
            self._armed[stream] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="logitserve-deadlines",
                                                daemon=True)
                self._thread.start()
            if self._wake_at is None or deadline < self._wake_at:
                self._wake_at = deadline
                self._cond.notify()
        return True

    def disarm(self, stream):
        with self._cond:
            self._armed.pop(stream, None)

    def _run(self):
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for stream, deadline in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[stream]
                        stream.timed_out = True
                        stream.cancel()
                self._wake_at = min(self._armed.values(), default=None)
                self._cond.wait(None if self._wake_at is None else self._wake_at - now)

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()


class IdlePool:
    """Calls kept open between Score calls (session streams, shared-memory channels): at most
    `size` idle, one taken per concurrent caller, each with its own close(); and the deadline
    watchdog of the pool's calls. Thread-safe; subclasses take from self._idle under self._lock."""

    def __init__(self, size):
        self._size = int(size)
        self._lock = threading.Lock()
        self._idle = []
        self._closed = False
        self._deadlines = Deadlines()  # its thread starts with the first deadline

    def _put_back(self, item):
        with self._lock:
            if not self._closed and len(self._idle) < self._size:
                self._idle.append(item)
                return
        item.close()

    def idle(self):
        """How many are kept open now (for tests)."""
        with self._lock:
            return len(self._idle)

    def close(self):
        """Closes every idle one (its close() says how); one in use is closed when its call
        returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for item in idle:
            item.close()
        self._deadlines.close()


class SessionPool(IdlePool):
    """The idle session streams of one Client (at most `size` kept) and their watchdog.

    score(wire, timeout) answers one request (ScoreStreamRequest bytes) over an idle stream or a
    new one: the ScoreResponse, or the request's own error raised as a unary call raises it
    (the same LogitserveError type, code and message). It returns None when the call should go
    unary instead: the stream failed, could not be started, or the server answered UNAVAILABLE
    (draining: the unary call's retries with backoff apply). A call past its deadline raises
    DeadlineExceeded. The answer's request_id is the request's own."""

    def __init__(self, channel, metadata, size):
        super().__init__(size)
        self._channel = channel
        self._metadata = tuple(metadata)
        self.usable = supported(channel)

    def score(self, wire, timeout):
        stream = None
        with self._lock:
            if self._closed or not self.usable:
                return None
            if self._idle:
                stream = self._idle.pop()
        if stream is None:
            try:
                stream = SessionStream(self._channel, self._metadata, self._deadlines)
            except (ValueError, TypeError, AttributeError):
                # A closed channel (ValueError), or a grpcio whose internals differ: stay unary.
                return None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            answer = stream.call(wire, deadline)
        except Broken:
            return None
        except BaseException:  # DeadlineExceeded, or a signal's exception: the stream is over
            stream.abort()
            raise
        if answer.status_code == grpc.StatusCode.UNAVAILABLE.value[0]:
            stream.abort()
            return None
        self._put_back(stream)
        if answer.status_code:
            raise error_for(answer.status_code, answer.status_message)
        return answer.response



class AioSessionPool:
    """SessionPool for AsyncClient (grpc.aio), with the same contract. grpc.aio runs every call
    on the event loop, so a stream needs no thread of its own and no watchdog: a ScoreStream
    call in write mode per concurrent caller (task), `write` + `read` per request, and a loop
    timer that cancels the stream at the call's own deadline. At most `size` streams are kept
    while idle. Not thread-safe (the event loop's tasks only)."""

    def __init__(self, method, metadata, size):
        self._method = method  # channel.stream_stream(ScoreStream), WireRequest serializer
        self._metadata = tuple(metadata)
        self._size = int(size)
        self._idle = []
        self._closed = False

    async def score(self, request, timeout):
        """The ScoreResponse of `request` (a WireRequest without arrays), or None: go unary."""
        if self._closed:
            return None
        call = self._idle.pop() if self._idle else self._method(metadata=self._metadata)
        # The deadline cancels the stream from a timer (cheaper than asyncio.wait_for, which
        # runs the exchange as a task of its own); the cancelled read raises CancelledError.
        expired = []
        timer = None
        if timeout is not None:
            def expire():
                expired.append(True)
                call.cancel()
            timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            await call.write(request)
            answer = await call.read()
        except BaseException as e:
            call.cancel()
            if expired:  # CancelledError (or CANCELLED) from the timer's cancellation
                raise DeadlineExceeded(DEADLINE_DETAILS) from None
            if isinstance(e, (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError)):
                return None  # the stream failed (or had ended): drop it, go unary
            raise  # the caller's own cancellation: the stream's state is unknown
        finally:
            if timer is not None:
                timer.cancel()
        if answer is grpc.aio.EOF or answer.status_code == grpc.StatusCode.UNAVAILABLE.value[0]:
            call.cancel()  # the stream ended, or the server is draining: go unary
            return None
        if expired:  # answered just as the timer fired: the answer stands, the stream is gone
            pass
        elif not self._closed and len(self._idle) < self._size:
            self._idle.append(call)
        else:
            await self._close_call(call)
        if answer.status_code:
            raise error_for(answer.status_code, answer.status_message)
        return answer.response

    @staticmethod
    async def _close_call(call, grace=CLOSE_GRACE_S):
        try:
            await call.done_writing()
            await asyncio.wait_for(call.code(), grace)
        except (asyncio.TimeoutError, grpc.RpcError, asyncio.InvalidStateError,
                grpc.aio.UsageError):
            call.cancel()

    def idle(self):
        return len(self._idle)

    async def close(self):
        """Half-closes every idle stream and waits (up to CLOSE_GRACE_S) for the server to end
        it; a stream in use is closed when its call returns."""
        self._closed = True
        idle, self._idle = self._idle, []
        await asyncio.gather(*(self._close_call(c) for c in idle))
