"""Every Score output against the fp64 numpy reference (tests/reference.py)."""

import numpy as np
import pytest

import logitserve
import reference as ref
from conftest import H, H_REF, V


def _hidden(seed, n, h=H):
    return np.random.default_rng(seed).normal(0, 1, (n, h)).astype(np.float32)


def _bf16_exact(x):
    """float32 values exactly representable in bf16 (so fp32 / bf16 inputs carry the same values)."""
    return logitserve.bf16_bits_to_f32(logitserve.to_bf16_bits(x))


def _check(name, got, want, tol):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    assert got.shape == want.shape, name
    assert np.all(err <= tol), "%s: max error %g > tolerance %g" % (
        name, float(np.max(err - tol + np.min(tol))), float(np.min(tol)))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_hidden_mode_every_output_matches_fp64(client, heads, dtype):
    n = 9
    h = _hidden(1, n)
    h_ref = _hidden(2, n, H_REF)
    if dtype == "fp16":
        h, h_ref = h.astype(np.float16), h_ref.astype(np.float16)
    ids = np.random.default_rng(3).integers(0, V, n)
    ids[4] = -100
    r = client.score(head="policy", hidden=h, target_ids=ids, reference_head="reference",
                     reference_hidden=h_ref, entropy=True, reference_entropy=True,
                     forward_kl=True, reverse_kl=True, jsd_beta=0.3, top_k=5,
                     dtype=None if dtype == "fp16" else dtype)
    # The exact values the server received.
    h_sent = _bf16_exact(h) if dtype == "bf16" else h.astype(np.float32)
    r_sent = _bf16_exact(h_ref) if dtype == "bf16" else h_ref.astype(np.float32)
    z = ref.logits64(h_sent, heads.policy)
    zq = ref.logits64(r_sent, heads.weights["reference"])
    lp, lq = ref.log_softmax(z), ref.log_softmax(zq)
    dz = np.maximum(ref.gemm_error_bound(h_sent, heads.policy),
                    ref.gemm_error_bound(r_sent, heads.weights["reference"]))[:, None]
    rng_z = max(np.ptp(z, axis=1).max(), np.ptp(zq, axis=1).max())
    want_lp = ref.target_logprobs(lp, ids)
    _check("target_logprobs", r.target_logprobs, want_lp, ref.logprob_tol(V, dz[:, 0], want_lp))
    assert r.target_logprobs[4] == 0.0  # ignored id: exactly 0
    st = ref.stat_tol(V, dz[:, 0], rng_z)
    _check("entropy", r.entropy, ref.entropy(lp), st)
    _check("reference_entropy", r.reference_entropy, ref.entropy(lq), st)
    _check("forward_kl", r.forward_kl, ref.kl(lq, lp), st)
    _check("reverse_kl", r.reverse_kl, ref.kl(lp, lq), st)
    _check("jsd", r.jsd, ref.jsd(lp, lq, 0.3), st)
    want_ids, want_top = ref.top_k(lp, 5)
    assert r.top_k_ids.shape == (n, 5) and r.top_k_ids.dtype == np.int32
    np.testing.assert_array_equal(r.top_k_ids, want_ids)  # random logits: no near-ties at 1e-4
    _check("top_k_logprobs", r.top_k_logprobs, want_top, ref.logprob_tol(V, dz, want_top))
    assert r.head_version >= 1 and r.reference_head_version >= 1
    assert r.queue_us >= 0 and r.compute_us >= 0 and r.chunks == 1


def test_fp16_head(client, heads):
    h = _hidden(5, 4)
    ids = np.arange(4) * 700
    r = client.score(head="policy16", hidden=h, target_ids=ids, entropy=True)
    z = ref.logits64(h, heads.weights["policy16"])
    lp = ref.log_softmax(z)
    dz = ref.gemm_error_bound(h, heads.weights["policy16"])
    want = ref.target_logprobs(lp, ids)
    _check("target_logprobs", r.target_logprobs, want, ref.logprob_tol(V, dz, want))
    _check("entropy", r.entropy, ref.entropy(lp), ref.stat_tol(V, dz, np.ptp(z, axis=1).max()))


def test_same_values_in_any_dtype_give_identical_bits(client):
    # Determinism promise: the reduction order does not depend on the input dtype.
    h = _bf16_exact(_hidden(6, 5))
    outs = [client.score(head="policy", hidden=x, target_ids=np.arange(5), entropy=True, dtype=d)
            for x, d in ((h, "fp32"), (h, "bf16"), (logitserve.to_bf16_bits(h), None),
                         (h.astype(np.float64), "bf16"))]
    for o in outs[1:]:
        np.testing.assert_array_equal(o.target_logprobs, outs[0].target_logprobs)
        np.testing.assert_array_equal(o.entropy, outs[0].entropy)
    # fp16 path: values exact in both bf16 and fp16 (8 significant bits, small exponent range)
    h16 = np.round(h * 16) / 16
    a = client.score(head="policy", hidden=h16, entropy=True, dtype="fp32")
    b = client.score(head="policy", hidden=h16.astype(np.float16), entropy=True)
    np.testing.assert_array_equal(a.entropy, b.entropy)


