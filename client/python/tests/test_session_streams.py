"""Session streams (logitserve/_session.py) against the real server: a Score call without tensor
bytes goes as one message of a ScoreStream kept open between calls. The server counts every
request a ScoreStream carried (logitserve_requests_total{method="ScoreStream"}) apart from the
unary Score calls, and every stream it holds open as a call state created and not yet released;
those counters show which path a call took. Every Client here keeps no shared-memory channels
(shm_channels=0): those would carry these calls first (test_shm_channel.py)."""

import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

import logitserve
from logitserve import _api
from conftest import H, V
from support import (Server, assert_same_bits, concurrent_calls, finished_rpcs, free_port,
                     random_inputs)

ROWS = 12


def _inputs(n, seed):
    return random_inputs(n, seed, H, V)


def _bits(a):
    return None if a is None else a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint8)


def _open_call_states(metrics_address):
    """Call states the server created and has not released: its open streams and RPCs."""
    text = urllib.request.urlopen("http://%s/metrics" % metrics_address, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("logitserve_call_states_"):
            name, value = line.split()
            values[name] = int(float(value))
    return (values["logitserve_call_states_created_total"] -
            values["logitserve_call_states_released_total"])


def _settled_call_states(metrics_address, steady=0.2, seconds=10.0):
    """_open_call_states once it has stayed the same for `steady` seconds: the server releases
    the state of a call that just ended (the test's own unary calls, an earlier test's streams)
    a little after the client saw its answer, and a baseline taken before that counts it."""
    end = time.monotonic() + seconds
    value, since = _open_call_states(metrics_address), time.monotonic()
    while time.monotonic() - since < steady and time.monotonic() < end:
        time.sleep(0.02)
        now = _open_call_states(metrics_address)
        if now != value:
            value, since = now, time.monotonic()
    return value


def _eventually(predicate, seconds=10.0):
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def metered(heads):
    with Server(heads.flags() + ["--max-top-k", "64", "--metrics-listen", "127.0.0.1:0"]) as s:
        yield s


# Every way a request that reached the server can end here.
ENDED = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE")


class _Counts:
    """Score / ScoreStream requests the server finished with `code` (or any of a tuple of
    codes) since construction."""

    def __init__(self, server, code="OK"):
        self.server = server
        self.codes = (code,) if isinstance(code, str) else tuple(code)
        self.before = self._now()

    def _now(self):
        return tuple(sum(finished_rpcs(self.server.metrics_address, method, code)
                         for code in self.codes) for method in ("Score", "ScoreStream"))

    def delta(self):
        now = self._now()
        return {"Score": now[0] - self.before[0], "ScoreStream": now[1] - self.before[1]}


def _region(client, bits, ids):
    region = logitserve.SharedMemoryRegion(client, 1 << 20)
    h = region.put(bits)
    return region, h, region.put(ids, offset=h.end)


def test_the_stream_carries_shared_memory_calls_with_the_bits_of_unary_calls(metered):
    bits, ids = _inputs(ROWS, seed=21)
    args = dict(head="policy", entropy=True, top_k=5)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.Client(metered.address, shm_channels=0) as streamed:
        region, h, t = _region(streamed, bits, ids)
        with region:
            want = unary.score(hidden=h, target_ids=t, **args)
            counts = _Counts(metered)
            for _ in range(10):
                assert_same_bits(streamed.score(hidden=h, target_ids=t, **args), want)
            assert counts.delta() == {"Score": 0, "ScoreStream": 10}
            assert streamed._sessions.idle() == 1  # one caller: one stream, kept open

            # A request carrying tensor bytes stays unary (and gives the same bits).
            counts = _Counts(metered)
            assert_same_bits(streamed.score(hidden=bits, target_ids=ids, **args), want)
            assert counts.delta() == {"Score": 1, "ScoreStream": 0}

            # Chunks of a request split by the client's row limit each go over the stream.
            with logitserve.Client(metered.address, shm_channels=0,
                                   max_rows_per_request=5) as small:
                counts = _Counts(metered)
                split = small.score(hidden=h, target_ids=t, **args)
                assert split.chunks == 3
                assert_same_bits(split, want)
                assert counts.delta() == {"Score": 0, "ScoreStream": 3}


def test_session_streams_0_stays_unary(metered):
    bits, ids = _inputs(ROWS, seed=22)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary:
        assert unary._sessions is None
        region, h, t = _region(unary, bits, ids)
        with region:
            counts = _Counts(metered)
            for _ in range(4):
                unary.score(head="policy", hidden=h, target_ids=t, entropy=True)
            assert counts.delta() == {"Score": 4, "ScoreStream": 0}
    with pytest.raises(ValueError, match="session_streams"):
        logitserve.Client(metered.address, session_streams=-1)


def test_concurrent_callers_each_get_their_own_answer(metered):
    threads, calls, pool = 6, 12, 2
    bits, ids = _inputs(threads, seed=23)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.Client(metered.address, shm_channels=0, session_streams=pool) as streamed:
        region, h, t = _region(streamed, bits, ids)
        with region:
            # Thread k asks for the first k + 1 rows: an answer given to the wrong caller shows.
            def inputs(k):
                return dict(head="policy", entropy=True, top_k=3,
                            hidden=region.tensor(h.offset, (k + 1, H), "bf16"),
                            target_ids=region.tensor(t.offset, (k + 1,), "int32"))

            want = [unary.score(**inputs(k)) for k in range(threads)]
            counts = _Counts(metered)
            open_before = _settled_call_states(metered.metrics_address)
            wrong, failed = concurrent_calls(streamed.score, want, inputs, threads, calls)
            assert not failed, failed[:3]
            assert wrong == [0] * threads
            assert counts.delta() == {"Score": 0, "ScoreStream": threads * calls}
            # At most `pool` streams stay open between calls; the server holds just those.
            assert 1 <= streamed._sessions.idle() <= pool
            assert _eventually(lambda: _open_call_states(metered.metrics_address) - open_before
                               == streamed._sessions.idle())


def test_a_requests_own_error_is_the_unary_error_and_keeps_the_stream(metered):
    bits, ids = _inputs(ROWS, seed=24)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0,
                           max_retries=0) as unary, \
            logitserve.Client(metered.address, shm_channels=0, session_streams=1,
                              max_retries=0) as streamed:
        region, h, t = _region(streamed, bits, ids)
        with region:
            streamed.score(head="policy", hidden=h, target_ids=t)
            (stream,) = streamed._sessions._idle
            bad = [
                (logitserve.NotFound, dict(head="policy", target_ids=t,
                                           hidden=logitserve.SharedTensor(
                                               "never-registered", 0, "bf16", (ROWS, H)))),
                (logitserve.InvalidArgument, dict(head="policy", hidden=h, target_ids=t,
                                                  temperature=-1.0)),
                (logitserve.NotFound, dict(head="no-such-head", hidden=h, target_ids=t)),
            ]
            for kind, args in bad:
                with pytest.raises(kind) as want:
                    unary.score(**args)
                code = want.value.code.name
                counts = _Counts(metered, code)
                with pytest.raises(kind) as got:
                    streamed.score(**args)
                assert type(got.value) is type(want.value)
                assert got.value.code == want.value.code
                assert got.value.details == want.value.details and got.value.details
                assert str(got.value) == str(want.value)
                # The stream answered it (no unary retry), and stays the client's stream.
                assert counts.delta() == {"Score": 0, "ScoreStream": 1}, code
                assert streamed._sessions._idle == [stream]
            counts = _Counts(metered)
            streamed.score(head="policy", hidden=h, target_ids=t)
            assert counts.delta() == {"Score": 0, "ScoreStream": 1}
            assert streamed._sessions._idle == [stream] and not stream.broken



