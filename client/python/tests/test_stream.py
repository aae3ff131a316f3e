"""ScoreStream: many requests on one stream, results tagged by request_id, per-request errors."""

import asyncio

import numpy as np
import pytest

import logitserve
from conftest import H, H_REF, V


def _requests():
    rng = np.random.default_rng(40)
    reqs = []
    for i in range(6):
        n = 1 + i
        reqs.append(logitserve.Request(
            request_id="r%d" % i, head="policy", hidden=rng.normal(0, 1, (n, H)).astype(np.float32),
            reference_head="reference", reference_hidden=rng.normal(0, 1, (n, H_REF)).astype(np.float32),
            target_ids=rng.integers(0, V, (n, 2)), entropy=True, forward_kl=True, jsd_beta=0.5,
            top_k=3, sequence_lengths=[n]))
    reqs.append(dict(logits=rng.normal(0, 1, (3, 50)).astype(np.float32), target_ids=[0, 1, 2]))
    return reqs


def _same(a, b):
    for name in logitserve.ScoreResult._ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)
    if a.sequence_sums is not None:
        np.testing.assert_array_equal(a.sequence_sums.entropy, b.sequence_sums.entropy)
        np.testing.assert_array_equal(a.sequence_means.target_logprobs, b.sequence_means.target_logprobs)


def test_stream_results_equal_unary_results(client):
    reqs = _requests()
    want = {}
    for i, r in enumerate(reqs):
        kwargs = dict(r.kwargs if isinstance(r, logitserve.Request) else r)
        want[kwargs.pop("request_id", None) or str(i)] = client.score(**kwargs)
    got = {res.request_id: res for res in client.score_stream(reqs)}
    assert set(got) == set(want)  # every request answered once; ids default to the index
    for rid, res in got.items():
        assert res.ok
        _same(res, want[rid])


def test_stream_per_request_errors_keep_the_stream_open(client):
    good = dict(logits=np.zeros((2, 5), np.float32), entropy=True)
    bad = dict(logits=np.zeros((2, 5), np.float32), temperature=-1.0)
    missing = dict(head="nope", hidden=np.ones((1, H), np.float32))
    results = {r.request_id: r for r in client.score_stream([good, bad, good, missing, good])}
    assert len(results) == 5
    for rid in ("0", "2", "4"):
        assert results[rid].ok and np.allclose(results[rid].entropy, np.log(5), atol=1e-6)
    assert isinstance(results["1"].error, logitserve.InvalidArgument)
    assert "temperature" in results["1"].error.details and results["1"].entropy is None
    assert isinstance(results["3"].error, logitserve.NotFound)
    with pytest.raises(logitserve.InvalidArgument, match="temperature"):
        for _ in client.score_stream([good, bad, good], raise_errors=True):
            pass


def test_stream_rejects_duplicate_ids(client):
    r = dict(logits=np.zeros((1, 3), np.float32), request_id="same")
    with pytest.raises(ValueError, match="duplicate"):
        list(client.score_stream([r, r]))


def test_async_stream(server, client):
    reqs = _requests()
    want = {res.request_id: res for res in client.score_stream(reqs)}

    async def main():
        async def agen():
            for r in reqs:
                yield r
        async with logitserve.AsyncClient(server.address) as a:
            return {res.request_id: res async for res in a.score_stream(agen())}

    got = asyncio.run(main())
    assert set(got) == set(want)
    for rid in got:
        _same(got[rid], want[rid])
