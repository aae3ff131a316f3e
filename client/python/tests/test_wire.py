"""The copy-saving wire encoding (logitserve._wire) against protobuf's own, byte for byte in
meaning: requests built from arrays parse to the message protobuf would build, responses parsed
with numpy equal protobuf's parse."""

import numpy as np

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