def _changing_calls(region_a, region_b):
    """Steps that change, one call after the other, what the next call asks for while the
    caller keeps the same SharedTensor objects (whose encoding and option parts the client
    caches): options, the head, then the tensors' offset, region, dtype and shape. Yields
    (shared-memory arguments, the same call with arrays) per step."""
    (bits1, ids1), (bits2, _), (bits3, ids3) = (_inputs(ROWS, seed=s) for s in (31, 32, 33))
    ids3 = ids3.astype(np.int64)
    h = region_a.put(bits1)
    t = region_a.put(ids1, offset=h.end)
    second = region_a.put(bits2, offset=t.end)
    hb = region_b.put(bits3)
    tb = region_b.put(ids3, offset=hb.end)
    data = {"hidden": bits1, "target_ids": ids1}
    args = dict(head="policy", entropy=True, top_k=3)
    steps = [
        lambda: args.update(entropy=False, top_k=5),
        lambda: args.update(temperature=0.5),
        lambda: args.update(head="policy16"),
        lambda: args.update(ignore_index=int(ids1[0])),
        lambda: (setattr(h, "offset", second.offset), data.update(hidden=bits2)),
        lambda: (setattr(h, "region", hb.region), setattr(h, "offset", hb.offset),
                 setattr(t, "region", tb.region), setattr(t, "offset", tb.offset),
                 setattr(t, "dtype", "INT64"), data.update(hidden=bits3, target_ids=ids3)),
        lambda: (setattr(h, "shape", (ROWS - 4, H)), setattr(t, "shape", (ROWS - 4,)),
                 data.update(hidden=bits3[:ROWS - 4], target_ids=ids3[:ROWS - 4])),
        lambda: (args.pop("temperature"), args.pop("ignore_index"),
                 args.update(head="policy", entropy=True, top_k=3)),  # an earlier call's parts
    ]
    for step in [lambda: None] + steps:
        step()
        yield dict(args, hidden=h, target_ids=t), dict(args, **data)


