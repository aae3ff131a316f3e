"""The blocking client."""

import collections
import concurrent.futures
import threading
import time

import grpc

from . import _api, _malloc, _native, _pb, _session, _shm_channel, _wire
from ._errors import DeadlineExceeded, LogitserveError, from_rpc_error


# Threads encoding and issuing pipelined chunks (Client._senders), shared by the client's callers:
# max(MIN_SENDER_THREADS, pipeline_streams). Two let one chunk's copy into its request bytes and
# its socket write (both without the GIL) overlap the next chunk's copy by grpcio (under it).
MIN_SENDER_THREADS = 2


class _SentChunks:
    """The grpcio futures of one pipelined attempt's chunks, issued from sender threads, so that
    cancel_all() reaches every chunk: those already sent, and one a sender is sending right then
    (it sees the flag once its future exists and cancels it). A chunk not yet sent is not sent."""

    def __init__(self):
        self._lock = threading.Lock()
        self._futures = []
        self._cancelled = False

    def send(self, method, encode, request, chunk, deadline, metadata):
        """Encodes rows `chunk` of `request` (all of it when None) with `encode` and issues it
        (runs on a sender thread); returns the future (grpcio's or a NativeCall), or None once
        the attempt was cancelled."""
        if self._cancelled:  # read without the lock: at worst one more chunk is encoded
            return None
        wire = encode(request if chunk is None else _api.chunk_request(request, chunk))
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        future = method.future(wire, timeout=timeout, metadata=metadata)
        with self._lock:
            self._futures.append(future)
            if self._cancelled:
                future.cancel()
        return future

    def cancel_all(self):
        with self._lock:
            self._cancelled = True
            futures = list(self._futures)
        for f in futures:
            f.cancel()  # a no-op for finished calls


def unencoded(request):
    """The native send path's "encoding": it sends the request's pieces, arrays in place."""
    return request


class _Pipelined:
    """What the sync and async pipelined loops share: the chunks' responses, the first failed
    chunk, and what a chunk's RPC error means for the attempt."""

    def __init__(self, request, meta, chunks):
        self.request, self.meta, self.chunks = request, meta, chunks
        self.responses = [None] * len(chunks)
        self.failed = []
        self.timeout = None

    def start(self, timeout):
        """Starts an attempt (a retried one starts over); returns its deadline (monotonic)."""
        self.responses[:] = [None] * len(self.chunks)
        del self.failed[:]
        self.timeout = timeout
        return None if timeout is None else time.monotonic() + timeout

    def expired(self):
        return DeadlineExceeded("deadline of %.3f s exceeded (%d-chunk pipelined request)"
                                % (self.timeout, len(self.chunks)))

    def check_deadline(self, deadline):
        if deadline is not None and deadline <= time.monotonic():
            raise self.expired()

    def issue(self, pending, issued, window, deadline, submit):
        """Starts chunks from `issued` on while fewer than `window` are unanswered, each as
        (i, submit(i)) at the end of `pending`, checking the deadline before each; returns the
        next chunk to start."""
        while issued < len(self.chunks) and len(pending) < window:
            self.check_deadline(deadline)
            pending.append((issued, submit(issued)))
            issued += 1
        return issued

    def chunk_failed(self, i, e):
        """Chunk i's RPC error `e`: UNAVAILABLE is raised (the whole request is retried: Score
        is idempotent), a passed deadline raised as the request's; anything else is recorded and
        the attempt stops."""
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            raise e
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.timeout:
            raise self.expired() from None
        self.failed.append((i, from_rpc_error(e)))

    def result(self):
        """The assembled ScoreResult, or the first failed chunk's error naming its rows."""
        if self.failed:
            i, error = self.failed[0]
            raise _api.chunk_error(error, self.chunks[i], self.meta.rows,
                                   len(self.chunks)) from None
        _api.check_same_versions(self.responses, self.chunks)
        return _api.assemble(self.responses, self.chunks, self.meta, self.request.request_id)


