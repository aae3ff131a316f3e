"""The copy-saving wire encoding (logitserve._wire) against protobuf's own, byte for byte in
meaning: requests built from arrays parse to the message protobuf would build, responses parsed
with numpy equal protobuf's parse."""

import numpy as np
import pytest

import logitserve
from logitserve import _api, _wire
from logitserve._pb import pb2


def _request(n=5, h=8):
    rng = np.random.default_rng(0)
    bits = logitserve.to_bf16_bits(rng.normal(0, 1, (n, h)).astype(np.float32))
    ids = rng.integers(0, 100, (n, 2)).astype(np.int32)
    return bits, ids, _api.build_request(head="policy", hidden=bits, target_ids=ids, entropy=True,
                                         top_k=3, sequence_lengths=[2, 3], request_id="w")


def test_request_from_arrays_parses_to_the_full_message():
    bits, ids, (req, meta) = _request()
    # Zero copies so far: the request holds the caller's own arrays.
    assert np.shares_memory(req.arrays["hidden"], bits)
    assert np.shares_memory(req.arrays["target_ids"], ids)
    assert req.message.hidden.data == b"" and req.message.target_ids.data == b""
    got = pb2().ScoreRequest.FromString(_wire.serialize(req))
    want = pb2().ScoreRequest(request_id="w", head="policy", entropy=True, top_k=3,
                              sequence_lengths=[2, 3])
    want.hidden.CopyFrom(pb2().Tensor(dtype=pb2().DATA_TYPE_BFLOAT16, shape=[5, 8], data=bits.tobytes()))
    want.target_ids.CopyFrom(pb2().Tensor(dtype=pb2().DATA_TYPE_INT32, shape=[5, 2], data=ids.tobytes()))
    assert got == want


def test_chunk_requests_carry_their_rows_only():
    bits, ids, (req, meta) = _request()
    chunks = _api.plan_chunks(req, meta, 3, 0)
    assert chunks == [(0, 2, 0, 1), (2, 5, 1, 2)]
    second = pb2().ScoreRequest.FromString(_wire.serialize(_api.chunk_request(req, chunks[1])))
    assert list(second.hidden.shape) == [3, 8] and second.hidden.data == bits[2:].tobytes()
    assert second.target_ids.data == ids[2:].tobytes()
    assert list(second.sequence_lengths) == [3]
    assert req.message.hidden.shape[0] == 5  # the original is untouched


def _response():
    rng = np.random.default_rng(1)
    r = pb2().ScoreResponse(request_id="r1", target_ids_per_row=2, top_k=3, head_version=7,
                            reference_head_version=9, queue_us=11, compute_us=1234567)
    r.target_logprobs.extend(rng.normal(0, 1, 10).astype(np.float32))
    r.top_k_ids.extend([0, 1, 127, 128, 16383, 16384, 2 ** 31 - 1, 151935, 5])
    r.top_k_logprobs.extend(rng.normal(0, 1, 9).astype(np.float32))
    r.entropy.extend(rng.normal(0, 1, 3).astype(np.float32))
    r.jsd.extend([np.float32(np.nan), np.float32(-0.0), np.float32(np.inf)])
    r.sequence_sums.entropy.extend([1.5, 2.5])
    r.sequence_sums.token_count.extend([2, 1])
    return r


