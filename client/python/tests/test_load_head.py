"""LoadHead through client.load_head: uploaded weights and transforms against the fp64 reference,
versions and pins, and hot swap under load (no result mixes versions)."""

import threading

import numpy as np
import pytest

import logitserve
import reference as ref

V_UP, H_UP = 777, 32


def _weights(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 0.4, (V_UP, H_UP)).astype(dtype), rng.normal(0, 1, V_UP).astype(np.float32)


def _transformed(z, scale=1.0, divide=False, cap=0.0, temperature=1.0):
    z = z / scale if divide else z * scale
    if cap > 0:
        z = cap * np.tanh(z / cap)
    return z / temperature


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_uploaded_head_with_transform_matches_fp64(client, dtype):
    w, b = _weights(50)
    name = "up_" + dtype
    if dtype == "fp16":
        w, b = w.astype(np.float16), b.astype(np.float16)
    info = client.load_head(name, w, bias=b, dtype=None if dtype == "fp16" else dtype,
                            logit_scale=0.5, final_logit_softcapping=4.0, chunk_bytes=10000)
    assert (info.name, info.vocab_size, info.hidden_size, info.dtype) == (name, V_UP, H_UP, dtype)
    assert info.has_bias and info.logit_scale == 0.5 and info.final_logit_softcapping == 4.0
    assert info.version >= 1
    # The exact values the server holds: bf16 by independent rounding, fp16 / fp32 as sent.
    w64 = ref.bf16_round(w).reshape(w.shape) if dtype == "bf16" else w.astype(np.float64)
    b64 = ref.bf16_round(b) if dtype == "bf16" else b.astype(np.float64)
    h = np.random.default_rng(51).normal(0, 1, (5, H_UP)).astype(np.float32)
    ids = np.array([0, 1, 100, 500, V_UP - 1])
    r = client.score(head=name, hidden=h, target_ids=ids, entropy=True, temperature=0.8,
                     head_version=info.version)
    raw = ref.logits64(h, w64, b64)
    z = _transformed(raw, scale=0.5, cap=4.0, temperature=0.8)
    lp = ref.log_softmax(z)
    # dz: GEMM bound (plus bias add), times the scale and 1/T (tanh is 1-Lipschitz), plus a few
    # roundings of each transform step (|z| u each) and libm tanh (cap * 4u).
    dz = (ref.gemm_error_bound(h, w64) + np.max(np.abs(raw), 1) * ref.EPS32) * 0.5 / 0.8 \
        + 8 * (4.0 / 0.8) * ref.EPS32
    want = ref.target_logprobs(lp, ids)
    assert np.all(np.abs(r.target_logprobs - want) <= ref.logprob_tol(V_UP, dz, want))
    assert np.all(np.abs(r.entropy - ref.entropy(lp)) <= ref.stat_tol(V_UP, dz, 8.0 / 0.8))


def test_logits_scaling_divides(client):
    w, _ = _weights(52)
    info = client.load_head("up_div", w, logits_scaling=4.0)
    assert info.logits_scaling == 4.0 and not info.has_bias
    h = np.random.default_rng(53).normal(0, 1, (3, H_UP)).astype(np.float32)
    r = client.score(head="up_div", hidden=h, entropy=True)
    raw = ref.logits64(h, w)
    lp = ref.log_softmax(_transformed(raw, scale=4.0, divide=True))
    dz = (ref.gemm_error_bound(h, w) + np.max(np.abs(raw), 1) * ref.EPS32) / 4.0
    assert np.all(np.abs(r.entropy - ref.entropy(lp)) <= ref.stat_tol(V_UP, dz, np.ptp(raw) / 4))


def test_versions_and_pins(client):
    w, _ = _weights(54)
    v1 = client.load_head("up_ver", w).version
    v2 = client.load_head("up_ver", w * 2).version
    assert v2 == v1 + 1
    v9 = client.load_head("up_ver", w, version=v2 + 7).version
    assert v9 == v2 + 7
    assert client.list_heads()["up_ver"].version == v9
    with pytest.raises(logitserve.FailedPrecondition):
        client.load_head("up_ver", w, version=v9)  # not greater than the current version
    h = np.ones((1, H_UP), np.float32)
    with pytest.raises(logitserve.FailedPrecondition, match="head_version"):
        client.score(head="up_ver", hidden=h, head_version=v2)
    assert client.score(head="up_ver", hidden=h, head_version=v9).head_version == v9
    both = dict(head="up_ver", hidden=h, reference_head="up_ver", reference_hidden=h, forward_kl=True)
    r = client.score(reference_head_version=v9, **both)
    assert r.reference_head_version == v9 and r.forward_kl[0] == 0.0  # KL(p || p) = 0 exactly
    with pytest.raises(logitserve.FailedPrecondition, match="reference_head_version"):
        client.score(reference_head_version=v1, **both)
    with pytest.raises(ValueError, match="bias"):
        client.load_head("up_ver", w, bias=np.zeros(3, np.float32))


def test_async_load_head(server):
    import asyncio
    w, _ = _weights(55)

    async def main():
        async with logitserve.AsyncClient(server.address) as a:
            info = await a.load_head("up_async", w)
            r = await a.score(head="up_async", hidden=np.ones((2, H_UP), np.float32),
                              head_version=info.version, entropy=True)
            return info, r

    info, r = asyncio.run(main())
    assert info.version >= 1 and r.head_version == info.version and r.entropy.shape == (2,)


def test_hot_swap_under_load_never_mixes_versions(server):
    # Head "swap" [4, 1] at version v has weight rows [v, 0, 0, 0]: with hidden [[1]] every row's
    # log p(0) = v - log(e^v + 3) tells which version computed it.
    def weight(v):
        w = np.zeros((4, 1), np.float32)
        w[0, 0] = v
        return w

    admin = logitserve.Client(server.address)
    first = admin.load_head("swap", weight(1)).version
    stop = threading.Event()
    seen, errors = [], []

    def scorer():
        # Split into 4-row chunks: later chunks are pinned to the first chunk's version.
        with logitserve.Client(server.address, max_rows_per_request=4) as c:
            while not stop.is_set():
                try:
                    r = c.score(head="swap", hidden=np.ones((16, 1), np.float32),
                                target_ids=np.zeros(16, np.int64))
                except logitserve.FailedPrecondition:
                    continue  # swapped between chunks: refused, never mixed
                except Exception as e:  # noqa: BLE001 - any other failure fails the test
                    errors.append(e)
                    return
                seen.append((r.head_version, r.target_logprobs.copy()))

    threads = [threading.Thread(target=scorer) for _ in range(2)]
    for t in threads:
        t.start()
    versions = {first: 1}
    for step in range(2, 8):
        # Swap only once some result came back since the last swap (threads may start late).
        count = len(seen)
        while len(seen) == count and not errors and all(t.is_alive() for t in threads):
            stop.wait(0.005)
        versions[admin.load_head("swap", weight(step)).version] = step
    stop.set()
    for t in threads:
        t.join()
    admin.close()
    assert not errors, errors
    assert seen
    for version, lp in seen:
        v = versions[version]
        want = np.float32(v - np.log(np.exp(v) + 3.0))
        assert np.all(np.abs(lp - want) <= 4 * ref.EPS32 * max(1.0, abs(want))), (version, lp)
    assert len({v for v, _ in seen}) >= 2  # the load really spanned swaps
