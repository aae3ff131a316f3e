"""AsyncClient: the same API and the same bits as Client."""

import asyncio

import numpy as np
import pytest

import logitserve
from conftest import H, H_REF, V
from support import Server


def _req(n, seed):
    rng = np.random.default_rng(seed)
    return dict(head="policy", hidden=rng.normal(0, 1, (n, H)).astype(np.float32),
                reference_head="reference",
                reference_hidden=rng.normal(0, 1, (n, H_REF)).astype(np.float32),
                target_ids=rng.integers(0, V, n), entropy=True, forward_kl=True,
                reverse_kl=True, jsd_beta=0.5, top_k=4, sequence_lengths=[n // 3, n // 3, n - 2 * (n // 3)])


@pytest.fixture(scope="module")
def small_server(heads):
    with Server(heads.flags() + ["--max-tokens-per-request", "5"]) as s:
        yield s


def test_async_matches_sync_including_concurrent_split_chunks(server, small_server, client):
    reqs = [_req(12, s) for s in range(4)]
    want = [client.score(**r) for r in reqs]

    async def main():
        async with logitserve.AsyncClient(server.address) as a, \
                logitserve.AsyncClient(small_server.address) as b:
            assert await a.health() == "SERVING"
            heads = await a.list_heads()
            assert heads["policy"].vocab_size == V
            whole = await asyncio.gather(*[a.score(**r) for r in reqs])
            split = await asyncio.gather(*[b.score(**r) for r in reqs])
            with pytest.raises(logitserve.NotFound, match="nope"):
                await a.score(head="nope", hidden=np.ones((1, H), np.float32))
            with pytest.raises(logitserve.InvalidArgument, match="jsd_beta"):
                await a.score(logits=np.zeros((1, 3), np.float32),
                              reference_logits=np.zeros((1, 3), np.float32), jsd_beta=-0.5)
            return whole, split

    whole, split = asyncio.run(main())
    for w, x, y in zip(want, whole, split):
        assert y.chunks == 3 and x.chunks == 1  # sequences of 4 rows, 5-row limit
        for name in ("target_logprobs", "entropy", "forward_kl", "reverse_kl", "jsd",
                     "top_k_ids", "top_k_logprobs"):
            np.testing.assert_array_equal(getattr(x, name), getattr(w, name), err_msg=name)
            np.testing.assert_array_equal(getattr(y, name), getattr(w, name), err_msg=name)


def test_async_unavailable_after_retries():
    from support import free_port

    async def main():
        async with logitserve.AsyncClient("127.0.0.1:%d" % free_port(), max_retries=2,
                                          initial_backoff=0.01, max_backoff=0.02) as a:
            await a.list_heads()

    with pytest.raises(logitserve.Unavailable):
        asyncio.run(main())


# native=None: through the native send path (the wheel ships it); False: ScoreStreams on grpcio.
@pytest.mark.parametrize("native", [None, False])
def test_async_pipelined_equals_sync_and_names_rows(server, client, native):
    rng = np.random.default_rng(9)
    req = dict(head="policy", hidden=rng.normal(0, 1, (90, H)).astype(np.float32),
               target_ids=rng.integers(0, V, 90), entropy=True, top_k=3)
    want = client.score(**req)
    bad = dict(req, hidden=req["hidden"].copy())
    bad["hidden"][71, 1] = np.nan
    row_bytes = H * 4 + 8

    async def main():
        async with logitserve.AsyncClient(server.address, pipeline_chunk_bytes=8 * row_bytes,
                                          pipeline_depth=2, pipeline_streams=3,
                                          native=native) as a:
            assert a.native == (native is None)
            got = await a.score(**req)
            with pytest.raises(logitserve.InvalidArgument) as e:
                await a.score(**bad)
            return got, e.value.details

    got, details = asyncio.run(main())
    assert got.chunks == 12
    for name in ("target_logprobs", "entropy", "top_k_ids", "top_k_logprobs"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert "rows [64, 72) of 90" in details and "row 71 contains NaN" in details


@pytest.mark.parametrize("native", [None, False])
def test_async_pipelined_deadline(heads, native):
    rng = np.random.default_rng(10)
    req = dict(head="policy", hidden=rng.normal(0, 1, (200, H)).astype(np.float32),
               target_ids=rng.integers(0, V, 200))

    async def main():
        async with logitserve.AsyncClient(s.address, timeout=0.5, max_retries=0,
                                          pipeline_chunk_bytes=10 * (H * 4 + 8),
                                          native=native) as a:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(logitserve.DeadlineExceeded):
                await a.score(**req)
            return asyncio.get_running_loop().time() - t0

    # 1 s per 64 rows: 20 chunks of 10 rows need >= 3 s; the timeout is 0.5 s.
    with Server(heads.flags() + ["--test-fault", "slow-tile:1000"]) as s:
        assert asyncio.run(main()) < 1.5
