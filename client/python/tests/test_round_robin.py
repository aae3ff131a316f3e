"""Client-side load balancing: several addresses (or dns:///) with round_robin, and failover.

Each server serves a tiny head "which" ([3, 1]) whose weights differ per server: row i is 1 on
server i and 0 elsewhere, so the top-1 id of hidden [[1]] names the server that answered."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import logitserve
from logitserve import _api
from support import Server, finished_rpcs, write_safetensors

SERVERS = 3


@pytest.fixture(scope="module")
def servers(heads, tmp_path_factory):
    d = tmp_path_factory.mktemp("rr")
    out = []
    try:
        for i in range(SERVERS):
            path = os.path.join(str(d), "which%d.safetensors" % i)
            w = np.zeros((SERVERS, 1), np.float32)
            w[i, 0] = 1.0
            write_safetensors(path, {"which": ("F32", w)})
            out.append(Server(heads.flags() + ["--head", "which=%s:which" % path,
                                               "--metrics-listen", "127.0.0.1:0"]).start())
        yield out
    finally:
        for s in out:
            s.stop()


def _who(client):
    r = client.score(head="which", hidden=np.ones((1, 1), np.float32), top_k=1)
    return int(r.top_k_ids[0, 0])


def test_target_parsing():
    assert _api.resolve_target("127.0.0.1:1") == ("127.0.0.1:1", None)
    assert _api.resolve_target("127.0.0.1:1,127.0.0.1:2") == ("ipv4:127.0.0.1:1,127.0.0.1:2", "round_robin")
    assert _api.resolve_target(["[::1]:1", "[::1]:2"]) == ("ipv6:[::1]:1,[::1]:2", "round_robin")
    assert _api.resolve_target("dns:///logitserve-headless:50051") == \
        ("dns:///logitserve-headless:50051", "round_robin")
    assert _api.resolve_target("dns:///x:1", "pick_first") == ("dns:///x:1", "pick_first")
    with pytest.raises(ValueError, match="dns:///"):
        _api.resolve_target(["host-a:1", "host-b:1"])


def test_each_server_answers_on_its_own(servers):
    for i, s in enumerate(servers):
        with logitserve.Client(s.address) as c:
            assert c.list_heads()["which"].vocab_size == SERVERS
            assert _who(c) == i


def test_round_robin_spreads_load_and_survives_a_killed_server(servers):
    addresses = [s.address for s in servers]
    with logitserve.Client(addresses, max_retries=6, initial_backoff=0.05, max_backoff=0.5) as c:
        assert c.target.startswith("ipv4:")
        before = [finished_rpcs(s.metrics_address, "Score") for s in servers]
        seen = [_who(c) for _ in range(30)]
        assert set(seen) == set(range(SERVERS)), seen  # every replica received traffic
        # The servers' own counters agree with who answered.
        for i, s in enumerate(servers):
            assert finished_rpcs(s.metrics_address, "Score") - before[i] == seen.count(i)
        # Load from 4 threads; server 2 is SIGKILLed (no drain) while requests are in flight.
        done = []
        lock = threading.Lock()
        killed = threading.Event()

        def worker():
            for _ in range(15):
                who = _who(c)  # raises if any request fails
                with lock:
                    done.append((killed.is_set(), who))
                    if len(done) == 12 and not killed.is_set():
                        servers[2].kill()
                        killed.set()

        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(worker) for _ in range(4)]:
                f.result()
        assert len(done) == 60 and killed.is_set()
        late = [who for was_killed, who in done[-20:]]
        assert set(late) == {0, 1}, late  # the survivors share the load
        assert c.list_heads()["which"].vocab_size == SERVERS


def test_dns_target_uses_round_robin(servers):
    port = servers[0].port
    with logitserve.Client("dns:///localhost:%d" % port) as c:
        assert _who(c) == 0
        assert c.health() == "SERVING"
