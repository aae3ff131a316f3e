"""Client-side pipelining of large requests (the sync client's chunks are concurrent Score calls,
the async client's go over ScoreStream): bitwise the unsplit result however the request is cut,
errors naming the row of the whole request."""

import numpy as np
import pytest

import logitserve
from conftest import H, V


def _request(n, seed=0):
    rng = np.random.default_rng(seed)
    return dict(head="policy", hidden=rng.normal(0, 1, (n, H)).astype(np.float32),
                target_ids=rng.integers(0, V, n), entropy=True, top_k=4)


def _same(a, b):
    for name in ("target_logprobs", "entropy", "top_k_ids", "top_k_logprobs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


ROW_BYTES = H * 4 + 8  # fp32 hidden + int64 ids


@pytest.mark.parametrize("chunk_rows,depth,streams", [(9, 1, 1), (9, 4, 2), (9, 2, 3), (40, 2, 2)])
def test_pipelined_equals_unsplit(server, chunk_rows, depth, streams):
    req = _request(100, seed=1)
    with logitserve.Client(server.address, pipeline_chunk_bytes=0) as c:
        whole = c.score(**req)
    with logitserve.Client(server.address, pipeline_chunk_bytes=chunk_rows * ROW_BYTES,
                           pipeline_depth=depth, pipeline_streams=streams) as c:
        piped = c.score(**req)
    assert whole.chunks == 1 and piped.chunks == -(-100 // chunk_rows)
    _same(whole, piped)


def test_pipelined_sequences_and_fallback(server):
    req = _request(60, seed=2)
    req["sequence_lengths"] = [10, 20, 0, 30]
    with logitserve.Client(server.address, pipeline_chunk_bytes=0) as c:
        whole = c.score(**req)
    with logitserve.Client(server.address, pipeline_chunk_bytes=30 * ROW_BYTES) as c:
        piped = c.score(**req)
        assert piped.chunks == 2  # {10, 20, 0}, {30}
        _same(whole, piped)
        np.testing.assert_array_equal(piped.sequence_sums.entropy, whole.sequence_sums.entropy)
    with logitserve.Client(server.address, pipeline_chunk_bytes=15 * ROW_BYTES) as c:
        unpiped = c.score(**req)  # a sequence longer than a chunk: sent unsplit
        assert unpiped.chunks == 1
        _same(whole, unpiped)


# native=None: through the native send path (the wheel ships it); False: grpcio.
@pytest.mark.parametrize("native", [None, False])
def test_pipelined_error_names_the_row_of_the_whole_request(server, native):
    req = _request(50, seed=3)
    req["hidden"][37, 2] = np.inf
    with logitserve.Client(server.address, pipeline_chunk_bytes=10 * ROW_BYTES,
                           native=native) as c:
        with pytest.raises(logitserve.InvalidArgument) as e:
            c.score(**req)
    assert "rows [30, 40) of 50" in e.value.details
    assert "row 37 contains +inf (column 2)" in e.value.details


def test_deadline_covers_every_chunk(heads):
    # 1 s per 64 rows: 20 chunks of 10 rows need >= 3 s; the timeout is 0.5 s.
    from support import Server
    import time
    with Server(heads.flags() + ["--test-fault", "slow-tile:1000"]) as s, \
            logitserve.Client(s.address, timeout=0.5, max_retries=0,
                              pipeline_chunk_bytes=10 * ROW_BYTES) as c:
        t0 = time.monotonic()
        with pytest.raises(logitserve.DeadlineExceeded):
            c.score(**_request(200, seed=4))
        assert time.monotonic() - t0 < 1.5


def test_concurrent_callers_share_the_senders(server):
    # The chunks of every caller's requests go through the client's sender threads; each result
    # is still bitwise its own request's.
    import threading
    reqs = [_request(70 + 9 * t, seed=10 + t) for t in range(4)]
    with logitserve.Client(server.address, pipeline_chunk_bytes=0) as c:
        want = [c.score(**r) for r in reqs]
    got = {}
    with logitserve.Client(server.address, pipeline_chunk_bytes=8 * ROW_BYTES, pipeline_depth=3,
                           pipeline_streams=2) as c:
        def caller(t):
            got[t] = [c.score(**reqs[t]) for _ in range(3)]

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for t in range(4):
        assert len(got[t]) == 3
        for r in got[t]:
            assert r.chunks == -(-(70 + 9 * t) // 8)
            _same(want[t], r)


def test_failed_chunk_cancels_the_chunks_in_flight(heads):
    # Chunk 0 fails validation at once while the chunks sent after it sit in a 2 s row tile on
    # the server: the client raises at once, the chunks it had sent end CANCELLED (none computes
    # to OK) and chunks past the window (8) are never sent. Chunk 0's answer can beat every
    # other chunk to the server; such a round shows nothing, so it is repeated (at most 5 times)
    # until one round had chunks in flight.
    from support import Server, settled_rpcs
    import time
    req = _request(200, seed=5)
    req["hidden"][3, 1] = np.inf
    codes = ("OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED")
    with Server(heads.flags() + ["--test-fault", "slow-tile:2000",
                                 "--metrics-listen", "127.0.0.1:0"]) as s, \
            logitserve.Client(s.address, max_retries=0, pipeline_chunk_bytes=10 * ROW_BYTES,
                              pipeline_depth=4, pipeline_streams=2) as c:
        for _ in range(5):
            # Each round counts from settled metrics to settled metrics: a cancelled chunk that
            # reaches the server late belongs to the round that sent it.
            before = settled_rpcs(s.metrics_address, "Score", codes)
            t0 = time.monotonic()
            with pytest.raises(logitserve.InvalidArgument) as e:
                c.score(**req)
            assert time.monotonic() - t0 < 1.0
            assert "rows [0, 10) of 200" in e.value.details
            assert "row 3 contains +inf" in e.value.details
            after = settled_rpcs(s.metrics_address, "Score", codes)
            counts = {k: after[k] - before[k] for k in codes}
            assert counts["INVALID_ARGUMENT"] == 1 and counts["OK"] == 0, counts
            assert counts["CANCELLED"] <= 7 and counts["DEADLINE_EXCEEDED"] == 0, counts
            if counts["CANCELLED"]:
                break
        assert counts["CANCELLED"] >= 1, "no round had a chunk in flight: %s" % counts


def test_close_stops_the_sender_threads(server):
    import threading

    def senders():
        return [t for t in threading.enumerate() if t.name.startswith("logitserve-send")]

    before = len(senders())
    c = logitserve.Client(server.address, pipeline_chunk_bytes=10 * ROW_BYTES)
    c.score(**_request(50, seed=6))
    assert len(senders()) > before
    c.close()
    assert len(senders()) == before


def test_unavailable_retries_the_whole_pipelined_request(heads, monkeypatch):
    # The server goes away between two pipelined calls and comes back on the first retry: the
    # second call's chunks (sent from the sender threads) fail UNAVAILABLE, the whole request
    # is sent again, and the result is bitwise the first call's.
    from logitserve import _api
    from support import Server, free_port
    port = free_port()
    # A short drain: the default 10 s one ran to its deadline here (the client stays connected).
    server = Server(heads.flags() + ["--drain-timeout", "0.5"], port=port).start()
    waits = []
    try:
        with logitserve.Client("127.0.0.1:%d" % port, max_retries=10, initial_backoff=0.05,
                               max_backoff=0.2, pipeline_chunk_bytes=10 * ROW_BYTES) as c:
            req = _request(60, seed=7)
            want = c.score(**req)
            assert want.chunks == 6
            server.stop()
            step = _api.Backoff.step

            def recording_step(self):
                waits.append(step(self))
                if len(waits) == 1:
                    server.start()
                return waits[-1]

            monkeypatch.setattr(_api.Backoff, "step", recording_step)
            got = c.score(**req)
        assert len(waits) >= 1 and got.chunks == 6
        _same(want, got)
    finally:
        server.stop()