def _reference(unary, arrays):
    # Encoded from fresh option parts: a stale cache entry would not make both results wrong.
    _api._OPTION_CACHE.clear()
    return unary.score(**arrays)


def test_arguments_changed_between_calls_are_honoured(metered):
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.Client(metered.address, shm_channels=0) as streamed, \
            logitserve.SharedMemoryRegion(unary, 1 << 20) as a, \
            logitserve.SharedMemoryRegion(unary, 1 << 20) as b:
        counts = _Counts(metered)
        calls = 0
        for shm, arrays in _changing_calls(a, b):
            got = streamed.score(**shm)
            assert_same_bits(got, _reference(unary, arrays))
            assert len(got.target_logprobs) == len(arrays["target_ids"])
            calls += 1
        assert counts.delta() == {"Score": calls, "ScoreStream": calls}


def test_async_client_honours_arguments_changed_between_calls(metered):
    import asyncio
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.SharedMemoryRegion(unary, 1 << 20) as a, \
            logitserve.SharedMemoryRegion(unary, 1 << 20) as b:

        async def main():
            async with logitserve.AsyncClient(metered.address) as c:
                counts = _Counts(metered)
                calls = 0
                for shm, arrays in _changing_calls(a, b):
                    got = await c.score(**shm)
                    assert_same_bits(got, _reference(unary, arrays))
                    assert len(got.target_logprobs) == len(arrays["target_ids"])
                    calls += 1
                assert counts.delta() == {"Score": calls, "ScoreStream": calls}

        asyncio.run(main())

