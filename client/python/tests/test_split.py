"""Automatic splitting over the server's limits: split results equal unsplit ones bit for bit."""

import numpy as np
import pytest

import logitserve
from conftest import H, H_REF, V
from logitserve import _api
from support import Server

MAX_TOKENS = 7
# Hidden [N, 64] fp32 is 256 bytes per row (+ ids); the client keeps 64 KiB of headroom, so
# this byte limit leaves room for about 60 rows per message.
MAX_BYTES = 64 * 1024 + 16 * 1024


@pytest.fixture(scope="module")
def small_server(heads):
    with Server(heads.flags() + ["--max-tokens-per-request", str(MAX_TOKENS)]) as s:
        yield s


@pytest.fixture(scope="module")
def bytes_server(heads):
    with Server(heads.flags() + ["--max-receive-message-bytes", str(MAX_BYTES)]) as s:
        yield s


def _request(n, seed=0):
    rng = np.random.default_rng(seed)
    return dict(head="policy", hidden=rng.normal(0, 1, (n, H)).astype(np.float32),
                reference_head="reference",
                reference_hidden=rng.normal(0, 1, (n, H_REF)).astype(np.float32),
                target_ids=rng.integers(0, V, (n, 2)), entropy=True, reference_entropy=True,
                forward_kl=True, reverse_kl=True, jsd_beta=0.4, top_k=3)


def _assert_same(a, b):
    for name in logitserve.ScoreResult._ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape, name
            np.testing.assert_array_equal(x, y, err_msg=name)
    for key in ("sequence_sums", "sequence_means"):
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None) == (y is None)
        if x is not None:
            for name in _api._STATS_FIELDS + ("token_count",):
                if getattr(x, name) is not None:
                    np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)


def test_split_by_row_limit_equals_unsplit(server, small_server):
    req = _request(23)
    with logitserve.Client(server.address) as big, logitserve.Client(small_server.address) as small:
        whole = big.score(**req)
        split = small.score(**req)
        assert whole.chunks == 1 and split.chunks == 4  # 7 + 7 + 7 + 2
        _assert_same(whole, split)
        # Unsplit on the small server: over its limit.
        with logitserve.Client(small_server.address, split_requests=False) as raw:
            with pytest.raises(logitserve.ResourceExhausted) as e:
                raw.score(**req)
            assert e.value.code.name == "RESOURCE_EXHAUSTED"


def test_split_at_sequence_boundaries(server, small_server):
    req = _request(20, seed=1)
    req["target_ids"][[0, 1, 9]] = -100
    req["sequence_lengths"] = [3, 4, 0, 6, 7]
    with logitserve.Client(server.address) as big, logitserve.Client(small_server.address) as small:
        whole = big.score(**req)
        split = small.score(**req)
        # Greedy packing of whole sequences into <= 7 rows: [3, 4, 0], [6], [7].
        assert split.chunks == 3
        _assert_same(whole, split)
        np.testing.assert_array_equal(split.sequence_sums.token_count, [1, 4, 0, 5, 7])
        req["sequence_lengths"] = [12, 8]
        with pytest.raises(logitserve.InvalidArgument, match="sequence_lengths"):
            small.score(**req)


def test_split_by_message_bytes_equals_unsplit(server, bytes_server):
    req = _request(300, seed=2)
    with logitserve.Client(server.address) as big, logitserve.Client(bytes_server.address) as small:
        whole = big.score(**req)
        split = small.score(**req)
        assert split.chunks > 1
        _assert_same(whole, split)


def test_split_by_client_row_cap_and_logits_mode(client):
    rng = np.random.default_rng(3)
    z = rng.normal(0, 2, (10, 100)).astype(np.float32)
    whole = client.score(logits=z, reference_logits=z[::-1].copy(), target_ids=np.arange(10),
                         forward_kl=True, sequence_lengths=[5, 5])
    with logitserve.Client(client.target, max_rows_per_request=3) as capped:
        split = capped.score(logits=z, reference_logits=z[::-1].copy(), target_ids=np.arange(10),
                             forward_kl=True)
        assert split.chunks == 4
        np.testing.assert_array_equal(split.forward_kl, whole.forward_kl)
        np.testing.assert_array_equal(split.target_logprobs, whole.target_logprobs)


def test_plan_rejects_inconsistent_rows_when_splitting():
    req, meta = _api.build_request(logits=np.zeros((10, 4), np.float32),
                                   target_ids=np.zeros(9, np.int64))
    with pytest.raises(logitserve.InvalidArgument, match="target_ids"):
        _api.plan_chunks(req, meta, 4, 0)
    assert _api.plan_chunks(req, meta, 10, 0) == [(0, 10, 0, 0)]  # no split: server validates


def test_error_in_a_chunk_names_its_rows(small_server):
    req = _request(20, seed=4)
    req["hidden"][16, 3] = np.nan  # row 16 = row 2 of the third 7-row chunk
    with logitserve.Client(small_server.address) as c:
        with pytest.raises(logitserve.InvalidArgument) as e:
            c.score(**req)
    assert "rows [14, 20) of 20" in e.value.details and "row 16" in e.value.details
    assert "hidden" in e.value.details
