"""The native send path (logitserve/_native.py): Score calls that carry array bytes go through gRPC
C++ with the arrays sent in place. The wheel this suite runs from ships the library, so every
other test here already sends through it; these check that it really is used, that it gives
grpcio's bits (unary and pipelined, large pieces sent in place and small ones copied), and its
own failure modes: server errors, deadlines, an unreachable server, tokens, threads, freeing."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import logitserve
from logitserve import _native
from conftest import H, V
from support import Server, assert_same_bits, free_port

ROW_BYTES = H * 4 + 8  # fp32 hidden + int64 ids


def _request(n, seed):
    rng = np.random.default_rng(seed)
    return dict(head="policy", hidden=rng.normal(0, 1, (n, H)).astype(np.float32),
                target_ids=rng.integers(0, V, n), entropy=True, top_k=5)


def test_the_installed_package_sends_natively(server):
    with logitserve.Client(server.address) as c:
        assert c.native, _native.load_error()
    with logitserve.Client(server.address, native=False) as c:
        assert not c.native


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=60)


def test_environment_turns_it_off_and_a_missing_library_falls_back(server):
    code = "import logitserve; print(logitserve.Client(%r).native)" % server.address
    assert _python(code, LOGITSERVE_NATIVE="0").stdout.strip() == "False"
    missing = _python(code, LOGITSERVE_NATIVE_LIB="/nonexistent/liblogitserve_native.so")
    assert missing.stdout.strip() == "False", missing.stderr
    required = _python("import logitserve; logitserve.Client(%r, native=True)" % server.address,
                       LOGITSERVE_NATIVE_LIB="/nonexistent/liblogitserve_native.so")
    assert required.returncode != 0 and "/nonexistent" in required.stderr


# 5 rows: every piece below 64 KiB (copied); 700 rows: the hidden array (175 KiB) sent in
# place; pipelined into 300-row chunks (75 KiB of hidden rows each, in place) over 2 streams.
@pytest.mark.parametrize("rows,chunk_rows", [(5, 0), (700, 0), (700, 300)])
def test_same_bits_as_grpcio(server, rows, chunk_rows):
    req = _request(rows, seed=rows + chunk_rows)
    opts = dict(pipeline_chunk_bytes=chunk_rows * ROW_BYTES)
    with logitserve.Client(server.address, native=False, **opts) as c:
        want = c.score(**req)
    with logitserve.Client(server.address, native=True, **opts) as c:
        got = c.score(**req)
    assert got.chunks == want.chunks == (1 if not chunk_rows else -(-rows // chunk_rows))
    assert_same_bits(got, want)


def test_server_errors_are_typed_and_name_the_row(server):
    req = _request(600, seed=7)
    req["hidden"][411, 3] = np.nan
    with logitserve.Client(server.address, native=True) as c:
        with pytest.raises(logitserve.InvalidArgument) as e:
            c.score(**req)
        assert "hidden" in e.value.details and "411" in e.value.details
    with logitserve.Client(server.address, native=True, pipeline_chunk_bytes=100 * ROW_BYTES) as c:
        with pytest.raises(logitserve.InvalidArgument) as e:
            c.score(**req)
        assert "rows [400, 500) of 600" in e.value.details
        ok = c.score(**_request(600, seed=8))  # the client still works after a failed chunk
        assert ok.chunks == 6


def test_deadline_exceeded(server):
    with logitserve.Client(server.address, native=True, timeout=1e-6, split_requests=False) as c:
        with pytest.raises(logitserve.DeadlineExceeded):
            c.score(**_request(600, seed=9))


def test_unreachable_server_is_retried_then_unavailable():
    with logitserve.Client("127.0.0.1:%d" % free_port(), native=True, max_retries=1,
                           initial_backoff=0.01, max_backoff=0.02, split_requests=False,
                           timeout=5) as c:
        with pytest.raises(logitserve.Unavailable):
            c.score(**_request(300, seed=10))


def test_token_is_sent(heads, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with Server(heads.flags() + ["--auth-token-file", str(token)]) as s:
        req = _request(400, seed=11)
        with logitserve.Client(s.address, native=True, token="s3cret") as c:
            want = c.score(**req)
        with logitserve.Client(s.address, native=True, token="wrong", split_requests=False) as c:
            with pytest.raises(logitserve.Unauthenticated):
                c.score(**req)
        with logitserve.Client(s.address, native=False, token="s3cret") as c:
            assert_same_bits(c.score(**req), want)


def test_threads_share_a_client(server):
    reqs = [_request(500 + 40 * k, seed=20 + k) for k in range(4)]
    with logitserve.Client(server.address, native=False) as c:
        want = [c.score(**r) for r in reqs]
    wrong, failed = [0] * 4, []
    with logitserve.Client(server.address, native=True, pipeline_chunk_bytes=200 * ROW_BYTES) as c:
        def run(k):
            for _ in range(5):
                try:
                    got = c.score(**reqs[k])
                    if not (np.array_equal(got.entropy.view(np.uint32),
                                           want[k].entropy.view(np.uint32)) and
                            np.array_equal(got.top_k_ids, want[k].top_k_ids)):
                        wrong[k] += 1
                except Exception as e:  # noqa: BLE001 - reported below
                    failed.append(e)
        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failed == [] and wrong == [0] * 4


def test_calls_are_freed_and_close_frees_the_channel(server):
    c = logitserve.Client(server.address, native=True, pipeline_chunk_bytes=100 * ROW_BYTES)
    for seed in range(30):
        c.score(**_request(350, seed=seed))
    channels = c._native_channels
    # Each start frees the released calls before it: at most a window's worth stays listed.
    assert all(len(ch._calls) <= 8 for ch in channels), [len(ch._calls) for ch in channels]
    c.close()
    assert all(ch._handle is None and not ch._calls for ch in channels)


def test_clients_come_and_go_beside_grpcio(server):
    # Native channels created and closed over and over in a process that also runs grpcio (a
    # second gRPC core) crashed gRPC C++'s shared callback queue; the library now drives its own
    # completion queue per channel. In a child process, so a crash fails this test only.
    code = """
import numpy as np, logitserve
for i in range(60):
    with logitserve.Client(%r, native=True) as c:
        try:
            c.score(head="policy", hidden=np.ones((3, %d), np.float32), target_ids=[0, 1])
        except logitserve.InvalidArgument:
            pass
print("done")
""" % (server.address, H)
    child = _python(code)
    assert child.returncode == 0 and child.stdout.strip() == "done", child.stderr[-2000:]


def test_async_client_sends_natively_with_the_same_bits_and_errors(server):
    import asyncio

    small, large = _request(9, seed=30), _request(700, seed=31)
    bad = _request(700, seed=32)
    bad["hidden"][523, 0] = np.inf
    with logitserve.Client(server.address, native=False) as c:
        want_small, want_large = c.score(**small), c.score(**large)

    async def run():
        async with logitserve.AsyncClient(server.address, native=True,
                                          pipeline_chunk_bytes=200 * ROW_BYTES) as c:
            assert c.native
            got_small, got_large = await asyncio.gather(c.score(**small), c.score(**large))
            with pytest.raises(logitserve.InvalidArgument) as e:
                await c.score(**bad)
            return got_small, got_large, e.value.details

    got_small, got_large, details = asyncio.run(run())
    assert got_small.chunks == 1 and got_large.chunks == 4
    assert_same_bits(got_small, want_small)
    assert_same_bits(got_large, want_large)
    assert "rows [400, 600) of 700" in details and "523" in details