def test_a_call_ends_at_its_deadline_and_its_stream_is_dropped(heads):
    # 1 s per row tile: a call with a 0.3 s deadline raises DEADLINE_EXCEEDED at about 0.3 s
    # (not when the server answers), and the stream it used is cancelled and not reused.
    bits, ids = _inputs(4, seed=25)
    with Server(heads.flags() + ["--test-fault", "slow-tile:1000",
                                 "--metrics-listen", "127.0.0.1:0"]) as s, \
            logitserve.Client(s.address, shm_channels=0, timeout=0.3, max_retries=0) as c, \
            logitserve.Client(s.address, shm_channels=0, timeout=30) as patient:
        region, h, t = _region(patient, bits, ids)
        with region:
            counts = _Counts(s, ENDED)
            for i in range(2):
                t0 = time.monotonic()
                with pytest.raises(logitserve.DeadlineExceeded) as e:
                    c.score(head="policy", hidden=h, target_ids=t)
                elapsed = time.monotonic() - t0
                assert 0.25 < elapsed < 0.9, "call %d took %.3f s" % (i, elapsed)
                assert e.value.code.name == "DEADLINE_EXCEEDED"
                assert c._sessions.idle() == 0  # discarded, not kept
            # Both went over a stream (the server ends them when their tile is done), and no
            # unary call followed them.
            assert _eventually(lambda: counts.delta()["ScoreStream"] == 2)
            assert counts.delta() == {"Score": 0, "ScoreStream": 2}
            # The abandoned requests still run on the server (about 1 s each); the patient
            # client's next call opens a stream of its own and gets its answer.
            counts = _Counts(s)
            r = patient.score(head="policy", hidden=h, target_ids=t, entropy=True)
            assert len(r.entropy) == 4
            assert counts.delta() == {"Score": 0, "ScoreStream": 1}


def test_a_broken_stream_is_dropped_and_the_call_goes_unary(heads):
    # The server behind an idle stream is killed and another takes its port: the next call finds
    # the stream dead, drops it and is answered by a unary call; the call after that opens a new
    # stream.
    bits, ids = _inputs(ROWS, seed=26)
    port = free_port()
    first = Server(heads.flags() + ["--metrics-listen", "127.0.0.1:0"], port=port).start()
    try:
        with logitserve.Client("127.0.0.1:%d" % port, shm_channels=0, max_retries=8) as c:
            region = logitserve.SharedMemoryRegion(c, 1 << 20, _register=False)
            h = region.put(bits)
            t = region.put(ids, offset=h.end)
            c.register_shared_memory(region.name, region.key, 0, region.size)
            want = c.score(head="policy", hidden=h, target_ids=t, entropy=True)
            assert c._sessions.idle() == 1
            first.kill()
            with Server(heads.flags() + ["--metrics-listen", "127.0.0.1:0"], port=port) as second:
                c.register_shared_memory(region.name, region.key, 0, region.size)
                counts = _Counts(second)
                got = c.score(head="policy", hidden=h, target_ids=t, entropy=True)
                assert_same_bits(got, want)
                assert counts.delta() == {"Score": 1, "ScoreStream": 0}
                assert c._sessions.idle() == 0
                counts = _Counts(second)
                c.score(head="policy", hidden=h, target_ids=t, entropy=True)
                assert counts.delta() == {"Score": 0, "ScoreStream": 1}
                assert c._sessions.idle() == 1
                region.close()
    finally:
        first.kill()


