"""Score requests and responses on the wire without needless copies (issue 12, target 4).

Requests: the ScoreRequest message holds every field except the bytes of its row tensors, which
stay in numpy arrays (`WireRequest.arrays`, field name -> C-contiguous little-endian array of the
wire dtype, rows first). `serialize` writes the message and then, per array, one more occurrence
of the tensor field holding only `data`: protobuf parsers merge repeated occurrences of an
embedded message, so the server sees one Tensor with dtype, shape and data. The array bytes are
copied once, into the bytes object gRPC sends; a chunk of rows is a slice of the same arrays.
build_request writes the message's own bytes directly (WireRequest.encoded) from parts cached
between calls, and the message object is parsed from them only where one is needed.

ScoreStream wraps each request in a ScoreStreamRequest (`request`, field 1) and each answer in a
ScoreStreamResponse (request_id, response, status_code, status_message): `serialize_stream_request`
prefixes the same parts with the wrapper's tag and length (no second copy), and
`parse_stream_response` reads the wrapper and hands `response` to the fast parser.

Responses: `parse_score_response` reads the packed float outputs with numpy.frombuffer, and the
packed int32 top-k ids with a vectorised varint decode, instead of protobuf's per-element
containers. Anything it does not expect (an unpacked repeated field, an unknown wire type) falls
back to the protobuf parser, so it is never less correct than ScoreResponse.FromString.
"""

import numpy as np

from . import _pb

SCORE_METHOD = "/logitserve.v1.Scorer/Score"
SCORE_STREAM_METHOD = "/logitserve.v1.Scorer/ScoreStream"

# ScoreRequest field numbers of the row tensors, and Tensor.data's.
ROW_TENSOR_FIELDS = {"hidden": 3, "logits": 4, "reference_hidden": 7, "reference_logits": 8,
                     "target_ids": 10}
_TENSOR_DATA_FIELD = 3
# ScoreStreamRequest.request; ScoreStreamResponse's fields.
_STREAM_REQUEST_FIELD = 1
_STREAM_RESPONSE_REQUEST_ID, _STREAM_RESPONSE_RESPONSE = 1, 2
_STREAM_RESPONSE_STATUS_CODE, _STREAM_RESPONSE_STATUS_MESSAGE = 3, 4
_LEN = 2  # wire type of length-delimited fields


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _tag(field, wire_type):
    return _varint((field << 3) | wire_type)


# Tags of the length-delimited fields numbered 1..20 (ScoreRequest's, ScoreStreamRequest's).
_LEN_TAGS = [None] + [_tag(f, _LEN) for f in range(1, 21)]
_ONE_BYTE = [bytes((n,)) for n in range(128)]


def field(number, payload):
    """Wire bytes of length-delimited field `number` (1..20) holding the bytes `payload`."""
    n = len(payload)
    return _LEN_TAGS[number] + (_ONE_BYTE[n] if n < 128 else _varint(n)) + payload


_U64 = (1 << 64) - 1


def packed_varints(values):
    """The packed encoding of int64 values (a negative one as its 64-bit two's complement)."""
    return b"".join([_ONE_BYTE[v] if 0 <= v < 128 else _varint(v & _U64) for v in values])


def tensor_header(dtype, shape):
    """Tensor bytes holding only `dtype` (a DataType value) and `shape` (sizes >= 0), as
    protobuf serializes them."""
    dims = packed_varints(shape)
    head = b"\x08" + _varint(dtype) if dtype else b""
    return head + field(2, dims) if dims else head


class WireRequest:
    """A ScoreRequest (`message`, row-tensor data left empty) plus the row tensors' bytes as
    arrays; rows [row_begin, row_end) of the arrays belong to this message (all when None).

    build_request encodes the message straight to its bytes (WireRequest.encoded: `prefix`,
    what SerializeToString would give, and no row-tensor data in it); `message` is then parsed
    from them the first time it is asked for, and from there on the message is the request
    (callers may change it), so ask for it before sharing the request between threads."""

    __slots__ = ("_message", "_prefix", "_request_id", "_sequences", "arrays", "row_begin",
                 "row_end")

    def __init__(self, message, arrays, row_begin=None, row_end=None):
        self._message = message
        self._prefix = None
        self._request_id = None
        self._sequences = 0
        self.arrays = arrays
        self.row_begin = row_begin
        self.row_end = row_end

    @classmethod
    def encoded(cls, prefix, arrays, request_id, sequences):
        """The request of the ScoreRequest bytes `prefix`, whose request_id is `request_id` and
        which has `sequences` sequence_lengths."""
        r = cls(None, arrays)
        r._prefix = prefix
        r._request_id = request_id
        r._sequences = sequences
        return r

    @property
    def message(self):
        m = self._message
        if m is None:
            m = self._message = _pb.pb2().ScoreRequest.FromString(self._prefix)
        return m

    @property
    def request_id(self):
        m = self._message
        return self._request_id if m is None else m.request_id

    def sequence_count(self):
        """len(message.sequence_lengths)."""
        m = self._message
        return self._sequences if m is None else len(m.sequence_lengths)

    def message_bytes(self):
        """The message serialized (without the arrays' bytes)."""
        m = self._message
        return self._prefix if m is None else m.SerializeToString()

    def message_size(self):
        """len(message_bytes())."""
        m = self._message
        return len(self._prefix) if m is None else m.ByteSize()

    def tensor_data_bytes(self, field):
        """len(message.<field>.data): 0 when absent, and in an encoded request (whose row
        tensors are arrays or shared memory)."""
        m = self._message
        if m is None or not m.HasField(field):
            return 0
        return len(getattr(m, field).data)

    def array_bytes(self):
        return sum(self._rows(a).nbytes for a in self.arrays.values())

    def _rows(self, a):
        return a if self.row_begin is None else a[self.row_begin:self.row_end]

    def to_message(self):
        """The complete ScoreRequest message (copies the bytes; for tests and debugging)."""
        return _pb.pb2().ScoreRequest.FromString(serialize(self))


