"""Shared-memory call channels (logitserve/_shm_channel.py) against the real server: a Score call
without tensor bytes is posted into a control region both processes map, and answered there.
The server counts every request a channel carried under
logitserve_requests_total{method="OpenSharedMemoryChannel"} (and a refused open under its code),
apart from unary Score calls and ScoreStream messages: those counters show which path a call
took."""

import concurrent.futures
import glob
import os
import re
import threading
import time

import grpc
import numpy as np
import pytest

import logitserve
from logitserve import _shm_channel
from conftest import H, V
from support import Server, assert_same_bits, concurrent_calls, finished_rpcs, random_inputs

ROWS = 12
METHODS = ("Score", "ScoreStream", "OpenSharedMemoryChannel")
# Every way a request that reached the server can end here.
ENDED = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE")
HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "common",
                      "wire", "shm_channel.h")

pytestmark = pytest.mark.skipif(not _shm_channel.supported(),
                                reason="shared-memory channels need Linux on x86_64")


def _inputs(n, seed):
    return random_inputs(n, seed, H, V)


def _eventually(predicate, seconds=10.0):
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _left_in_dev_shm():
    return glob.glob("/dev/shm/logitserve-channel-%d-*" % os.getpid())


class _Counts:
    """Requests per method the server finished with `code` (or any of a tuple of codes) since
    construction."""

    def __init__(self, server, code="OK"):
        self.server = server
        self.codes = (code,) if isinstance(code, str) else tuple(code)
        self.before = self._now()

    def _now(self):
        return [sum(finished_rpcs(self.server.metrics_address, method, code)
                    for code in self.codes) for method in METHODS]

    def delta(self):
        return {m: now - before for m, now, before in zip(METHODS, self._now(), self.before)}


def _carried(channel=0, stream=0, unary=0):
    return {"Score": unary, "ScoreStream": stream, "OpenSharedMemoryChannel": channel}


def _server(heads, *flags):
    return Server(heads.flags() + ["--max-top-k", "64", "--metrics-listen", "127.0.0.1:0"] +
                  list(flags))


@pytest.fixture(scope="module")
def metered(heads):
    with _server(heads) as s:
        yield s


def _region(client, bits, ids):
    region = logitserve.SharedMemoryRegion(client, 1 << 20)
    h = region.put(bits)
    return region, h, region.put(ids, offset=h.end)


def test_control_region_layout_is_the_servers():
    # The offsets _shm_channel.py repeats, against the protocol header they come from.
    text = open(HEADER).read()
    consts = dict((name, int(value)) for name, value in re.findall(
        r"static constexpr uint64_t k(\w+) = (\d+);", text))
    snake = lambda name: re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()  # noqa: E731
    header_fields = {snake(k): v for k, v in consts.items() if k not in ("HeaderBytes", "Align")}
    assert header_fields == _shm_channel.LAYOUT
    assert _shm_channel.layout_ok()
    assert consts["HeaderBytes"] == _shm_channel.HEADER_BYTES
    assert consts["Align"] == _shm_channel.PAGE
    assert int(re.search(r"kShmChannelMagic = (0x[0-9a-f]+)u", text).group(1), 16) == \
        _shm_channel.MAGIC
    assert int(re.search(r"kShmChannelVersion = (\d+);", text).group(1)) == _shm_channel.VERSION


def test_channels_carry_shared_memory_calls_with_the_bits_of_unary_calls(metered):
    bits, ids = _inputs(ROWS, seed=41)
    args = dict(head="policy", entropy=True, top_k=5)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.Client(metered.address) as c:
        region, h, t = _region(c, bits, ids)
        with region:
            want = unary.score(hidden=h, target_ids=t, **args)
            counts = _Counts(metered)
            for _ in range(20):
                assert_same_bits(c.score(hidden=h, target_ids=t, **args), want)
            assert counts.delta() == _carried(channel=20)
            assert c._channels.idle() == 1  # one caller: one channel, kept open
            assert not _left_in_dev_shm()  # unlinked once the server mapped it

            # A request carrying tensor bytes stays unary (and gives the same bits).
            counts = _Counts(metered)
            assert_same_bits(c.score(hidden=bits, target_ids=ids, **args), want)
            assert counts.delta() == _carried(unary=1)

            # One whose answer could outgrow the response area (20000 rows of 64 top-k entries:
            # over 8 MiB) goes over a session stream; the region does not hold those rows, so
            # the answer is the server's error, from the stream.
            huge = logitserve.SharedTensor(h.region, 0, "bf16", (20000, H))
            counts = _Counts(metered, "INVALID_ARGUMENT")
            with pytest.raises(logitserve.InvalidArgument, match="not inside region"):
                c.score(head="policy", hidden=huge, top_k=64)
            assert counts.delta() == _carried(stream=1)