class TlsConfig:
    """TLS settings. PEM contents (bytes or str): root_certs=None uses the system roots; a client
    certificate and key (both or neither) enable mutual TLS. TlsConfig.from_files reads paths."""

    def __init__(self, root_certs=None, client_cert=None, client_key=None):
        if (client_cert is None) != (client_key is None):
            raise ValueError("TlsConfig: client_cert and client_key must be given together")
        enc = lambda v: v.encode() if isinstance(v, str) else v  # noqa: E731
        self.root_certs = enc(root_certs)
        self.client_cert = enc(client_cert)
        self.client_key = enc(client_key)

    @classmethod
    def from_files(cls, root_certs=None, client_cert=None, client_key=None):
        read = lambda p: None if p is None else open(p, "rb").read()  # noqa: E731
        return cls(read(root_certs), read(client_cert), read(client_key))

    def credentials(self):
        return grpc.ssl_channel_credentials(root_certificates=self.root_certs,
                                            private_key=self.client_key,
                                            certificate_chain=self.client_cert)


def _tls_config(tls):
    if tls is None or tls is False:
        return None
    return TlsConfig() if tls is True else tls


class _Settings:
    """Construction arguments shared by Client and AsyncClient."""

    def __init__(self, target, token, admin_token, tls, timeout, max_retries, initial_backoff,
                 max_backoff, backoff_multiplier, load_balancing, split_requests,
                 max_rows_per_request, channel_options, pipeline_chunk_bytes=4 << 20,
                 pipeline_depth=4, pipeline_streams=2, keep_large_allocations=True,
                 session_streams=8):
        if max_retries < 0 or initial_backoff < 0 or max_backoff < initial_backoff or \
                backoff_multiplier < 1:
            raise ValueError("need max_retries >= 0, 0 <= initial_backoff <= max_backoff and "
                             "backoff_multiplier >= 1")
        self.target, self.lb_policy = _api.resolve_target(target, load_balancing)
        self.token = token
        self.admin_token = admin_token
        self.tls = _tls_config(tls)
        self.timeout = timeout
        self.max_retries = max_retries
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.backoff_multiplier = backoff_multiplier
        self.split_requests = split_requests
        self.max_rows_per_request = max_rows_per_request
        self.pipeline_chunk_bytes = int(pipeline_chunk_bytes or 0)
        self.pipeline_depth = max(1, int(pipeline_depth))
        self.pipeline_streams = max(1, int(pipeline_streams))
        if session_streams is None or int(session_streams) < 0:
            raise ValueError("session_streams must be >= 0")
        self.session_streams = int(session_streams)
        self.options = _api.channel_options(self.lb_policy, initial_backoff, max_backoff,
                                            channel_options)
        if keep_large_allocations:
            _malloc.keep_large_allocations()

    def metadata(self, admin=False):
        token = self.admin_token if (admin and self.admin_token) else self.token
        return (("authorization", "Bearer " + token),) if token else ()

    def backoff(self):
        return _api.Backoff(self.initial_backoff, self.max_backoff, self.backoff_multiplier)

    def native_channels(self, native):
        """The native send path's channels (one per pipeline stream, each its own connection),
        or [] when `native` is False or its library does not load (ValueError then when
        `native` is True)."""
        if native is False:
            return []
        lib = _native.library()
        if lib is None:
            if native:
                raise ValueError("native=True, but the native library is unusable: "
                                 + _native.load_error())
            return []
        return [_native.NativeChannel(lib, self.target, self.stream_options(i), self.tls)
                for i in range(self.pipeline_streams)]

    def stream_options(self, i):
        """Channel options of pipeline stream i: stream 0 is the client's main connection; every
        other one gets a connection of its own (a local subchannel pool, an argument that tells
        it apart)."""
        if i == 0:
            return list(self.options)
        return list(self.options) + [("grpc.use_local_subchannel_pool", 1),
                                     ("logitserve.pipeline_stream", i)]

    def grpc_channel(self, grpc_module, i=0):
        """A grpcio channel (`grpc_module`: grpc or grpc.aio) for pipeline stream i."""
        if self.tls is not None:
            return grpc_module.secure_channel(self.target, self.tls.credentials(),
                                              options=self.stream_options(i))
        return grpc_module.insecure_channel(self.target, options=self.stream_options(i))

    def pipeline_plan(self, request, meta, max_rows, max_bytes):
        """The chunks of a pipelined request, or None when it is not pipelined (small, no array
        bytes, or a sequence longer than a pipeline chunk)."""
        per_row = _api.row_bytes(request, meta)
        if not (self.split_requests and self.pipeline_chunk_bytes and per_row):
            return None
        chunk_rows = max(1, self.pipeline_chunk_bytes // per_row)
        if meta.rows <= chunk_rows:
            return None
        try:
            chunks = _api.plan_chunks(request, meta, min(max_rows or chunk_rows, chunk_rows),
                                      max_bytes)
        except LogitserveError:
            return None
        return chunks if len(chunks) > 1 else None

    def limits(self, heads):
        max_rows = heads.max_tokens_per_request or 0
        if self.max_rows_per_request:
            max_rows = min(max_rows, self.max_rows_per_request) if max_rows else self.max_rows_per_request
        return max_rows, heads.max_receive_message_bytes or 0


class Client:
    """Blocking logitserve client. Thread-safe; one channel.

    Client(target, token=None, tls=None, timeout=60.0, max_retries=4, ...)
      target         "host:port"; several IP addresses (list or "a:p,b:p"); or a gRPC URI such as
                     "dns:///name:port". Several addresses and dns: targets use round_robin.
      token          bearer token sent on every RPC; admin_token (default: token) on load_head
      tls            None (plaintext), True (system roots) or a TlsConfig
      timeout        deadline of each RPC attempt, seconds (each chunk of a split request)
      max_retries    retries after UNAVAILABLE, waiting initial_backoff * multiplier^k (capped at
                     max_backoff, 20% jitter) in between
      load_balancing gRPC lb policy name; default round_robin for several addresses, else pick_first
      split_requests split Score requests over the server's max_tokens_per_request /
                     max_receive_message_bytes (from ListHeads, fetched once)
      pipeline_chunk_bytes, pipeline_depth, pipeline_streams
                     a request whose row arrays exceed pipeline_chunk_bytes (4 MiB) is sent as
                     chunks of about that size, unary Score calls spread over pipeline_streams
                     (2) connections, pipeline_depth (4) unanswered per connection, so transfer
                     and compute overlap; results are bitwise those of one request. 0 = off.
                     The chunks are encoded and sent by max(2, pipeline_streams) sender threads
                     of the client (started by the first pipelined call, stopped by close()).
      keep_large_allocations
                     True (default): on glibc, fix malloc's mmap / trim thresholds once per
                     process (32 MiB / 256 MiB) so that sending many-MiB requests reuses heap
                     memory instead of page-faulting fresh memory on every call (the process
                     keeps up to 256 MiB of freed heap per malloc arena). Skipped when the
                     process sets its own (GLIBC_TUNABLES, MALLOC_*_) or
                     LOGITSERVE_KEEP_LARGE_ALLOCATIONS=0. See logitserve/_malloc.py.
      session_streams
                     a Score call that carries no tensor bytes (every row tensor a SharedTensor;
                     each chunk of one split by the server's limits too) goes as one message of
                     a ScoreStream kept open between calls instead of a unary Score (less fixed
                     cost per call; docs/performance-history.md, "Python session streams"): one
                     stream per concurrent caller thread, at most session_streams (8) kept open
                     while idle; 0 = always unary. Each call keeps its own deadline
                     (`timeout`; past it: DeadlineExceeded, and that stream is discarded; the
                     server may still run the request), a request's own error is raised as the
                     unary call raises it, and a stream that fails is dropped and the call goes
                     unary (with its retries). Results are those of unary calls, bit for bit. See
                     logitserve/_session.py.
      shm_channels   such a call goes first over a shared-memory call channel when the server is
                     on this host (it reads the request from, and answers into, a region both
                     processes map; a futex wakes each side: no gRPC round trip per call): one
                     channel per concurrent caller thread, at most shm_channels (8) kept open
                     while idle; 0 = off. Deadlines and errors as for session streams (past the
                     deadline the server is also asked to stop the request). When the server
                     cannot serve channels (an older server, one on another host, a message limit
                     below the 1 MiB request area) they are turned off for this client; when it
                     refuses one for now (its channel limit, draining) or closes one, that call
                     goes on over a session stream (else unary), as does a request whose answer
                     could exceed the 8 MiB response area. Linux on x86_64 only (elsewhere always
                     off); AsyncClient has none. See logitserve/_shm_channel.py.
      shm_channel_spin_us
                     how long a channel call spins (holding the GIL) for its answer before it
                     sleeps on the futex, microseconds (default 0: sleep at once)
      native         Score calls that carry array bytes (unary, and each pipelined chunk) go
                     through the package's native library (gRPC C++, logitserve/_native.py):
                     the arrays are sent in place, without grpcio's copy and without the GIL.
                     None (default): when the library loads (the build's wheel ships it;
                     $LOGITSERVE_NATIVE_LIB; LOGITSERVE_NATIVE=0 turns it off); True: required
                     (ValueError without it); False: grpcio for every call. Its connections are
                     its own (pipeline_streams of them); results are bitwise the same.
    """

    def __init__(self, target, token=None, tls=None, timeout=60.0, max_retries=4,
                 initial_backoff=0.1, max_backoff=2.0, backoff_multiplier=2.0,
                 load_balancing=None, admin_token=None, split_requests=True,
                 max_rows_per_request=None, channel_options=(), pipeline_chunk_bytes=4 << 20,
                 pipeline_depth=4, pipeline_streams=2, keep_large_allocations=True,
                 session_streams=8, shm_channels=8, shm_channel_spin_us=0, native=None):
        if shm_channels is None or int(shm_channels) < 0 or shm_channel_spin_us < 0:
            raise ValueError("shm_channels and shm_channel_spin_us must be >= 0")
        self._s = _Settings(target, token, admin_token, tls, timeout, max_retries,
                            initial_backoff, max_backoff, backoff_multiplier, load_balancing,
                            split_requests, max_rows_per_request, channel_options,
                            pipeline_chunk_bytes, pipeline_depth, pipeline_streams,
                            keep_large_allocations, session_streams)
        self._channel = self._s.grpc_channel(grpc)
        self._stub = _pb.pb2_grpc().ScorerStub(self._channel)
        # Score and ScoreStream with the copy-saving request encoding and array decoding.
        self._score = self._channel.unary_unary(
            _wire.SCORE_METHOD, request_serializer=_wire.serialize,
            response_deserializer=_wire.parse_score_response)
        self._score_stream = self._channel.stream_stream(
            _wire.SCORE_STREAM_METHOD, request_serializer=_wire.serialize_stream_request,
            response_deserializer=_wire.parse_stream_response)
        self._health = self._channel.unary_unary(
            _api.HEALTH_METHOD, request_serializer=_api.health_request_bytes,
            response_deserializer=_api.health_status_from_bytes)
        # Score calls that carry array bytes, and the pipelined chunks' methods (see
        # _score_pipelined): through the native send path's connections where it loads, else
        # on grpcio connections 1.. of their own, chunks encoded (bytes: no request serializer).
        self._native_channels = self._s.native_channels(native)
        self._pipeline_channels = []
        if self._native_channels:
            self._pipeline_byte_methods = [ch.unary(_wire.SCORE_METHOD, _wire.parse_score_response)
                                           for ch in self._native_channels]
            self._score_bytes = self._pipeline_byte_methods[0]
            self._pipeline_encode = unencoded
        else:
            self._pipeline_channels = [self._s.grpc_channel(grpc, i)
                                       for i in range(1, self._s.pipeline_streams)]
            self._pipeline_byte_methods = [
                ch.unary_unary(_wire.SCORE_METHOD, request_serializer=None,
                               response_deserializer=_wire.parse_score_response)
                for ch in [self._channel] + self._pipeline_channels]
            self._score_bytes = self._score
            self._pipeline_encode = _wire.serialize
        self._sender_pool = None
        # Session streams for requests without tensor bytes (on the main channel).
        self._sessions = None
        if self._s.session_streams > 0:
            self._sessions = _session.SessionPool(self._channel, self._s.metadata(),
                                                  self._s.session_streams)
        # Shared-memory channels for the same requests (tried first; on the main channel).
        self._channels = None
        if int(shm_channels) > 0 and _shm_channel.supported():
            self._channels = _shm_channel.ChannelPool(self._channel, self._s.metadata(),
                                                      int(shm_channels), shm_channel_spin_us)
        self._limits = None
        self._lock = threading.Lock()

    @property
    def native(self):
        """Whether Score calls with array bytes go through the native library."""
        return bool(self._native_channels)

    @property
    def target(self):
        return self._s.target

    def close(self):
        with self._lock:
            pool, self._sender_pool = self._sender_pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for ch in self._native_channels:
            ch.close()
        if self._channels is not None:
            self._channels.close()  # cancels the idle channels' calls
        if self._sessions is not None:
            self._sessions.close()  # half-closes the idle streams while the channel is up
        for ch in self._pipeline_channels:
            ch.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, admin=False, timeout=None, retry=True):
        backoff = self._s.backoff()
        attempt = 0
        while True:
            try:
                return method(request, timeout=timeout or self._s.timeout,
                              metadata=self._s.metadata(admin))
            except grpc.RpcError as e:
                if (retry and e.code() == grpc.StatusCode.UNAVAILABLE
                        and attempt < self._s.max_retries):
                    attempt += 1
                    self._wait_before_retry(backoff.step())
                    continue
                raise from_rpc_error(e) from None

    def _wait_before_retry(self, seconds):
        # The sync API drives reconnection only while a call is in progress, so a plain sleep
        # would leave a failed channel failed: wait inside a wait_for_ready health check, which
        # connects as soon as the server is back. The rest of the backoff is slept even when it
        # connects early (a draining server is connected but still answers UNAVAILABLE).
        deadline = time.monotonic() + seconds
        if seconds > 0:
            try:
                self._health("", timeout=seconds, wait_for_ready=True,
                             metadata=self._s.metadata())
            except grpc.RpcError:
                pass
        time.sleep(max(0.0, deadline - time.monotonic()))

    def health(self, service=""):
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", ... ("" = the whole server)."""
        return self._call(self._health, service)

    def list_heads(self):
        """ServerHeads: the heads (HeadInfo), the backend and the server's limits."""
        return _api.ServerHeads(self._call(self._stub.ListHeads, _pb.pb2().ListHeadsRequest()))

    def _server_limits(self):
        with self._lock:
            if self._limits is None:
                self._limits = self._s.limits(self.list_heads())
            return self._limits

    def score(self, head=None, hidden=None, target_ids=None, **kwargs):
        """Scores N token rows; returns a ScoreResult (numpy arrays named as ScoreResponse).

        Inputs: head + hidden [N, H], or logits [N, V]; reference_head + reference_hidden or
        reference_logits; target_ids [N] or [N, K] (int); float arrays travel as `dtype`
        (None = as given: float32 -> fp32, float16 -> fp16, uint16 = bf16 bits; "bf16" rounds to
        nearest even). Outputs: entropy, reference_entropy, forward_kl (KL(q||p)), reverse_kl
        (KL(p||q)), jsd_beta, top_k; temperature / reference_temperature; ignore_index (default
        -100); sequence_lengths; head_version / reference_head_version pins.
        """
        request, meta = _api.build_request(head=head, hidden=hidden, target_ids=target_ids, **kwargs)
        chunks = [(0, meta.rows or 0, 0, request.sequence_count())]
        if self._s.split_requests:
            max_rows, max_bytes = self._server_limits()
            pipelined = self._s.pipeline_plan(request, meta, max_rows, max_bytes)
            if pipelined is not None:
                return self._score_pipelined(request, meta, pipelined)
            chunks = _api.plan_chunks(request, meta, max_rows, max_bytes)
        if len(chunks) == 1:
            return _api.assemble([self._score_once(request)], chunks, meta, request.request_id)
        responses = []
        for i, chunk in enumerate(chunks):
            try:
                responses.append(self._score_once(_api.chunk_request(request, chunk)))
            except LogitserveError as e:
                raise _api.chunk_error(e, chunk, meta.rows, len(chunks)) from None
            if i == 0:
                _api.pin_versions(request, responses[0], meta)
        return _api.assemble(responses, chunks, meta, request.request_id)

    def _score_once(self, request):
        """One Score call's response. A request that carries no tensor bytes goes over a
        shared-memory channel (logitserve/_shm_channel.py), else over a session stream
        (logitserve/_session.py), each when the client keeps them; every other request, and one
        those paths could not answer, goes unary."""
        if not request.arrays:
            if self._channels is not None:
                response = self._channels.score(request, self._s.timeout)
                if response is not None:
                    return response
            if self._sessions is not None:
                response = self._sessions.score(_wire.serialize_stream_request(request),
                                                self._s.timeout)
                if response is not None:
                    return response
        return self._call(self._score_bytes if request.arrays else self._score, request)

    def _score_pipelined(self, request, meta, chunks):
        """The chunks as unary Score calls kept in flight together: chunk i on connection
        i % pipeline_streams, at most pipeline_depth unanswered per connection, so the server
        computes one chunk while the next are on the wire. Results are collected in chunk
        order on this thread.

        Each chunk is encoded and issued (as a grpcio future) on one of the client's sender
        threads (_senders), not on this one. Through the native send path (the default where
        its library loads; logitserve/_native.py) a chunk is its encoded prefix plus the rows in
        place, started and awaited without the GIL. Through grpcio: per chunk the client copies
        the rows once into the request bytes (one bytes.join of a small protobuf prefix and the
        rows' memory, which releases the GIL while it copies more than 1 MiB); grpcio copies those bytes into a slice under the GIL, and gRPC's transport then
        usually writes them to the socket on the same thread, without the GIL. With one issuing
        thread those three steps of every chunk add up; with two, one chunk's copy into the
        request and its socket write overlap the next chunk's grpcio copy. (A ScoreStream per
        call instead costs grpcio's request-iterator thread and, with the GIL, doubled the CPU
        per request: 10.6-12.3 ms vs 5.7-7.3 ms unsplit for 1024 x 4096 bf16 rows, measured.)

        The deadline (timeout) covers every chunk. A failed chunk cancels the rest (the server
        drops them), also chunks a sender is issuing at that moment, and raises its error naming
        the rows of the whole request; UNAVAILABLE retries the whole request."""
        methods = self._pipeline_byte_methods
        streams = min(len(chunks), len(methods))
        window = streams * self._s.pipeline_depth
        p = _Pipelined(request, meta, chunks)
        senders = self._senders()

        def attempt(_request, timeout, metadata):
            deadline = p.start(timeout)
            sent = _SentChunks()
            pending = collections.deque()  # (chunk index, sender task -> grpcio future)
            issued = 0
            try:
                while issued < len(chunks) or pending:
                    issued = p.issue(pending, issued, window, deadline, lambda j: senders.submit(
                        sent.send, methods[j % streams], self._pipeline_encode, request,
                        chunks[j], deadline, metadata))
                    i, task = pending.popleft()
                    try:
                        p.responses[i] = task.result().result()
                    except grpc.RpcError as e:
                        p.chunk_failed(i, e)
                        return None
            finally:
                sent.cancel_all()
                for _, task in pending:
                    task.cancel()  # not started: never sent
            return None

        self._call(attempt, None)
        return p.result()

    def _senders(self):
        """The client's sender threads (created on the first pipelined call)."""
        with self._lock:
            if self._sender_pool is None:
                self._sender_pool = concurrent.futures.ThreadPoolExecutor(
                    max(MIN_SENDER_THREADS, self._s.pipeline_streams),
                    thread_name_prefix="logitserve-send")
            return self._sender_pool

    def register_shared_memory(self, name, key, offset, byte_size):
        """Registers bytes [offset, offset + byte_size) of the POSIX shared-memory object `key`
        ("/name") on the server as region `name` (see SharedMemoryRegion, which does this)."""
        req = _pb.pb2().RegisterSharedMemoryRequest(name=name, key=key, offset=int(offset),
                                                    byte_size=int(byte_size))
        self._call(self._stub.RegisterSharedMemory, req)

    def unregister_shared_memory(self, name):
        """Drops region `name`; returns once no request reads it any more."""
        self._call(self._stub.UnregisterSharedMemory,
                   _pb.pb2().UnregisterSharedMemoryRequest(name=name))

    def score_stream(self, requests, timeout=None, raise_errors=False):
        """Sends many requests on one ScoreStream RPC; yields ScoreResults in completion order,
        each tagged with its request_id (the request's index when it has none).

        `requests`: an iterable of logitserve.Request or dicts of score() arguments (consumed
        lazily). A request that fails yields a result with `.error` set (or raises it when
        raise_errors=True); a failure of the stream itself raises. Requests are not split.
        `timeout` bounds the whole stream (None = no deadline)."""
        metas = {}
        used = set()  # request_ids must be unique within one stream
        failure = []

        def gen():
            try:
                for i, item in enumerate(requests):
                    proto, meta = _api.request_from(item, i)
                    if proto.request_id in used:
                        raise ValueError("score_stream: duplicate request_id %r" % proto.request_id)
                    used.add(proto.request_id)
                    metas[proto.request_id] = meta
                    yield proto
            except Exception as e:  # surfaced on the caller's side below
                failure.append(e)
                raise

        call = self._score_stream(gen(), timeout=timeout, metadata=self._s.metadata())
        try:
            for resp in call:
                res = _api.stream_result(resp, metas.pop(resp.request_id))
                if raise_errors:
                    res.raise_for_error()
                yield res
        except grpc.RpcError as e:
            if failure:
                raise failure[0] from None
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once finished; ends the RPC when the caller stops early
        if failure:
            raise failure[0]

    def load_head(self, name, weight, version=0, bias=None, dtype=None, logit_scale=0.0,
                  logits_scaling=0.0, final_logit_softcapping=0.0, chunk_bytes=1 << 20,
                  timeout=None):
        """Uploads weight [V, H] (and bias [V]) as a new version of head `name` (LoadHead, admin
        token); returns the installed HeadInfo. version 0 = current + 1. dtype as in score
        (None: float32 -> fp32, float16 -> fp16, uint16 = bf16 bits; "bf16" rounds). Retried on
        UNAVAILABLE only with an explicit version (a repeat cannot install twice)."""
        msgs = _api.load_head_chunks(name, weight, version, bias, dtype, logit_scale,
                                     logits_scaling, final_logit_softcapping, chunk_bytes)
        info = self._call(lambda m, **kw: self._stub.LoadHead(iter(m), **kw), msgs, admin=True,
                          timeout=timeout, retry=bool(version))
        return _api.HeadInfo(info.head)