def pieces(request):
    """The wire bytes of a WireRequest (or of a plain protobuf message) as a list of bytes
    objects and C-contiguous numpy arrays (the rows, in place), in order."""
    if not isinstance(request, WireRequest):
        return [request.SerializeToString()]
    parts = [request.message_bytes()]
    for field, array in request.arrays.items():
        rows = request._rows(array)
        n = rows.nbytes
        inner = _tag(_TENSOR_DATA_FIELD, _LEN) + _varint(n)
        parts.append(_tag(ROW_TENSOR_FIELDS[field], _LEN) + _varint(len(inner) + n) + inner)
        parts.append(rows if n else b"")
    return parts


def _parts(request):
    """pieces() with the arrays as byte memoryviews (what bytes.join takes)."""
    return [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in pieces(request)]


def serialize(request):
    """Wire bytes of a WireRequest (or of a plain protobuf message)."""
    parts = _parts(request)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def serialize_stream_request(request):
    """Wire bytes of the ScoreStreamRequest carrying `request` (a WireRequest or a ScoreRequest;
    a ScoreStreamRequest message is sent as it is)."""
    if type(request).__name__ == "ScoreStreamRequest":
        return request.SerializeToString()
    if isinstance(request, WireRequest) and not request.arrays:  # a shared-memory request
        return field(_STREAM_REQUEST_FIELD, request.message_bytes())
    parts = _parts(request)
    n = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    return b"".join([_tag(_STREAM_REQUEST_FIELD, _LEN) + _varint(n)] + parts)


# ---- responses -----------------------------------------------------------------------------

_FLOAT_FIELDS = {2: "target_logprobs", 4: "top_k_logprobs", 5: "entropy", 6: "reference_entropy",
                 7: "forward_kl", 8: "reverse_kl", 9: "jsd"}
_INT_FIELDS = {10: "target_ids_per_row", 11: "top_k", 13: "head_version",
               14: "reference_head_version", 15: "queue_us", 16: "compute_us"}
_SEQUENCE_FIELDS = {12: "sequence_sums", 17: "sequence_means"}
_EMPTY_F32 = np.zeros(0, np.float32)
_EMPTY_I32 = np.zeros(0, np.int32)
_F32_WIRE = np.dtype("<f4")
_F32_NATIVE = _F32_WIRE == np.dtype(np.float32)  # else astype on a big-endian host


class FastResponse:
    """A ScoreResponse with its repeated outputs as read-only numpy arrays (the attribute names of
    logitserve.v1.ScoreResponse; sequence_sums / sequence_means are SequenceStats messages, made
    when first read). A field the response lacks reads as the class's default."""

    request_id = ""
    target_logprobs = top_k_logprobs = entropy = reference_entropy = _EMPTY_F32
    forward_kl = reverse_kl = jsd = _EMPTY_F32
    top_k_ids = _EMPTY_I32
    target_ids_per_row = top_k = head_version = reference_head_version = 0
    queue_us = compute_us = 0

    def _stats(self, name):
        d = self.__dict__
        m = d.get(name)
        if m is None:
            m = d[name] = _pb.pb2().SequenceStats()
        return m

    @property
    def sequence_sums(self):
        return self._stats("_sequence_sums")

    @property
    def sequence_means(self):
        return self._stats("_sequence_means")

    def HasField(self, name):  # noqa: N802 - protobuf's spelling
        return bool(getattr(self, "_has_" + name, False))


def _read_varint(data, i):
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def decode_varints(buf, dtype=np.int32):
    """Packed varints (protobuf int32 / int64) -> numpy, without a Python loop per element."""
    b = np.frombuffer(buf, np.uint8)
    if b.size == 0:
        return np.zeros(0, dtype)
    ends = np.flatnonzero(b < 0x80)
    if ends.size == 0 or ends[-1] != b.size - 1:
        raise ValueError("truncated varint")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > 10:
        raise ValueError("varint longer than 10 bytes")
    pos = np.arange(b.size) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.uint64) << (np.uint64(7) * pos.astype(np.uint64))
    values = np.add.reduceat(parts, starts)
    return values.view(np.int64).astype(dtype)  # int32 ids are sign-extended to 64 bits