def test_shm_channels_0_uses_session_streams(metered):
    bits, ids = _inputs(ROWS, seed=42)
    with logitserve.Client(metered.address, shm_channels=0) as c:
        assert c._channels is None
        region, h, t = _region(c, bits, ids)
        with region:
            counts = _Counts(metered)
            for _ in range(3):
                c.score(head="policy", hidden=h, target_ids=t, entropy=True)
            assert counts.delta() == _carried(stream=3)
    with pytest.raises(ValueError, match="shm_channels"):
        logitserve.Client(metered.address, shm_channels=-1)


def test_a_spinning_wait_gives_the_same_answers(metered):
    bits, ids = _inputs(ROWS, seed=50)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.Client(metered.address, shm_channel_spin_us=200) as c:
        region, h, t = _region(c, bits, ids)
        with region:
            want = unary.score(head="policy", hidden=h, target_ids=t, entropy=True)
            counts = _Counts(metered)
            for _ in range(5):
                assert_same_bits(c.score(head="policy", hidden=h, target_ids=t, entropy=True),
                                  want)
            assert counts.delta() == _carried(channel=5)
    with pytest.raises(ValueError, match="shm_channel_spin_us"):
        logitserve.Client(metered.address, shm_channel_spin_us=-1)


def test_a_forked_child_does_not_post_into_its_parents_channels(metered):
    # A pool created in another process (as a forked child sees its parent's) drops its idle
    # channels: posting into one would cross the parent's calls.
    bits, ids = _inputs(ROWS, seed=51)
    with logitserve.Client(metered.address) as c:
        region, h, t = _region(c, bits, ids)
        with region:
            c.score(head="policy", hidden=h, target_ids=t)
            (parents,) = c._channels._idle
            c._channels._pid = -1
            counts = _Counts(metered)
            c.score(head="policy", hidden=h, target_ids=t)
            assert counts.delta() == _carried(channel=1)
            (own,) = c._channels._idle
            assert own is not parents and parents._seq == 1 and own._seq == 1
            parents.close()


def test_concurrent_callers_each_get_their_own_answer(metered):
    threads, calls, pool = 6, 12, 2
    bits, ids = _inputs(threads, seed=43)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.Client(metered.address, shm_channels=pool) as c:
        region, h, t = _region(c, bits, ids)
        with region:
            # Thread k asks for the first k + 1 rows: an answer given to the wrong caller shows.
            def inputs(k):
                return dict(head="policy", entropy=True, top_k=3,
                            hidden=region.tensor(h.offset, (k + 1, H), "bf16"),
                            target_ids=region.tensor(t.offset, (k + 1,), "int32"))

            want = [unary.score(**inputs(k)) for k in range(threads)]
            counts = _Counts(metered)
            wrong, failed = concurrent_calls(c.score, want, inputs, threads, calls)
            assert not failed, failed[:3]
            assert wrong == [0] * threads
            assert counts.delta() == _carried(channel=threads * calls)
            assert 1 <= c._channels.idle() <= pool
            assert not _left_in_dev_shm()


