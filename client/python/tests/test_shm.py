"""Shared-memory inputs end to end with the Python client: SharedMemoryRegion / SharedTensor give
bitwise the results of the same values sent as bytes (which test_score checks against fp64);
bad ranges, dtypes, names and missing tokens are refused."""

import os
import threading
import time

import numpy as np
import pytest

import logitserve
from conftest import H, V
from support import Server


def _inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    bits = logitserve.to_bf16_bits(rng.normal(0, 1, (n, H)).astype(np.float32))
    ids = rng.integers(0, V, n).astype(np.int32)
    return bits, ids


def _same(a, b):
    for name in ("target_logprobs", "entropy", "top_k_ids", "top_k_logprobs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_shared_memory_equals_bytes(client):
    bits, ids = _inputs(33, seed=1)
    want = client.score(head="policy", hidden=bits, target_ids=ids, entropy=True, top_k=3)
    with logitserve.SharedMemoryRegion(client, 1 << 20) as region:
        h = region.put(bits)
        t = region.put(ids, offset=h.end)
        assert t.offset % 64 == 0 and t.dtype == "INT32" and h.dtype == "BFLOAT16"
        got = client.score(head="policy", hidden=h, target_ids=t, entropy=True, top_k=3)
        _same(got, want)
        # Written in place instead, then named; and split by the client into 8-row chunks.
        region.ndarray(bits.shape, np.uint16, offset=65536)[...] = bits
        h2 = region.tensor(65536, bits.shape, "bf16")
        with logitserve.Client(client.target, max_rows_per_request=8) as small:
            split = small.score(head="policy", hidden=h2, target_ids=t, entropy=True, top_k=3)
        assert split.chunks == 5
        _same(split, want)


def test_shared_memory_refusals(client):
    bits, ids = _inputs(4, seed=2)
    with logitserve.SharedMemoryRegion(client, 4096) as region:
        h = region.put(bits)
        past = logitserve.SharedTensor(region.name, 4096 - 8, "bf16", bits.shape)
        with pytest.raises(logitserve.InvalidArgument, match="not inside region"):
            client.score(head="policy", hidden=past, target_ids=ids)
        float_ids = logitserve.SharedTensor(region.name, h.end, "fp32", (4,))
        with pytest.raises(logitserve.InvalidArgument, match="target_ids: dtype"):
            client.score(head="policy", hidden=h, target_ids=float_ids)
        with pytest.raises(ValueError, match="outside the region"):
            region.tensor(4000, (4, H), "bf16")
        with pytest.raises(logitserve.AlreadyExists):
            client.register_shared_memory(region.name, region.key, 0, 16)
        with pytest.raises(logitserve.InvalidArgument):
            client.register_shared_memory("other-" + region.name, region.key, 0, 8192)
        name = region.name
    with pytest.raises(logitserve.NotFound):
        client.score(head="policy", hidden=h, target_ids=ids)
    with pytest.raises(logitserve.NotFound):
        client.unregister_shared_memory(name)


def test_tokens_are_required(heads, tmp_path):
    token = tmp_path / "token"
    token.write_text("py-shm-token\n")
    bits, ids = _inputs(2, seed=3)
    with Server(heads.flags() + ["--auth-token-file", str(token)]) as s:
        with logitserve.Client(s.address, token="py-shm-token") as ok, \
                logitserve.Client(s.address, max_retries=0) as anonymous:
            with logitserve.SharedMemoryRegion(ok, 4096) as region:
                h = region.put(bits)
                with pytest.raises(logitserve.Unauthenticated):
                    anonymous.register_shared_memory("x-" + region.name, region.key, 0, 64)
                with pytest.raises(logitserve.Unauthenticated):
                    anonymous.score(head="policy", hidden=h, target_ids=ids)
                with pytest.raises(logitserve.Unauthenticated):
                    anonymous.unregister_shared_memory(region.name)
                ok.score(head="policy", hidden=h, target_ids=ids)  # still registered


def test_close_waits_for_a_request_in_flight(heads):
    bits, ids = _inputs(128, seed=4)
    with Server(heads.flags() + ["--test-fault", "slow-tile:300"]) as s, \
            logitserve.Client(s.address) as c:
        want = c.score(head="policy", hidden=bits, target_ids=ids, entropy=True)
        region = logitserve.SharedMemoryRegion(c, 1 << 20)
        h, t = region.put(bits), None
        t = region.put(ids, offset=h.end)
        result, done = {}, {}

        def run():
            result["r"] = c.score(head="policy", hidden=h, target_ids=t, entropy=True)
            done["t"] = time.monotonic()

        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(0.2)
        region.close()
        closed = time.monotonic()
        worker.join()
        assert done["t"] - closed < 0.05, "close() returned while the request read the region"
        _same(result["r"], want)
        assert not os.path.exists("/dev/shm" + region.key)


def test_async_client_region(server, client):
    import asyncio
    bits, ids = _inputs(20, seed=5)
    want = client.score(head="policy", hidden=bits, target_ids=ids, entropy=True, top_k=3)

    async def main():
        async with logitserve.AsyncClient(server.address) as a:
            async with await logitserve.SharedMemoryRegion.create(a, 1 << 16) as region:
                h = region.put(bits)
                t = region.put(ids, offset=h.end)
                got = await a.score(head="policy", hidden=h, target_ids=t, entropy=True, top_k=3)
                name = region.name
            with pytest.raises(logitserve.NotFound):
                await a.unregister_shared_memory(name)
            return got

    _same(asyncio.run(main()), want)