def test_close_ends_the_streams_cleanly(metered):
    bits, ids = _inputs(ROWS, seed=27)
    open_before = _settled_call_states(metered.metrics_address)
    c = logitserve.Client(metered.address, shm_channels=0, session_streams=3)
    region, h, t = _region(c, bits, ids)
    start = threading.Barrier(3)

    def run():
        start.wait()
        for _ in range(5):
            c.score(head="policy", hidden=h, target_ids=t)

    workers = [threading.Thread(target=run) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    region.close()
    streams = list(c._sessions._idle)
    assert streams and _eventually(
        lambda: _open_call_states(metered.metrics_address) - open_before == len(streams))
    c.close()
    # Half-closed, then finished by the server with OK (a cancelled stream would be CANCELLED),
    # and the server holds none of them any more; the client's watchdog thread is gone.
    assert [s.final_status for s in streams] == [0] * len(streams)
    assert _eventually(lambda: _open_call_states(metered.metrics_address) == open_before)
    assert not [th for th in threading.enumerate() if th.name == "logitserve-deadlines"]


# ---- AsyncClient -------------------------------------------------------------------------------

def test_async_client_uses_session_streams_with_unary_bits_errors_and_close(metered):
    import asyncio
    bits, ids = _inputs(ROWS, seed=28)
    args = dict(head="policy", entropy=True, top_k=4)
    bad = dict(head="policy", temperature=0.0)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0,
                           max_retries=0) as unary:
        region, h, t = _region(unary, bits, ids)
        with region:
            want = unary.score(hidden=h, target_ids=t, **args)
            with pytest.raises(logitserve.InvalidArgument) as want_error:
                unary.score(hidden=h, target_ids=t, **bad)

            async def main():
                async with logitserve.AsyncClient(metered.address, max_retries=0,
                                                  session_streams=2) as a:
                    counts = _Counts(metered)
                    for _ in range(5):
                        assert_same_bits(await a.score(hidden=h, target_ids=t, **args), want)
                    assert counts.delta() == {"Score": 0, "ScoreStream": 5}
                    assert a._sessions.idle() == 1

                    # Eight concurrent tasks: eight streams, two kept; every answer its own.
                    def sub(k):
                        return dict(hidden=region.tensor(h.offset, (k + 1, H), "bf16"),
                                    target_ids=region.tensor(t.offset, (k + 1,), "int32"), **args)
                    counts = _Counts(metered)
                    got = await asyncio.gather(*(a.score(**sub(k)) for k in range(8)))
                    for k, r in enumerate(got):
                        np.testing.assert_array_equal(_bits(r.entropy), _bits(want.entropy[:k + 1]))
                    assert counts.delta() == {"Score": 0, "ScoreStream": 8}
                    assert a._sessions.idle() == 2

                    counts = _Counts(metered, "INVALID_ARGUMENT")
                    with pytest.raises(logitserve.InvalidArgument) as got_error:
                        await a.score(hidden=h, target_ids=t, **bad)
                    assert str(got_error.value) == str(want_error.value)
                    assert counts.delta() == {"Score": 0, "ScoreStream": 1}
                    assert a._sessions.idle() == 2
                    kept = list(a._sessions._idle)
                # close() half-closed the kept streams and the server ended them with OK (a
                # cancelled one would be CANCELLED).
                return [await c.code() for c in kept]

            assert asyncio.run(main()) == [grpc.StatusCode.OK] * 2

            async def unary_only():
                async with logitserve.AsyncClient(metered.address, session_streams=0) as a:
                    counts = _Counts(metered)
                    await a.score(hidden=h, target_ids=t, **args)
                    assert counts.delta() == {"Score": 1, "ScoreStream": 0}

            asyncio.run(unary_only())


def test_async_client_call_ends_at_its_deadline(heads):
    import asyncio
    bits, ids = _inputs(4, seed=29)
    with Server(heads.flags() + ["--test-fault", "slow-tile:1000",
                                 "--metrics-listen", "127.0.0.1:0"]) as s, \
            logitserve.Client(s.address, shm_channels=0, timeout=30) as patient:
        region, h, t = _region(patient, bits, ids)
        with region:
            counts = _Counts(s, ENDED)

            async def main():
                async with logitserve.AsyncClient(s.address, timeout=0.3, max_retries=0) as a:
                    t0 = time.monotonic()
                    with pytest.raises(logitserve.DeadlineExceeded):
                        await a.score(head="policy", hidden=h, target_ids=t)
                    elapsed = time.monotonic() - t0
                    assert 0.25 < elapsed < 0.9, elapsed
                    assert a._sessions.idle() == 0
            asyncio.run(main())
            assert _eventually(lambda: counts.delta()["ScoreStream"] == 1)
            assert counts.delta() == {"Score": 0, "ScoreStream": 1}