def test_a_requests_own_error_is_the_unary_error_and_keeps_the_channel(metered):
    bits, ids = _inputs(ROWS, seed=44)
    with logitserve.Client(metered.address, shm_channels=0, session_streams=0,
                           max_retries=0) as unary, \
            logitserve.Client(metered.address, shm_channels=1, max_retries=0) as c:
        region, h, t = _region(c, bits, ids)
        with region:
            want_ok = c.score(head="policy", hidden=h, target_ids=t, entropy=True)
            (channel,) = c._channels._idle
            bad = [
                (logitserve.NotFound, dict(head="policy", target_ids=t,
                                           hidden=logitserve.SharedTensor(
                                               "never-registered", 0, "bf16", (ROWS, H)))),
                (logitserve.InvalidArgument, dict(head="policy", hidden=h, target_ids=t,
                                                  temperature=-1.0)),
            ]
            for kind, args in bad:
                with pytest.raises(kind) as want:
                    unary.score(**args)
                counts = _Counts(metered, want.value.code.name)
                with pytest.raises(kind) as got:
                    c.score(**args)
                assert type(got.value) is type(want.value)
                assert got.value.code == want.value.code
                assert got.value.details == want.value.details and got.value.details
                assert str(got.value) == str(want.value)
                # The channel answered it (no other path), and stays the client's channel.
                assert counts.delta() == _carried(channel=1), want.value.code
                assert c._channels._idle == [channel]
            counts = _Counts(metered)
            assert_same_bits(c.score(head="policy", hidden=h, target_ids=t, entropy=True),
                              want_ok)
            assert counts.delta() == _carried(channel=1)
            assert c._channels._idle == [channel] and not channel.closed


def test_a_call_ends_at_its_deadline_and_its_channel_is_dropped(heads):
    # 1 s per row tile: a call with a 0.3 s deadline raises DEADLINE_EXCEEDED at about 0.3 s
    # (not when the server answers), and its channel is discarded.
    bits, ids = _inputs(4, seed=45)
    with _server(heads, "--test-fault", "slow-tile:1000") as s, \
            logitserve.Client(s.address, timeout=0.3, max_retries=0) as c, \
            logitserve.Client(s.address, timeout=30) as patient:
        region, h, t = _region(patient, bits, ids)
        with region:
            counts = _Counts(s, ENDED)
            finished = _Counts(s)
            for i in range(2):
                t0 = time.monotonic()
                with pytest.raises(logitserve.DeadlineExceeded) as e:
                    c.score(head="policy", hidden=h, target_ids=t)
                elapsed = time.monotonic() - t0
                assert 0.25 < elapsed < 0.9, "call %d took %.3f s" % (i, elapsed)
                assert e.value.code.name == "DEADLINE_EXCEEDED"
                assert c._channels.idle() == 0  # discarded, not kept
            # Both went over a channel (the server ends them at its next check), and no other
            # path followed them.
            assert _eventually(lambda: counts.delta()["OpenSharedMemoryChannel"] == 2)
            assert counts.delta() == _carried(channel=2)
            assert finished.delta() == _carried()  # stopped, not run to the end
            # The patient client's call opens a channel of its own and gets its answer.
            counts = _Counts(s)
            r = patient.score(head="policy", hidden=h, target_ids=t, entropy=True)
            assert len(r.entropy) == 4
            assert counts.delta() == _carried(channel=1)


def test_a_server_at_its_channel_limit_is_served_over_session_streams(heads):
    # --max-shared-memory-channels 0: every open is refused with RESOURCE_EXHAUSTED, which sends
    # that call over a session stream and leaves channels on for the next call.
    bits, ids = _inputs(ROWS, seed=46)
    with _server(heads, "--max-shared-memory-channels", "0") as s, \
            logitserve.Client(s.address, shm_channels=0, session_streams=0) as unary, \
            logitserve.Client(s.address) as c:
        region, h, t = _region(c, bits, ids)
        with region:
            want = unary.score(head="policy", hidden=h, target_ids=t, entropy=True)
            counts = _Counts(s)
            refused = _Counts(s, "RESOURCE_EXHAUSTED")
            for _ in range(3):
                assert_same_bits(c.score(head="policy", hidden=h, target_ids=t, entropy=True),
                                  want)
            assert counts.delta() == _carried(stream=3)
            assert refused.delta() == _carried(channel=3)  # tried each time
            assert c._channels.usable and c._channels.idle() == 0
            assert not _left_in_dev_shm()


