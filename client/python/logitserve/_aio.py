"""The asyncio client (grpc.aio): the same API as Client, with coroutines."""

import asyncio

import grpc
import grpc.aio

from . import _api, _pb
from ._client import _Settings
from ._errors import LogitserveError, from_rpc_error


class AsyncClient:
    """asyncio logitserve client; arguments as Client. Create it inside a running event loop
    (grpc.aio channels bind to it); `async with AsyncClient(...) as c:` closes the channel.
    Chunks of a split request after the first run concurrently."""

    def __init__(self, target, token=None, tls=None, timeout=60.0, max_retries=4,
                 initial_backoff=0.1, max_backoff=2.0, backoff_multiplier=2.0,
                 load_balancing=None, admin_token=None, split_requests=True,
                 max_rows_per_request=None, channel_options=()):
        self._s = _Settings(target, token, admin_token, tls, timeout, max_retries,
                            initial_backoff, max_backoff, backoff_multiplier, load_balancing,
                            split_requests, max_rows_per_request, channel_options)
        if self._s.tls is not None:
            self._channel = grpc.aio.secure_channel(self._s.target, self._s.tls.credentials(),
                                                    options=self._s.options)
        else:
            self._channel = grpc.aio.insecure_channel(self._s.target, options=self._s.options)
        self._stub = _pb.pb2_grpc().ScorerStub(self._channel)
        self._health = self._channel.unary_unary(
            _api.HEALTH_METHOD, request_serializer=_api.health_request_bytes,
            response_deserializer=_api.health_status_from_bytes)
        self._limits = None
        self._limits_lock = asyncio.Lock()

    @property
    def target(self):
        return self._s.target

    async def close(self):
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
            except grpc.aio.AioRpcError as e:
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
        chunks = [(0, meta.rows or 0, 0, len(request.sequence_lengths))]
        if self._s.split_requests:
            max_rows, max_bytes = await self._server_limits()
            chunks = _api.plan_chunks(request, meta, max_rows, max_bytes)
        if len(chunks) == 1:
            return _api.assemble([await self._call(self._stub.Score, request)], chunks, meta,
                                 request.request_id)
        async def run(chunk):
            try:
                return await self._call(self._stub.Score, _api.chunk_request(request, chunk))
            except LogitserveError as e:
                raise _api.chunk_error(e, chunk, meta.rows, len(chunks)) from None

        first = await run(chunks[0])
        _api.pin_versions(request, first, meta)
        rest = await asyncio.gather(*[run(c) for c in chunks[1:]])
        return _api.assemble([first] + list(rest), chunks, meta, request.request_id)

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
            return _pb.pb2().ScoreStreamRequest(request=proto)

        call = self._stub.ScoreStream(gen(), timeout=timeout, metadata=self._s.metadata())
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

    async def load_head(self, name, weight, version=0, bias=None, dtype=None, logit_scale=0.0,
                        logits_scaling=0.0, final_logit_softcapping=0.0, chunk_bytes=1 << 20,
                        timeout=None):
        """As Client.load_head."""
        msgs = _api.load_head_chunks(name, weight, version, bias, dtype, logit_scale,
                                     logits_scaling, final_logit_softcapping, chunk_bytes)
        info = await self._call(lambda m, **kw: self._stub.LoadHead(iter(m), **kw), msgs,
                                admin=True, timeout=timeout, retry=bool(version))
        return _api.HeadInfo(info.head)