def _to_int32(v):
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= (1 << 63) else v


def _contiguous(data):
    """The message as one buffer. grpcio hands deserializers bytes; a grpcio whose zero-copy
    receive path is on (grpc/grpc#42193, an experiment) hands a memoryview of its slice, or a
    list of memoryviews when the message spans several slices."""
    return b"".join(data) if isinstance(data, list) else data


def parse_score_response(data):
    """A FastResponse from ScoreResponse wire bytes (falls back to protobuf when unusual)."""
    data = _contiguous(data)
    try:
        return _parse_fast(data, 0, len(data))
    except (ValueError, IndexError, _Unusual):
        return _pb.pb2().ScoreResponse.FromString(data)


class StreamResponse:
    """A ScoreStreamResponse whose `response` is a FastResponse (attribute names of
    logitserve.v1.ScoreStreamResponse)."""

    __slots__ = ("request_id", "response", "status_code", "status_message")

    def __init__(self):
        self.request_id = ""
        self.response = None
        self.status_code = 0
        self.status_message = ""


def parse_stream_response(data):
    """A StreamResponse from ScoreStreamResponse wire bytes (falls back to protobuf when
    unusual)."""
    data = _contiguous(data)
    try:
        return _parse_stream_fast(data)
    except (ValueError, IndexError, _Unusual):
        return _pb.pb2().ScoreStreamResponse.FromString(data)


class _Unusual(Exception):
    pass


def _parse_stream_fast(data):
    r = StreamResponse()
    i, n = 0, len(data)
    while i < n:
        key = data[i]
        i += 1
        if key & 0x80:
            key, i = _read_varint(data, i - 1)
        field, wire = key >> 3, key & 7
        if wire == 0 and field == _STREAM_RESPONSE_STATUS_CODE:
            value, i = _read_varint(data, i)
            r.status_code = _to_int32(value)
        elif wire == _LEN:
            length = data[i]
            i += 1
            if length & 0x80:
                length, i = _read_varint(data, i - 1)
            end = i + length
            if end > n:
                raise ValueError("truncated field")
            if field == _STREAM_RESPONSE_REQUEST_ID:
                r.request_id = bytes(data[i:end]).decode("utf-8")
            elif field == _STREAM_RESPONSE_STATUS_MESSAGE:
                r.status_message = bytes(data[i:end]).decode("utf-8")
            elif field == _STREAM_RESPONSE_RESPONSE and r.response is None:
                r.response = _parse_fast(data, i, end)
            else:
                raise _Unusual()  # a repeated embedded message (merged) or an unknown field
            i = end
        else:
            raise _Unusual()
    if r.response is None:
        r.response = FastResponse()
    return r


def _parse_fast(data, i, n):
    """A FastResponse from the ScoreResponse bytes data[i:n]. Keys and lengths below 128 are
    one byte (every key of fields 1..15): read inline, the rest by _read_varint."""
    r = FastResponse()
    d = r.__dict__
    while i < n:
        key = data[i]
        i += 1
        if key & 0x80:
            key, i = _read_varint(data, i - 1)
        field, wire = key >> 3, key & 7
        if wire == _LEN:
            length = data[i]
            i += 1
            if length & 0x80:
                length, i = _read_varint(data, i - 1)
            end = i + length
            if end > n:
                raise ValueError("truncated field")
            name = _FLOAT_FIELDS.get(field)
            if name is not None:
                if length % 4:
                    raise ValueError("packed floats of %d bytes" % length)
                a = np.frombuffer(data, _F32_WIRE, length // 4, i)
                if not _F32_NATIVE:
                    a = a.astype(np.float32)
                prev = d.get(name)  # a repeated occurrence continues the values
                d[name] = a if prev is None else np.concatenate((prev, a))
            elif field == 3:
                a = decode_varints(memoryview(data)[i:end])
                prev = d.get("top_k_ids")
                d["top_k_ids"] = a if prev is None else np.concatenate((prev, a))
            elif field == 1:
                d["request_id"] = bytes(data[i:end]).decode("utf-8")
            elif field in _SEQUENCE_FIELDS:
                name = _SEQUENCE_FIELDS[field]
                getattr(r, name).MergeFromString(bytes(data[i:end]))
                d["_has_" + name] = True
            else:
                raise _Unusual()
            i = end
        elif wire == 0:
            value = data[i]
            i += 1
            if value & 0x80:
                value, i = _read_varint(data, i - 1)
            name = _INT_FIELDS.get(field)
            if name is None:
                raise _Unusual()
            d[name] = value
        else:
            raise _Unusual()  # unpacked repeated values or unknown fields: let protobuf do it
    return r