def test_a_closed_channel_gives_the_servers_slot_back(heads):
    # With room for one channel on the server, a second client is refused until the first's
    # channel is closed: closing a channel cancels its call, also while the client's gRPC
    # connection stays up (as for a channel discarded after a deadline).
    bits, ids = _inputs(ROWS, seed=47)
    with _server(heads, "--max-shared-memory-channels", "1") as s, \
            logitserve.Client(s.address) as first, logitserve.Client(s.address) as second:
        region, h, t = _region(second, bits, ids)
        with region:
            args = dict(head="policy", hidden=h, target_ids=t, entropy=True)
            counts = _Counts(s)
            first.score(**args)
            assert first._channels.idle() == 1
            second.score(**args)
            assert counts.delta() == _carried(channel=1, stream=1)
            # Held here, as a traceback may hold it: closing, not collecting, must end the call.
            (channel,) = first._channels._idle
            first._channels.close()
            # The server frees the slot once the cancelled call is over.
            counts = _Counts(s)
            assert _eventually(lambda: second.score(**args) is not None and
                               counts.delta()["OpenSharedMemoryChannel"] == 1)
            assert second._channels.idle() == 1


def test_a_server_that_cannot_serve_the_channel_turns_channels_off(heads):
    # A server whose message limit is below the channel's 1 MiB request area refuses every open
    # with INVALID_ARGUMENT: the client stops trying and uses session streams.
    bits, ids = _inputs(ROWS, seed=49)
    with _server(heads, "--max-receive-message-bytes", "65536") as s, \
            logitserve.Client(s.address) as c:
        region, h, t = _region(c, bits, ids)
        with region:
            refused = _Counts(s, "INVALID_ARGUMENT")
            counts = _Counts(s)
            for _ in range(3):
                c.score(head="policy", hidden=h, target_ids=t, entropy=True)
            assert refused.delta() == _carried(channel=1)  # one open, then off
            assert counts.delta() == _carried(stream=3)
            assert not c._channels.usable
            assert not _left_in_dev_shm()


def test_the_open_carries_the_token(heads, tmp_path):
    token = tmp_path / "user"
    token.write_text("user-secret\n")
    bits, ids = _inputs(ROWS, seed=48)
    with _server(heads, "--auth-token-file", str(token)) as s, \
            logitserve.Client(s.address, token="user-secret") as user, \
            logitserve.Client(s.address, max_retries=0, split_requests=False) as anon:
        region, h, t = _region(user, bits, ids)
        with region:
            counts = _Counts(s)
            user.score(head="policy", hidden=h, target_ids=t)
            assert counts.delta() == _carried(channel=1)
            # Without the token the open is refused with UNAUTHENTICATED, which leaves channels
            # on and sends the call on: the session stream ends refused too, and the unary call
            # raises the error.
            refused = _Counts(s, "UNAUTHENTICATED")
            with pytest.raises(logitserve.Unauthenticated):
                anon.score(head="policy", hidden=h, target_ids=t)
            assert refused.delta() == _carried(channel=1, stream=1, unary=1)
            assert anon._channels.usable and anon._channels.idle() == 0


def test_a_server_that_never_serves_the_channel_cannot_hold_the_call():
    # A stand-in server that takes OpenSharedMemoryChannel calls and never answers them (and
    # implements nothing else): the open gives up at the call's deadline and cancels its call,
    # and the call goes on over gRPC (here: UNIMPLEMENTED), with channels left on.
    opened, cancelled = threading.Event(), threading.Event()

    def hang(request, context):
        opened.set()
        while context.is_active():
            time.sleep(0.01)
        cancelled.set()
        return iter(())

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "logitserve.v1.Scorer", {"OpenSharedMemoryChannel": grpc.unary_stream_rpc_method_handler(
            hang)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with logitserve.Client("127.0.0.1:%d" % port, timeout=0.3, max_retries=0,
                               split_requests=False) as c:
            t0 = time.monotonic()
            with pytest.raises(logitserve.Unimplemented):
                c.score(head="policy", hidden=logitserve.SharedTensor("r", 0, "bf16", (1, H)))
            assert time.monotonic() - t0 < 2.0
            assert opened.is_set() and cancelled.wait(5)
            assert c._channels.usable and c._channels.idle() == 0
    finally:
        server.stop(0)
    assert not _left_in_dev_shm()