def test_batch_invariance(client):
    h = _hidden(7, 12)
    full = client.score(head="policy", hidden=h, target_ids=np.arange(12), entropy=True)
    for i in (0, 5, 11):
        one = client.score(head="policy", hidden=h[i:i + 1], target_ids=[i], entropy=True)
        assert one.entropy[0] == full.entropy[i]
        assert one.target_logprobs[0] == full.target_logprobs[i]


@pytest.mark.parametrize("temperature,ref_temperature", [(0.7, 1.6), (2.0, 1.0)])
def test_logits_mode_with_temperatures(client, temperature, ref_temperature):
    rng = np.random.default_rng(8)
    n, v = 6, 517
    z = rng.normal(0, 3, (n, v)).astype(np.float32)
    zq = rng.normal(0, 3, (n, v)).astype(np.float32)
    ids = rng.integers(0, v, (n, 3))
    r = client.score(logits=z, reference_logits=zq, target_ids=ids, entropy=True,
                     reference_entropy=True, forward_kl=True, reverse_kl=True, jsd_beta=0.5,
                     temperature=temperature, reference_temperature=ref_temperature)
    lp = ref.log_softmax(z, temperature)
    lq = ref.log_softmax(zq, ref_temperature)
    # z / T in fp32: one rounding, |dz| <= |z / T| u.
    dz = np.max(np.abs(z), axis=1) / min(temperature, ref_temperature) * ref.EPS32
    want = ref.target_logprobs(lp, ids)
    assert r.target_logprobs.shape == (n, 3)
    _check("target_logprobs", r.target_logprobs, want, ref.logprob_tol(v, dz[:, None], want))
    st = ref.stat_tol(v, dz, 2 * np.abs(z).max() / min(temperature, ref_temperature))
    _check("entropy", r.entropy, ref.entropy(lp), st)
    _check("reference_entropy", r.reference_entropy, ref.entropy(lq), st)
    _check("forward_kl", r.forward_kl, ref.kl(lq, lp), st)
    _check("reverse_kl", r.reverse_kl, ref.kl(lp, lq), st)
    _check("jsd", r.jsd, ref.jsd(lp, lq, 0.5), st)
    assert r.head_version == 0


def test_jsd_endpoints_are_forward_and_reverse_kl_exactly(client):
    rng = np.random.default_rng(9)
    z = rng.normal(0, 2, (5, 300)).astype(np.float32)
    zq = rng.normal(0, 2, (5, 300)).astype(np.float32)
    r0 = client.score(logits=z, reference_logits=zq, forward_kl=True, reverse_kl=True, jsd_beta=0.0)
    r1 = client.score(logits=z, reference_logits=zq, jsd_beta=1.0)
    np.testing.assert_array_equal(r0.jsd, r0.forward_kl)
    np.testing.assert_array_equal(r1.jsd, r0.reverse_kl)
    # The interior tends to 0 at the endpoints: a small beta is far from the beta=0 value.
    rs = client.score(logits=z, reference_logits=zq, jsd_beta=1e-3)
    assert np.all(rs.jsd < 0.01 * r0.forward_kl)


def test_masked_tokens_and_support_mismatch(client):
    ninf = -np.inf
    z = np.array([[0.0, -200.0, 1.0], [0.0, 0.0, ninf], [0.0, ninf, ninf]], np.float32)
    zq = np.array([[0.0, ninf, 1.0], [0.0, 0.0, 0.0], [0.0, ninf, ninf]], np.float32)
    r = client.score(logits=z, reference_logits=zq, target_ids=[1, 2, 0], entropy=True,
                     forward_kl=True, reverse_kl=True, jsd_beta=0.5)
    # Row 0: p supports token 1 (p underflows but is not masked), q masks it: KL(p||q) = +inf.
    assert r.reverse_kl[0] == np.inf
    # Row 1: KL(q || p) with q supporting token 2 that p masks: +inf; KL(p || q) = ln(3/2).
    assert r.forward_kl[1] == np.inf
    assert abs(r.reverse_kl[1] - np.log(1.5)) <= 4 * ref.EPS32
    assert r.target_logprobs[1] == -np.inf  # a masked token's log-probability
    # Row 2: one-hot on both sides: H = 0 and KL = 0 exactly; JSD finite.
    assert r.entropy[2] == 0.0 and r.forward_kl[2] == 0.0 and r.reverse_kl[2] == 0.0
    assert np.all(np.isfinite(r.jsd))