def test_response_parsed_with_numpy_equals_protobuf():
    want = _response()
    got = _wire.parse_score_response(want.SerializeToString())
    assert isinstance(got, _wire.FastResponse)  # the fast path, not the fallback
    for name in ("target_logprobs", "top_k_logprobs", "entropy", "jsd", "reference_entropy",
                 "forward_kl", "reverse_kl"):
        np.testing.assert_array_equal(got.__getattribute__(name).view(np.uint32),
                                      np.asarray(getattr(want, name), np.float32).view(np.uint32),
                                      err_msg=name)
    np.testing.assert_array_equal(got.top_k_ids, np.asarray(want.top_k_ids, np.int32))
    assert got.top_k_ids.dtype == np.int32
    for name in ("request_id", "target_ids_per_row", "top_k", "head_version",
                 "reference_head_version", "queue_us", "compute_us"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.sequence_sums == want.sequence_sums and got.HasField("sequence_sums")
    assert not got.HasField("sequence_means")


def test_stream_request_is_the_wrapped_request():
    bits, ids, (req, meta) = _request()
    got = pb2().ScoreStreamRequest.FromString(_wire.serialize_stream_request(req))
    assert got.request == req.to_message()
    chunk = _api.chunk_request(req, _api.plan_chunks(req, meta, 3, 0)[1])
    got = pb2().ScoreStreamRequest.FromString(_wire.serialize_stream_request(chunk))
    assert got.request == chunk.to_message()
    plain = pb2().ScoreRequest(request_id="p", head="policy")
    assert pb2().ScoreStreamRequest.FromString(
        _wire.serialize_stream_request(plain)).request == plain


def test_stream_responses_parsed_with_numpy_equal_protobuf():
    want = pb2().ScoreStreamResponse(request_id="r1", response=_response())
    got = _wire.parse_stream_response(want.SerializeToString())
    assert isinstance(got, _wire.StreamResponse) and isinstance(got.response, _wire.FastResponse)
    assert (got.request_id, got.status_code, got.status_message) == ("r1", 0, "")
    np.testing.assert_array_equal(got.response.entropy,
                                  np.asarray(want.response.entropy, np.float32))
    assert got.response.compute_us == want.response.compute_us
    assert got.response.sequence_sums == want.response.sequence_sums


def test_failed_stream_response_and_fallback():
    failed = pb2().ScoreStreamResponse(request_id="x", status_code=3,
                                       status_message="hidden: row 2")
    got = _wire.parse_stream_response(failed.SerializeToString())
    assert (got.status_code, got.status_message, got.request_id) == (3, "hidden: row 2", "x")
    # A negative code (int32 sign-extended on the wire) reads back as protobuf reads it.
    odd = pb2().ScoreStreamResponse(request_id="y", status_code=-2)
    assert _wire.parse_stream_response(odd.SerializeToString()).status_code == -2
    # ScoreResponse's old stream-status fields (18, 19; now reserved): protobuf's fallback.
    old = b"\x90\x01\x03"  # field 18, varint 3
    assert _wire.parse_score_response(old).request_id == ""
    # An unpacked repeated float (legal on the wire, never sent by the server): protobuf parses it.
    unpacked = b"\x15" + np.float32(1.25).tobytes()  # field 2, wire type 5
    got = _wire.parse_score_response(unpacked)
    assert list(got.target_logprobs) == [1.25]


def test_varint_decoding_matches_protobuf():
    values = np.random.default_rng(2).integers(0, 2 ** 31 - 1, 1000).astype(np.int32)
    values[:4] = [0, 127, 128, 2 ** 31 - 1]
    msg = pb2().ScoreResponse(top_k_ids=values.tolist())
    raw = msg.SerializeToString()
    assert raw[0] == 0x1A  # field 3, packed
    length, i = _wire._read_varint(raw, 1)
    np.testing.assert_array_equal(_wire.decode_varints(raw[i:i + length]), values)


def test_responses_parse_from_memoryviews_and_lists_of_them():
    # What a grpcio with its zero-copy receive path hands a deserializer: a memoryview of one
    # slice, or a list of memoryviews of several.
    want = _response()
    raw = want.SerializeToString()
    pieces = [memoryview(raw[:7]), memoryview(raw[7:40]), memoryview(raw[40:])]
    for data in (memoryview(raw), pieces):
        got = _wire.parse_score_response(data)
        assert isinstance(got, _wire.FastResponse)
        np.testing.assert_array_equal(got.entropy, np.asarray(want.entropy, np.float32))
        np.testing.assert_array_equal(got.top_k_ids, np.asarray(want.top_k_ids, np.int32))
        assert got.request_id == "r1" and got.compute_us == want.compute_us
    wrapped = pb2().ScoreStreamResponse(request_id="s", response=want).SerializeToString()
    got = _wire.parse_stream_response([memoryview(wrapped[:3]), memoryview(wrapped[3:])])
    assert got.request_id == "s"
    np.testing.assert_array_equal(got.response.target_logprobs,
                                  np.asarray(want.target_logprobs, np.float32))



def test_repeated_and_long_fields_parse_as_protobuf_merges_them():
    # Packed fields given twice continue their values and embedded messages merge (protobuf's
    # rule); fields over 127 bytes have two-byte lengths, fields 16 and 17 two-byte keys.
    rng = np.random.default_rng(4)
    first = _response()
    first.sequence_means.entropy.extend([0.25])
    first.sequence_means.token_count.extend([3])
    second = pb2().ScoreResponse(compute_us=5, request_id="r2")
    second.entropy.extend(rng.normal(0, 1, 200).astype(np.float32))
    second.target_logprobs.extend([np.float32(-1.5)])
    second.top_k_ids.extend([3, 2 ** 20, 1])
    second.sequence_sums.entropy.extend([9.0])
    second.sequence_means.token_count.extend([4])
    raw = first.SerializeToString() + second.SerializeToString()
    want = pb2().ScoreResponse.FromString(raw)
    got = _wire.parse_score_response(raw)
    assert isinstance(got, _wire.FastResponse)
    for name in ("target_logprobs", "top_k_logprobs", "entropy", "jsd"):
        np.testing.assert_array_equal(getattr(got, name).view(np.uint32),
                                      np.asarray(getattr(want, name), np.float32).view(np.uint32),
                                      err_msg=name)
        assert getattr(got, name).dtype == np.float32
    np.testing.assert_array_equal(got.top_k_ids, np.asarray(want.top_k_ids, np.int32))
    assert (got.request_id, got.compute_us, got.queue_us) == ("r2", 5, 11)
    assert got.sequence_sums == want.sequence_sums
    assert got.sequence_means == want.sequence_means


def test_a_missing_field_reads_as_protobufs_default():
    a = _wire.parse_score_response(b"")
    b = _wire.parse_score_response(pb2().ScoreResponse(head_version=3).SerializeToString())
    assert isinstance(a, _wire.FastResponse) and isinstance(b, _wire.FastResponse)
    assert (a.head_version, b.head_version, a.request_id, a.compute_us) == (0, 3, "", 0)
    assert a.entropy.dtype == np.float32 and a.entropy.size == 0 and a.top_k_ids.size == 0
    assert a.sequence_sums == pb2().SequenceStats() and not a.HasField("sequence_sums")
    assert a.sequence_sums is not b.sequence_sums  # each response its own message
    a.sequence_sums.entropy.append(1.0)
    assert b.sequence_sums == pb2().SequenceStats()


# ---- requests encoded without a message (build_request's cached parts) -----------------------

def _arguments():
    """Score arguments covering every ScoreRequest field, arrays and shared-memory tensors."""
    rng = np.random.default_rng(3)
    bits = logitserve.to_bf16_bits(rng.normal(0, 1, (5, 8)).astype(np.float32))
    ids = rng.integers(0, 100, (5, 2)).astype(np.int32)
    sh = logitserve.SharedTensor("reg", 128, "bf16", (5, 8))
    st = logitserve.SharedTensor("reg", 4096, "int64", (5,))
    options = [
        {}, dict(entropy=True, top_k=3), dict(jsd_beta=-0.0, temperature=0.7, request_id="x"),
        dict(reference_head="ref", reference_hidden=sh, head_version=3, reverse_kl=1,
             forward_kl=np.bool_(True), ignore_index=-100, reference_temperature=1e300,
             sequence_lengths=[2, 3], reference_head_version=0),
        dict(logits=np.zeros((5, 4), np.float32), reference_logits=sh, head=""),
        dict(sequence_lengths=np.array([5]), request_id="\u00e9", jsd_beta=float("nan"),
             dtype="fp16", hidden=np.ones((5, 8), np.float32)),
        # Sizes of every varint length (and negative lengths, for the server to refuse).
        dict(sequence_lengths=[-1, 0, 127, 128, 300, 2 ** 40, -(2 ** 63)],
             reference_hidden=np.zeros((0, 200), np.float32), reference_logits=np.float32(3)),
        dict(sequence_lengths=[], logits=np.zeros((3, 20000), np.float16)),
    ]
    for hidden in (None, bits, sh):
        for target in (None, ids, st, [1, 2, 3, 4, 5]):
            for extra in options:
                args = dict(head="policy", hidden=hidden, target_ids=target)
                args.update(extra)
                yield args


def _assert_encoded_as_the_message(args):
    got, got_meta = _api.build_request(**args)
    want, want_meta = _api._build_message(**args)
    assert got._message is None, args  # encoded directly, not through a message
    assert _wire.serialize(got) == _wire.serialize(want), args  # byte for byte
    assert got.message_bytes() == want.message.SerializeToString()
    inner = _wire.serialize(want)  # wrapped as ScoreStreamRequest.request (field 1)
    assert _wire.serialize_stream_request(got) == b"\x0a" + _wire._varint(len(inner)) + inner
    assert (got.request_id, got.sequence_count(), got.message_size()) == (
        want.request_id, want.sequence_count(), want.message_size())
    assert set(got.arrays) == set(want.arrays)
    for name in _api._Meta.__slots__:
        assert getattr(got_meta, name) == getattr(want_meta, name), (name, args)
    return got


def test_encoded_requests_are_what_protobuf_serializes():
    for args in _arguments():
        _assert_encoded_as_the_message(args)
        _assert_encoded_as_the_message(args)  # again, from the cached parts


def test_cached_option_parts_follow_every_argument():
    # One argument changed at a time, the previous call's parts cached: a cache keyed on less
    # than the arguments (or on == of floats: -0.0 == 0.0) would give the previous bytes.
    sh = logitserve.SharedTensor("reg", 0, "bf16", (4, 8))
    base = dict(head="policy", hidden=sh, target_ids=[1, 2, 3, 4])
    changes = [dict(head="policy16"), dict(reference_head="ref"), dict(head_version=0),
               dict(head_version=2), dict(reference_head_version=5), dict(ignore_index=-100),
               dict(ignore_index=7), dict(top_k=3), dict(top_k=4.0), dict(entropy=True),
               dict(reference_entropy=True), dict(forward_kl=True), dict(reverse_kl=True),
               dict(jsd_beta=0.0), dict(jsd_beta=-0.0), dict(jsd_beta=0.5),
               dict(temperature=0.0), dict(temperature=-0.0), dict(temperature=float("nan")),
               dict(reference_temperature=2.0), dict(reference_temperature=-2.0)]
    seen = set()
    for change in [{}] + changes + [{}] + changes[::-1]:
        wire = _wire.serialize(_assert_encoded_as_the_message(dict(base, **change)))
        seen.add(wire)
    assert len(seen) == len(changes) + 1  # each change encodes differently from the others


def test_shared_tensor_wire_follows_its_attributes():
    t = logitserve.SharedTensor("a", 64, "bf16", (4, 8))

    def check():
        data, shape = t.tensor_wire()
        assert data == t.tensor_message().SerializeToString()
        assert shape == tuple(t.tensor_message().shape)
        got = pb2().ScoreRequest.FromString(_wire.serialize(_api.build_request(hidden=t)[0]))
        assert got.hidden == t.tensor_message()

    check()
    for name, value in (("region", "b"), ("offset", 128), ("dtype", "FLOAT16"),
                        ("shape", (2, 8)), ("offset", 64), ("region", "a")):
        setattr(t, name, value)
        check()
    t.shape = [3, 8]  # a list (not cached), changed in place
    check()
    t.shape.append(1)
    check()
    with pytest.raises(TypeError):  # protobuf's own error for a float offset, never cached
        t.offset = 64.0
        t.tensor_wire()


def _error(build, args):
    try:
        build(**args)
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None


def test_build_errors_are_those_of_the_message_path():
    sh = logitserve.SharedTensor("reg", 0, "bf16", (4, 8))
    bad = [dict(top_k=-1), dict(head_version=-1), dict(ignore_index=2 ** 40), dict(head=5),
           dict(request_id=5), dict(request_id="\ud800"), dict(jsd_beta="x"),
           dict(hidden=np.array(["a"])), dict(target_ids=np.zeros(3)),
           dict(sequence_lengths=[2 ** 70]), dict(entropy=np.zeros(2)), dict(top_k=[3]),
           # Several errors: the first argument in _build_message's order raises.
           dict(hidden=np.array(["a"]), top_k=-1), dict(top_k=-1, ignore_index="x")]
    for args in bad:
        args = dict(dict(head="policy", hidden=sh), **args)
        want = _error(_api._build_message, args)
        assert want is not None, args
        assert _error(_api.build_request, args) == want, args
        assert _error(_api.build_request, args) == want, args  # nothing cached by a failure


def test_an_encoded_requests_message_is_the_request_once_read():
    sh = logitserve.SharedTensor("reg", 0, "bf16", (4, 8))
    req, meta = _api.build_request(head="policy", hidden=sh, target_ids=[1, 2, 3, 4],
                                   sequence_lengths=[1, 3], request_id="q")
    assert _api.plan_chunks(req, meta, 0, 1 << 20) == [(0, 4, 0, 2)]
    assert req._message is None  # planned without parsing the message
    req.message.head_version = 7  # as pin_versions does
    got = pb2().ScoreStreamRequest.FromString(_wire.serialize_stream_request(req)).request
    assert got.head_version == 7 and got.request_id == "q"
    assert req.request_id == "q" and req.message_size() == req.message.ByteSize()
    req.message.request_id = "r"
    assert req.request_id == "r" and req.sequence_count() == 2


def test_the_option_cache_stays_bounded():
    for i in range(_api._OPTION_CACHE_MAX + 10):
        _api.build_request(head="policy", temperature=1.0 + i / 1024)
        assert len(_api._OPTION_CACHE) <= _api._OPTION_CACHE_MAX


# ---- results -----------------------------------------------------------------------------------

def _chunk_response(rows, k, top_k, nseq, seed):
    rng = np.random.default_rng(seed)
    f = lambda n: rng.normal(0, 1, n).astype(np.float32)  # noqa: E731
    r = pb2().ScoreResponse(head_version=seed, reference_head_version=seed + 1, queue_us=seed,
                            compute_us=10 * seed)
    r.target_logprobs.extend(f(rows * k))
    r.top_k_ids.extend(rng.integers(0, 1000, rows * top_k).tolist())
    r.top_k_logprobs.extend(f(rows * top_k))
    for name in ("entropy", "forward_kl", "jsd"):
        getattr(r, name).extend(f(rows))
    for stats in (r.sequence_sums, r.sequence_means):
        stats.target_logprobs.extend(f(nseq * k))
        stats.entropy.extend(f(nseq))
        stats.forward_kl.extend(f(nseq))
        stats.jsd.extend(f(nseq))
        stats.token_count.extend(rng.integers(0, 9, nseq).tolist())
    return r


def _meta(rows, k, top_k, nseq):
    meta = _api._Meta()
    meta.rows, meta.ids_shape, meta.top_k, meta.sequences = rows, (rows, k), top_k, nseq
    meta.outputs = {"entropy": True, "reference_entropy": False, "forward_kl": True,
                    "reverse_kl": False, "jsd": True}
    meta.head = meta.reference_head = True
    return meta


def test_results_are_new_arrays_of_the_chunks_values_in_order():
    chunks = [(0, 3, 0, 1), (3, 7, 1, 3)]
    protos = [_chunk_response(3, 2, 4, 1, seed=1), _chunk_response(4, 2, 4, 2, seed=2)]
    meta = _meta(7, 2, 4, 3)
    for kind in ("fast", "protobuf"):
        responses = [_wire.parse_score_response(p.SerializeToString()) if kind == "fast" else p
                     for p in protos]
        for use in (chunks, chunks[:1]):
            m = meta if use is chunks else _meta(3, 2, 4, 1)
            res = _api.assemble(responses[:len(use)], use, m, "id")
            parts = protos[:len(use)]
            cat = lambda get, dtype: np.concatenate(  # noqa: E731
                [np.asarray(get(p), dtype) for p in parts])
            want = {"target_logprobs": cat(lambda p: p.target_logprobs, np.float32).reshape(-1, 2),
                    "top_k_ids": cat(lambda p: p.top_k_ids, np.int32).reshape(-1, 4),
                    "top_k_logprobs": cat(lambda p: p.top_k_logprobs, np.float32).reshape(-1, 4),
                    "entropy": cat(lambda p: p.entropy, np.float32),
                    "forward_kl": cat(lambda p: p.forward_kl, np.float32),
                    "jsd": cat(lambda p: p.jsd, np.float32)}
            for name, w in want.items():
                got = getattr(res, name)
                assert got.dtype == w.dtype and got.shape == w.shape, (kind, name)
                np.testing.assert_array_equal(got.view(np.uint32), w.view(np.uint32))
                assert got.flags.writeable and got.flags.c_contiguous, (kind, name)
                for r in responses:  # never a view of a response's bytes
                    assert not np.shares_memory(got, np.asarray(getattr(r, name))), name
            assert res.reference_entropy is None and res.reverse_kl is None
            for key in ("sums", "means"):
                stats = getattr(res, "sequence_" + key)
                msgs = [getattr(p, "sequence_" + key) for p in parts]
                np.testing.assert_array_equal(
                    stats.token_count, np.concatenate([np.asarray(s.token_count) for s in msgs]))
                assert stats.token_count.dtype == np.int64
                assert stats.target_logprobs.shape == (m.sequences, 2)
                np.testing.assert_array_equal(
                    stats.jsd, np.concatenate([np.asarray(s.jsd, np.float32) for s in msgs]))
                assert stats.reverse_kl is None
            assert (res.chunks, res.queue_us, res.compute_us) == (
                len(use), sum(p.queue_us for p in parts), sum(p.compute_us for p in parts))
            assert (res.head_version, res.reference_head_version) == (1, 2)


def test_result_size_errors_name_the_first_field_off():
    chunks = [(0, 3, 0, 1), (3, 7, 1, 3)]
    meta = _meta(7, 2, 4, 3)

    def error(edit):
        protos = [_chunk_response(3, 2, 4, 1, seed=1), _chunk_response(4, 2, 4, 2, seed=2)]
        edit(protos)
        with pytest.raises(logitserve.Internal) as e:
            _api.assemble([_wire.parse_score_response(p.SerializeToString()) for p in protos],
                          chunks, meta, "")
        return str(e.value)

    def both(p):
        p[1].entropy.append(1.0)
        p[1].target_logprobs.append(1.0)

    assert "field target_logprobs has 9 values, expected 8" in error(both)
    assert "field jsd has 2 values, expected 3" in error(lambda p: p[0].jsd.pop())

    def stats(p):
        p[0].sequence_means.token_count.append(1)
        p[0].sequence_sums.entropy.append(1.0)
        p[1].top_k_ids.append(1)

    assert "sequence_sums.entropy has 2 values, expected 1" in error(stats)
    assert "sequence_means has 2 sequences, expected 1" in error(
        lambda p: p[0].sequence_means.token_count.append(1))
