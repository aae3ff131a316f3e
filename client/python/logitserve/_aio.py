"""The asyncio client (grpc.aio): the same API as Client, with coroutines."""

import asyncio
import collections
import concurrent.futures
import time

import grpc
import grpc.aio

from . import _api, _native, _pb, _session, _wire
from ._client import _Pipelined, _SentChunks, _Settings, unencoded
from ._errors import DeadlineExceeded, LogitserveError, error_for, from_rpc_error

_RPC_ERRORS = (grpc.aio.AioRpcError, _native.NativeRpcError)


class AsyncClient:
    """asyncio logitserve client; arguments as Client. Create it inside a running event loop
    (grpc.aio channels bind to it); `async with AsyncClient(...) as c:` closes the channel.
    Chunks of a request split by the server's limits run concurrently after the first; large
    requests are pipelined over ScoreStream as in Client. Requests without tensor bytes go over
    session streams as in Client (one per concurrent task, session_streams kept while idle).
    It keeps no shared-memory channels (Client's shm_channels): a channel call waits on a futex,
    which would block the event loop, so those requests stay on session streams. Requests that
    carry arrays go through the native send path as in Client (`native`): each call (each
    pipelined chunk) is started and awaited on a thread of the client's own pool, so the event
    loop never blocks on it."""

    def __init__(self, target, token=None, tls=None, timeout=60.0, max_retries=4,
                 initial_backoff=0.1, max_backoff=2.0, backoff_multiplier=2.0,
                 load_balancing=None, admin_token=None, split_requests=True,
                 max_rows_per_request=None, channel_options=(), pipeline_chunk_bytes=4 << 20,
                 pipeline_depth=4, pipeline_streams=2, keep_large_allocations=True,
                 session_streams=8, native=None):
        self._s = _Settings(target, token, admin_token, tls, timeout, max_retries,
                            initial_backoff, max_backoff, backoff_multiplier, load_balancing,
                            split_requests, max_rows_per_request, channel_options,
                            pipeline_chunk_bytes, pipeline_depth, pipeline_streams,
                            keep_large_allocations, session_streams)
        self._channel = self._s.grpc_channel(grpc.aio)
        self._stub = _pb.pb2_grpc().ScorerStub(self._channel)
        self._score = self._channel.unary_unary(
            _wire.SCORE_METHOD, request_serializer=_wire.serialize,
            response_deserializer=_wire.parse_score_response)
        self._score_stream = self._channel.stream_stream(
            _wire.SCORE_STREAM_METHOD, request_serializer=_wire.serialize_stream_request,
            response_deserializer=_wire.parse_stream_response)
        self._health = self._channel.unary_unary(
            _api.HEALTH_METHOD, request_serializer=_api.health_request_bytes,
            response_deserializer=_api.health_status_from_bytes)
        # The native send path (logitserve/_native.py) for calls that carry arrays, and the
        # threads that wait on its calls; else ScoreStreams on grpcio connections 1.. of their
        # own for pipelined chunks (stream 0 is the main channel's).
        self._native_methods = [ch.unary(_wire.SCORE_METHOD, _wire.parse_score_response)
                                for ch in self._s.native_channels(native)]
        self._waiters = None
        self._pipeline_channels = []
        if self._native_methods:
            self._waiters = concurrent.futures.ThreadPoolExecutor(
                max(4, len(self._native_methods) * self._s.pipeline_depth),
                thread_name_prefix="logitserve-native")
        else:
            self._pipeline_channels = [self._s.grpc_channel(grpc.aio, i)
                                       for i in range(1, self._s.pipeline_streams)]
        self._pipeline_methods = [
            ch.stream_stream(_wire.SCORE_STREAM_METHOD,
                             request_serializer=_wire.serialize_stream_request,
                             response_deserializer=_wire.parse_stream_response)
            for ch in self._pipeline_channels]
        self._sessions = None
        if self._s.session_streams > 0:
            self._sessions = _session.AioSessionPool(self._score_stream, self._s.metadata(),
                                                     self._s.session_streams)
        self._limits = None
        self._limits_lock = asyncio.Lock()

    @property
    def native(self):
        """Whether Score calls with array bytes go through the native library."""
        return bool(self._native_methods)

    @property
    def target(self):
        return self._s.target

    async def close(self):
        if self._waiters is not None:
            self._waiters.shutdown(wait=True, cancel_futures=True)
        for m in self._native_methods:
            m.channel.close()
        if self._sessions is not None:
            await self._sessions.close()  # half-closes the idle streams while the channel is up
        for ch in self._pipeline_channels:
            await ch.close()
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, method, request, admin=False, timeout=None, retry=True):
        backoff = self._s.backoff()
        attempt = 0
        while True:
            try:
                return await method(request, timeout=timeout or self._s.timeout,
                                    metadata=self._s.metadata(admin))
            except _RPC_ERRORS as e:
                if (retry and e.code() == grpc.StatusCode.UNAVAILABLE
                        and attempt < self._s.max_retries):
                    attempt += 1
                    await self._wait_before_retry(backoff.step())
                    continue
                raise from_rpc_error(e) from None

    async def _wait_before_retry(self, seconds):
        # As Client: watch the channel (so it reconnects) and wait out the whole backoff.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(max(0.0, deadline - loop.time()))

    async def health(self, service=""):
        return await self._call(self._health, service)

    async def list_heads(self):
        return _api.ServerHeads(await self._call(self._stub.ListHeads,
                                                 _pb.pb2().ListHeadsRequest()))

    async def _server_limits(self):
        async with self._limits_lock:
            if self._limits is None:
                self._limits = self._s.limits(await self.list_heads())
            return self._limits

    async def score(self, head=None, hidden=None, target_ids=None, **kwargs):
        """As Client.score."""
        request, meta = _api.build_request(head=head, hidden=hidden, target_ids=target_ids, **kwargs)
        chunks = [(0, meta.rows or 0, 0, request.sequence_count())]
        if self._s.split_requests:
            max_rows, max_bytes = await self._server_limits()
            pipelined = self._s.pipeline_plan(request, meta, max_rows, max_bytes)
            if pipelined is not None:
                return await self._score_pipelined(request, meta, pipelined)
            chunks = _api.plan_chunks(request, meta, max_rows, max_bytes)
        if len(chunks) == 1:
            return _api.assemble([await self._score_once(request)], chunks, meta,
                                 request.request_id)
        async def run(chunk):
            try:
                return await self._score_once(_api.chunk_request(request, chunk))
            except LogitserveError as e:
                raise _api.chunk_error(e, chunk, meta.rows, len(chunks)) from None

        first = await run(chunks[0])
        _api.pin_versions(request, first, meta)
        rest = await asyncio.gather(*[run(c) for c in chunks[1:]])
        return _api.assemble([first] + list(rest), chunks, meta, request.request_id)

    async def _score_once(self, request):
        """As Client._score_once."""
        if self._sessions is not None and not request.arrays:
            response = await self._sessions.score(request, self._s.timeout)
            if response is not None:
                return response
        if self._native_methods and request.arrays:
            return await self._call(self._native_unary, request)
        return await self._call(self._score, request)

    async def _native_unary(self, request, timeout=None, metadata=()):
        """One unary Score through the native send path, awaited on a waiter thread."""
        loop = asyncio.get_running_loop()
        sent = _SentChunks()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return await loop.run_in_executor(
                self._waiters, _wait, sent, self._native_methods[0], request, None, deadline,
                metadata)
        except asyncio.CancelledError:
            sent.cancel_all()
            raise

    async def _score_pipelined(self, request, meta, chunks):
        """As Client._score_pipelined, on the event loop: chunk i on stream i % streams."""
        if self._native_methods:
            return await self._score_pipelined_native(request, meta, chunks)
        streams = min(len(chunks), 1 + len(self._pipeline_methods))
        responses = [None] * len(chunks)
        failed = []
        loop = asyncio.get_running_loop()
        started = [loop.time()]

        async def attempt(_request, timeout, metadata):
            started[0] = loop.time()
            responses[:] = [None] * len(chunks)
            del failed[:]
            errors, calls = [], []

            def cancel_all():
                for c in calls:
                    c.cancel()

            async def run(s):
                window = asyncio.Semaphore(self._s.pipeline_depth)

                async def gen():
                    for i in range(s, len(chunks), streams):
                        await window.acquire()
                        if failed or errors:
                            return
                        w = _api.chunk_request(request, chunks[i])
                        w.message.request_id = str(i)
                        yield w

                method = self._score_stream if s == 0 else self._pipeline_methods[s - 1]
                call = method(gen(), timeout=timeout, metadata=metadata)
                calls.append(call)
                try:
                    async for resp in call:
                        i = int(resp.request_id)
                        if resp.status_code:
                            failed.append((i, resp))
                            cancel_all()
                            return
                        responses[i] = resp.response
                        window.release()
                except grpc.aio.AioRpcError as e:
                    errors.append(e)
                    cancel_all()
                except asyncio.CancelledError:
                    if not (failed or errors):  # not cancelled by us: the caller's cancellation
                        raise
                finally:
                    window.release()

            try:
                await asyncio.gather(*(run(s) for s in range(streams)))
            except asyncio.CancelledError:
                cancel_all()
                raise
            if failed:
                return None
            real = [e for e in errors if e.code() != grpc.StatusCode.CANCELLED]
            if not real and errors and loop.time() >= started[0] + (timeout or 1e300):
                raise DeadlineExceeded("deadline of %.3f s exceeded (%d-chunk pipelined request)"
                                       % (timeout, len(chunks)))
            if real or errors:
                raise (real or errors)[0]
            return None

        await self._call(attempt, None)
        if failed:
            i, resp = min(failed, key=lambda f: f[0])
            raise _api.chunk_error(error_for(resp.status_code, resp.status_message), chunks[i],
                                   meta.rows, len(chunks)) from None
        if any(r is None for r in responses):
            raise _api.Internal("ScoreStream ended before every chunk was answered")
        _api.check_same_versions(responses, chunks)
        return _api.assemble(responses, chunks, meta, request.request_id)

    async def _score_pipelined_native(self, request, meta, chunks):
        """As Client._score_pipelined through the native send path: chunk i is a unary Score on
        native channel i % streams, started and awaited on a waiter thread, at most
        pipeline_depth unanswered per channel."""
        methods = self._native_methods
        streams = min(len(chunks), len(methods))
        window = streams * self._s.pipeline_depth
        p = _Pipelined(request, meta, chunks)
        loop = asyncio.get_running_loop()

        async def attempt(_request, timeout, metadata):
            deadline = p.start(timeout)
            sent = _SentChunks()
            pending = collections.deque()  # (chunk index, asyncio future)
            issued = 0
            try:
                while issued < len(chunks) or pending:
                    issued = p.issue(pending, issued, window, deadline, lambda j: (
                        loop.run_in_executor(self._waiters, _wait, sent, methods[j % streams],
                                             request, chunks[j], deadline, metadata)))
                    i, future = pending.popleft()
                    try:
                        p.responses[i] = await future
                    except _native.NativeRpcError as e:
                        p.chunk_failed(i, e)
                        return None
            finally:
                sent.cancel_all()
                for _, future in pending:
                    future.cancel()  # its outcome is not wanted (and not logged as unread)
            return None

        await self._call(attempt, None)
        return p.result()

    async def score_stream(self, requests, timeout=None, raise_errors=False):
        """As Client.score_stream; `requests` may be a sync or an async iterable. An async
        generator of ScoreResults."""
        metas = {}
        used = set()  # request_ids must be unique within one stream
        failure = []

        async def gen():
            try:
                if hasattr(requests, "__aiter__"):
                    i = 0
                    async for item in requests:
                        yield _register(item, i)
                        i += 1
                else:
                    for i, item in enumerate(requests):
                        yield _register(item, i)
            except Exception as e:
                failure.append(e)
                raise

        def _register(item, i):
            proto, meta = _api.request_from(item, i)
            if proto.request_id in used:
                raise ValueError("score_stream: duplicate request_id %r" % proto.request_id)
            used.add(proto.request_id)
            metas[proto.request_id] = meta
            return proto  # wrapped in a ScoreStreamRequest by _wire.serialize_stream_request

        call = self._score_stream(gen(), timeout=timeout, metadata=self._s.metadata())
        try:
            async for resp in call:
                res = _api.stream_result(resp, metas.pop(resp.request_id))
                if raise_errors:
                    res.raise_for_error()
                yield res
        except grpc.aio.AioRpcError as e:
            if failure:
                raise failure[0] from None
            raise from_rpc_error(e) from None
        finally:
            call.cancel()
        if failure:
            raise failure[0]

    async def register_shared_memory(self, name, key, offset, byte_size):
        """As Client.register_shared_memory."""
        req = _pb.pb2().RegisterSharedMemoryRequest(name=name, key=key, offset=int(offset),
                                                    byte_size=int(byte_size))
        await self._call(self._stub.RegisterSharedMemory, req)

    async def unregister_shared_memory(self, name):
        """As Client.unregister_shared_memory."""
        await self._call(self._stub.UnregisterSharedMemory,
                         _pb.pb2().UnregisterSharedMemoryRequest(name=name))

    async def load_head(self, name, weight, version=0, bias=None, dtype=None, logit_scale=0.0,
                        logits_scaling=0.0, final_logit_softcapping=0.0, chunk_bytes=1 << 20,
                        timeout=None):
        """As Client.load_head."""
        msgs = _api.load_head_chunks(name, weight, version, bias, dtype, logit_scale,
                                     logits_scaling, final_logit_softcapping, chunk_bytes)
        info = await self._call(lambda m, **kw: self._stub.LoadHead(iter(m), **kw), msgs,
                                admin=True, timeout=timeout, retry=bool(version))
        return _api.HeadInfo(info.head)


def _wait(sent, method, request, chunk, deadline, metadata):
    """On a waiter thread: starts rows `chunk` of `request` (all of it when None) on the native
    `method` and waits for its response; a call whose attempt was cancelled first is never
    started (CANCELLED)."""
    call = sent.send(method, unencoded, request, chunk, deadline, metadata)
    if call is None:
        raise _native.NativeRpcError(grpc.StatusCode.CANCELLED.value[0], "cancelled")
    return call.result()

