"""Retries with exponential backoff on UNAVAILABLE (no timing: the waits are recorded)."""

import numpy as np
import pytest

import logitserve
from logitserve import _api
from support import Server, free_port


def _record_waits(monkeypatch, on_wait=None):
    """Records each scheduled backoff (the waits themselves still happen)."""
    waits = []
    step = _api.Backoff.step

    def recording_step(self):
        w = step(self)
        waits.append(w)
        if on_wait is not None:
            on_wait(len(waits))
        return w

    monkeypatch.setattr(_api.Backoff, "step", recording_step)
    return waits


def test_unreachable_server_raises_unavailable_after_retries(monkeypatch):
    waits = _record_waits(monkeypatch)
    with logitserve.Client("127.0.0.1:%d" % free_port(), max_retries=3, initial_backoff=0.01,
                           max_backoff=1.0, timeout=10) as c:
        with pytest.raises(logitserve.Unavailable) as e:
            c.list_heads()
    assert e.value.code.name == "UNAVAILABLE" and isinstance(e.value, ConnectionError)
    assert len(waits) == 3
    # min(0.01 * 2^k, max) less at most 20% jitter: strictly growing.
    for k, w in enumerate(waits):
        assert 0.8 * 0.01 * 2**k <= w <= 0.01 * 2**k
    assert waits[0] < waits[1] < waits[2]


def test_no_retry_on_other_codes(client, monkeypatch):
    waits = _record_waits(monkeypatch)
    with pytest.raises(logitserve.NotFound):
        client.score(head="missing", hidden=np.ones((1, 4), np.float32))
    assert waits == []


def test_server_started_after_the_client_begins(heads, monkeypatch):
    port = free_port()
    server = Server(heads.flags(), port=port)

    def start_on_first_retry(count):
        if count == 1:
            server.start()  # the first attempt failed: the server comes up now

    waits = _record_waits(monkeypatch, start_on_first_retry)
    try:
        with logitserve.Client("127.0.0.1:%d" % port, max_retries=10, initial_backoff=0.05,
                               max_backoff=0.2) as c:
            r = c.score(logits=np.array([[0.0, 0.0]], np.float32), target_ids=[1])
        assert len(waits) >= 1
        assert abs(r.target_logprobs[0] - np.log(0.5)) < 1e-6
    finally:
        server.stop()


def test_stopped_server_gives_unavailable(heads, monkeypatch):
    with Server(heads.flags()) as s:
        c = logitserve.Client(s.address, max_retries=2, initial_backoff=0.01, max_backoff=0.02)
        assert c.health() == "SERVING"
    waits = _record_waits(monkeypatch)
    with pytest.raises(logitserve.Unavailable):
        c.score(logits=np.zeros((1, 2), np.float32), entropy=True)
    assert len(waits) == 2
    c.close()