def test_target_ids_with_ignore_index(client, heads):
    h = _hidden(10, 4)
    ids = np.array([[5, -100, 5], [-100, -100, -100], [0, V - 1, 17], [-100, 3, -100]])
    r = client.score(head="policy", hidden=h, target_ids=ids.astype(np.int32))
    lp = ref.log_softmax(ref.logits64(h, heads.policy))
    assert r.target_logprobs.shape == (4, 3)
    assert np.all(r.target_logprobs[1] == 0.0) and r.target_logprobs[0, 1] == 0.0
    assert r.target_logprobs[3, 0] == 0.0 and r.target_logprobs[3, 2] == 0.0
    assert r.target_logprobs[0, 0] == r.target_logprobs[0, 2]  # duplicate ids: same value
    dz = ref.gemm_error_bound(h, heads.policy)[:, None]
    want = ref.target_logprobs(lp, ids)
    _check("target_logprobs", r.target_logprobs, want, ref.logprob_tol(V, dz, want))
    # A custom ignore_index: -7 is ignored, -100 becomes a real (out-of-range) id.
    custom = np.where(ids == -100, -7, ids)
    r7 = client.score(head="policy", hidden=h, target_ids=custom, ignore_index=-7)
    np.testing.assert_array_equal(r7.target_logprobs, r.target_logprobs)
    with pytest.raises(logitserve.InvalidArgument, match="target_ids"):
        client.score(head="policy", hidden=h, target_ids=ids, ignore_index=-7)


def test_top_k_ties_broken_by_smaller_id(client):
    z = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0, 2.0, -np.inf]], np.float32)
    r = client.score(logits=z, top_k=6)
    np.testing.assert_array_equal(r.top_k_ids[0], [1, 2, 4, 5, 6, 0])
    lp = ref.log_softmax(z)[0]
    np.testing.assert_allclose(r.top_k_logprobs[0], lp[[1, 2, 4, 5, 6, 0]], rtol=0, atol=8 * ref.EPS32)
    assert r.top_k_logprobs[0, 0] == r.top_k_logprobs[0, 1] == r.top_k_logprobs[0, 2]


def test_sequence_sums_and_means(client, heads):
    n = 11
    h = _hidden(11, n)
    h_ref = _hidden(12, n, H_REF)
    ids = np.random.default_rng(13).integers(0, V, (n, 2))
    ids[0] = -100             # prompt row: not counted
    ids[5, 0] = -100          # one ignored id: counted, contributes 0
    ids[7:9] = -100           # the whole third sequence is ignored: mean NaN
    lengths = [4, 3, 2, 0, 2]
    r = client.score(head="policy", hidden=h, target_ids=ids, reference_head="reference",
                     reference_hidden=h_ref, entropy=True, forward_kl=True, reverse_kl=True,
                     jsd_beta=0.25, sequence_lengths=lengths)
    counted = ~np.all(ids == -100, axis=1)
    np.testing.assert_array_equal(r.sequence_sums.token_count, [3, 3, 0, 0, 2])
    np.testing.assert_array_equal(r.sequence_means.token_count, [3, 3, 0, 0, 2])
    assert r.sequence_sums.reference_entropy is None  # not asked for
    for name in ("target_logprobs", "entropy", "forward_kl", "reverse_kl", "jsd"):
        per_token = getattr(r, name).astype(np.float64)
        sums, means, _ = ref.sequence_stats(per_token, lengths, counted)
        got_s = getattr(r.sequence_sums, name)
        got_m = getattr(r.sequence_means, name)
        # Sums of fp32 outputs (the per-token outputs are checked above against fp64): the sum
        # and mean round once to fp32.
        np.testing.assert_allclose(got_s, sums, rtol=ref.EPS32, atol=0)
        np.testing.assert_allclose(got_m, means, rtol=ref.EPS32, atol=0, equal_nan=True)
        assert np.all(np.isnan(got_m[2])) and np.all(got_s[3] == 0)
    assert r.sequence_sums.target_logprobs.shape == (5, 2)
    # And the per-token values themselves against fp64.
    lp = ref.log_softmax(ref.logits64(h, heads.policy))
    want = ref.target_logprobs(lp, ids)
    dz = ref.gemm_error_bound(h, heads.policy)[:, None]
    _check("target_logprobs", r.target_logprobs, want, ref.logprob_tol(V, dz, want))


def test_empty_request(client):
    r = client.score(head="policy", hidden=np.zeros((0, H), np.float32),
                     target_ids=np.zeros((0,), np.int64), entropy=True, top_k=3)
    assert r.target_logprobs.shape == (0,) and r.entropy.shape == (0,)
    assert r.top_k_ids.shape == (0, 3)


def test_list_heads_and_health(client, heads):
    assert client.health() == "SERVING"
    info = client.list_heads()
    assert info.backend == "cpu" and info.max_top_k == 64
    assert info.max_tokens_per_request > 0 and info.max_receive_message_bytes > 0
    p = info["policy"]
    assert (p.vocab_size, p.hidden_size, p.dtype) == (V, H, "bf16")
    assert info["reference"].dtype == "fp32" and info["policy16"].dtype == "fp16"
    assert info["reference"].hidden_size == H_REF
    assert p.shards and p.shards[0][1] == 0 and p.shards[-1][2] == V
