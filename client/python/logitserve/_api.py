"""What the sync and asyncio clients share: request building, splitting plans, result objects,
target parsing and channel options. No I/O here."""

import ipaddress
import random
import re
import struct

import numpy as np

from . import _pb, _wire
from ._errors import FailedPrecondition, InvalidArgument, Internal, error_for
from ._shm import SharedTensor
from ._tensors import as_array, dtype_enum, dtype_name, float_array, float_tensor, id_array, slice_rows
from ._wire import WireRequest

# Headroom kept below the server's max_receive_message_bytes for non-row fields and framing.
MESSAGE_HEADROOM_BYTES = 64 * 1024

_PER_ROW_OUTPUTS = ("entropy", "reference_entropy", "forward_kl", "reverse_kl", "jsd")
_STATS_FIELDS = ("target_logprobs",) + _PER_ROW_OUTPUTS

SCORE_ARGS = (
    "head", "hidden", "target_ids", "reference_head", "reference_hidden", "logits",
    "reference_logits", "entropy", "reference_entropy", "forward_kl", "reverse_kl", "jsd_beta",
    "top_k", "temperature", "reference_temperature", "ignore_index", "sequence_lengths",
    "head_version", "reference_head_version", "dtype", "request_id")


class Request:
    """One Score request for score_stream: the keyword arguments of Client.score."""

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(SCORE_ARGS)
        if unknown:
            raise TypeError("unknown Score argument(s): %s" % ", ".join(sorted(unknown)))
        self.kwargs = kwargs

    @property
    def request_id(self):
        return self.kwargs.get("request_id")


class _Meta:
    """What the caller asked for: how to shape the response arrays."""

    __slots__ = ("rows", "ids_shape", "top_k", "outputs", "sequences", "head", "reference_head")


class SequenceStats:
    """Per-sequence sums or means (ScoreResponse.sequence_sums / sequence_means), S sequences.

    target_logprobs [S] (or [S, K] for [N, K] target ids); entropy, reference_entropy, forward_kl,
    reverse_kl, jsd [S] (None when not requested); token_count [S] int64: rows counted (a row
    whose target ids are all ignore_index is not counted). Means are NaN where token_count is 0.
    """

    def __init__(self, **fields):
        for name in _STATS_FIELDS:
            setattr(self, name, fields.get(name))
        self.token_count = fields.get("token_count")

    def __repr__(self):
        shown = ", ".join("%s=%s" % (n, getattr(self, n)) for n in _STATS_FIELDS + ("token_count",)
                          if getattr(self, n) is not None)
        return "SequenceStats(%s)" % shown


class ScoreResult:
    """A Score result; arrays named as in logitserve.v1.ScoreResponse, every value in nats.

    target_logprobs  [N] or [N, K] (as target_ids) log p(id); 0.0 where id == ignore_index
    top_k_ids        [N, k] int32, descending probability, ties -> smaller id
    top_k_logprobs   [N, k]
    entropy          [N] H(p);  reference_entropy [N] H(q)
    forward_kl       [N] KL(q || p);  reverse_kl [N] KL(p || q);  jsd [N] JSD_beta(p, q)
    sequence_sums, sequence_means: SequenceStats when sequence_lengths was given
    head_version, reference_head_version: versions used (0 in logits mode)
    queue_us, compute_us: server time (summed over chunks); chunks: RPCs used
    An output not asked for is None. In score_stream, a failed request has `error` set (a
    LogitserveError) and no arrays; raise_for_error() raises it.
    """

    _ARRAYS = ("target_logprobs", "top_k_ids", "top_k_logprobs") + _PER_ROW_OUTPUTS

    def __init__(self, request_id=""):
        self.request_id = request_id
        # The _ARRAYS, in their order.
        self.target_logprobs = self.top_k_ids = self.top_k_logprobs = None
        self.entropy = self.reference_entropy = self.forward_kl = self.reverse_kl = None
        self.jsd = None
        self.sequence_sums = None
        self.sequence_means = None
        self.head_version = 0
        self.reference_head_version = 0
        self.queue_us = 0
        self.compute_us = 0
        self.chunks = 0
        self.error = None

    @property
    def ok(self):
        return self.error is None

    def raise_for_error(self):
        if self.error is not None:
            raise self.error
        return self

    def __repr__(self):
        if self.error is not None:
            return "ScoreResult(request_id=%r, error=%r)" % (self.request_id, self.error)
        shown = ["%s%s" % (n, list(getattr(self, n).shape)) for n in self._ARRAYS
                 if getattr(self, n) is not None]
        return "ScoreResult(request_id=%r, %s, head_version=%d)" % (
            self.request_id, ", ".join(shown), self.head_version)


class HeadInfo:
    """A served head (logitserve.v1.HeadInfo); dtype is "bf16", "fp16" or "fp32"; shards is a
    list of (shard, vocab_begin, vocab_end)."""

    _DTYPE_NAMES = {"FLOAT32": "fp32", "BFLOAT16": "bf16", "FLOAT16": "fp16"}

    def __init__(self, msg):
        self.name = msg.name
        self.vocab_size = msg.vocab_size
        self.hidden_size = msg.hidden_size
        name = dtype_name(msg.dtype)
        self.dtype = self._DTYPE_NAMES.get(name, name)
        self.version = msg.version
        self.shards = [(s.shard, s.vocab_begin, s.vocab_end) for s in msg.shards]
        self.has_bias = msg.has_bias
        self.logit_scale = msg.logit_scale
        self.logits_scaling = msg.logits_scaling
        self.final_logit_softcapping = msg.final_logit_softcapping
        self.source = msg.source

    def __repr__(self):
        return "HeadInfo(name=%r, vocab_size=%d, hidden_size=%d, dtype=%s, version=%d)" % (
            self.name, self.vocab_size, self.hidden_size, self.dtype, self.version)


class ServerHeads:
    """ListHeads: `heads` (list of HeadInfo; also `server_heads["policy"]`), `backend`, the
    server limits, and the server build: `server_version`, `server_git_commit`."""

    def __init__(self, msg):
        self.heads = [HeadInfo(h) for h in msg.heads]
        self.backend = msg.backend
        self.server_version = msg.server_info.version
        self.server_git_commit = msg.server_info.git_commit
        self.max_top_k = msg.max_top_k
        self.max_tokens_per_request = msg.max_tokens_per_request
        self.max_receive_message_bytes = msg.max_receive_message_bytes

    def __iter__(self):
        return iter(self.heads)

    def __len__(self):
        return len(self.heads)

    def __getitem__(self, name):
        for h in self.heads:
            if h.name == name:
                return h
        raise KeyError(name)

    def __repr__(self):
        return "ServerHeads(backend=%r, heads=%r)" % (self.backend, self.heads)


# ---- requests ------------------------------------------------------------------------------

def build_request(head=None, hidden=None, target_ids=None, reference_head=None,
                  reference_hidden=None, logits=None, reference_logits=None, entropy=False,
                  reference_entropy=False, forward_kl=False, reverse_kl=False, jsd_beta=None,
                  top_k=0, temperature=None, reference_temperature=None, ignore_index=None,
                  sequence_lengths=None, head_version=None, reference_head_version=None,
                  dtype=None, request_id=None):
    """(WireRequest, _Meta) from Client.score's arguments. Only encodes: the server validates
    (its INVALID_ARGUMENT messages name the field and row). Row tensors given as arrays stay
    arrays (copied once, when serialized); a SharedTensor names its shared-memory bytes.

    The request is encoded straight to ScoreRequest bytes (_build_encoded: the bytes protobuf
    would serialize, from parts cached between calls); arguments it does not take as they are,
    and every error, go through the ScoreRequest message instead (_build_message), so errors are
    protobuf's and numpy's own, raised in argument order."""
    args = (head, hidden, target_ids, reference_head, reference_hidden, logits, reference_logits,
            entropy, reference_entropy, forward_kl, reverse_kl, jsd_beta, top_k, temperature,
            reference_temperature, ignore_index, sequence_lengths, head_version,
            reference_head_version, dtype, request_id)
    try:
        return _build_encoded(*args)
    except Exception:  # noqa: BLE001 - the message path raises the argument's own error
        return _build_message(*args)


class _OptionParts:
    """The ScoreRequest bytes of the fields other than the row tensors, request_id and
    sequence_lengths, in four runs of field order (head; head_version and reference_head;
    reference_head_version; ignore_index .. reference_temperature), and what _Meta takes from
    them."""

    __slots__ = ("head", "versions", "reference_version", "rest", "top_k", "outputs",
                 "has_head", "has_reference_head")


# _OptionParts by the arguments that made them (see _option_parts); cleared when full.
_OPTION_CACHE = {}
_OPTION_CACHE_MAX = 256
_DOUBLE = struct.Struct("<d")


def _float_key(value):
    # By its bits: -0.0 == 0.0, and NaNs differ in payload, yet they encode differently.
    return None if value is None else _DOUBLE.pack(float(value))


def _set_output_options(m, ignore_index, top_k, entropy, reference_entropy, forward_kl,
                        reverse_kl, jsd_beta, temperature, reference_temperature):
    """Sets ScoreRequest fields ignore_index .. reference_temperature on message m (for
    _build_message and _option_parts alike: the same conversions, hence the same errors)."""
    if ignore_index is not None:
        m.ignore_index = int(ignore_index)
    m.top_k = int(top_k or 0)
    m.entropy = bool(entropy)
    m.reference_entropy = bool(reference_entropy)
    m.forward_kl = bool(forward_kl)
    m.reverse_kl = bool(reverse_kl)
    if jsd_beta is not None:
        m.jsd_beta = float(jsd_beta)
    if temperature is not None:
        m.temperature = float(temperature)
    if reference_temperature is not None:
        m.reference_temperature = float(reference_temperature)


def _option_parts(head, reference_head, head_version, reference_head_version, ignore_index,
                  top_k, entropy, reference_entropy, forward_kl, reverse_kl, jsd_beta,
                  temperature, reference_temperature):
    # Equal numbers convert to equal field values (int(), bool()), so they share an entry;
    # floats are keyed by their bits. An unhashable argument raises TypeError here.
    key = (head, reference_head, head_version, reference_head_version, ignore_index, top_k,
           entropy, reference_entropy, forward_kl, reverse_kl, _float_key(jsd_beta),
           _float_key(temperature), _float_key(reference_temperature))
    parts = _OPTION_CACHE.get(key)
    if parts is not None:
        return parts
    # The setters of _build_message, each on a message of its own part.
    pb2 = _pb.pb2()
    a, b, c, d = (pb2.ScoreRequest() for _ in range(4))
    if head:
        a.head = head
    if head_version is not None:
        b.head_version = int(head_version)
    if reference_head:
        b.reference_head = reference_head
    if reference_head_version is not None:
        c.reference_head_version = int(reference_head_version)
    _set_output_options(d, ignore_index, top_k, entropy, reference_entropy, forward_kl,
                        reverse_kl, jsd_beta, temperature, reference_temperature)
    parts = _OptionParts()
    parts.head = a.SerializeToString()
    parts.versions = b.SerializeToString()
    parts.reference_version = c.SerializeToString()
    parts.rest = d.SerializeToString()
    parts.top_k = d.top_k
    parts.outputs = {"entropy": d.entropy, "reference_entropy": d.reference_entropy,
                     "forward_kl": d.forward_kl, "reverse_kl": d.reverse_kl,
                     "jsd": jsd_beta is not None}
    parts.has_head = bool(head)
    parts.has_reference_head = bool(reference_head)
    if len(_OPTION_CACHE) >= _OPTION_CACHE_MAX:
        _OPTION_CACHE.clear()
    _OPTION_CACHE[key] = parts
    return parts


class _Refused(Exception):
    """An argument _build_encoded does not encode itself."""


def _build_encoded(head, hidden, target_ids, reference_head, reference_hidden, logits,
                   reference_logits, entropy, reference_entropy, forward_kl, reverse_kl,
                   jsd_beta, top_k, temperature, reference_temperature, ignore_index,
                   sequence_lengths, head_version, reference_head_version, dtype, request_id):
    """build_request writing the ScoreRequest bytes in field order: request_id, then the option
    parts, row tensors and sequence_lengths between them. A SharedTensor's field is its cached
    tensor_wire(); an array's is a Tensor of dtype and shape (its bytes follow as arrays)."""
    options = _option_parts(head, reference_head, head_version, reference_head_version,
                            ignore_index, top_k, entropy, reference_entropy, forward_kl,
                            reverse_kl, jsd_beta, temperature, reference_temperature)
    rid = request_id or ""
    if type(rid) is not str:
        raise _Refused()
    rid_bytes = rid.encode("utf-8")
    arrays = {}
    shapes = {}

    def tensor(number, name, value, ids=False):
        if value is None:
            return b""
        if isinstance(value, SharedTensor):
            data, shape = value.tensor_wire()
        else:
            wire, a = id_array(value, name) if ids else float_array(value, dtype, name)
            shape = a.shape
            data = _wire.tensor_header(dtype_enum(wire), shape)
            arrays[name] = a
        shapes[name] = shape
        return _wire.field(number, data)

    parts = [_wire.field(1, rid_bytes) if rid_bytes else b"", options.head,
             tensor(3, "hidden", hidden), tensor(4, "logits", logits), options.versions,
             tensor(7, "reference_hidden", reference_hidden),
             tensor(8, "reference_logits", reference_logits), options.reference_version,
             tensor(10, "target_ids", target_ids, ids=True), options.rest]
    meta = _Meta()
    meta.sequences = None
    if sequence_lengths is not None:
        lengths = [int(x) for x in np.asarray(sequence_lengths, dtype=np.int64).reshape(-1)]
        if lengths:
            parts.append(_wire.field(20, _wire.packed_varints(lengths)))
        meta.sequences = len(lengths)
    rows = None
    shape = shapes.get("hidden")
    if shape:
        rows = shape[0]
    shape = shapes.get("logits")
    if rows is None and shape:
        rows = shape[0]
    meta.rows = rows
    shape = shapes.get("target_ids")
    meta.ids_shape = None if shape is None else tuple(shape)
    meta.top_k = options.top_k
    meta.outputs = dict(options.outputs)
    meta.head = options.has_head
    meta.reference_head = options.has_reference_head
    return WireRequest.encoded(b"".join(parts), arrays, rid, meta.sequences or 0), meta


def _build_message(head=None, hidden=None, target_ids=None, reference_head=None,
                  reference_hidden=None, logits=None, reference_logits=None, entropy=False,
                  reference_entropy=False, forward_kl=False, reverse_kl=False, jsd_beta=None,
                  top_k=0, temperature=None, reference_temperature=None, ignore_index=None,
                  sequence_lengths=None, head_version=None, reference_head_version=None,
                  dtype=None, request_id=None):
    """build_request through a ScoreRequest message: the reference encoding, and the one used
    whenever _build_encoded refuses (it then also raises any error of the arguments)."""
    pb2 = _pb.pb2()
    r = pb2.ScoreRequest(request_id=request_id or "")
    arrays = {}
    meta = _Meta()

    def put(field, value, ids=False):
        t = getattr(r, field)
        if isinstance(value, SharedTensor):
            t.CopyFrom(value.tensor_message())
            return
        wire, a = id_array(value, field) if ids else float_array(value, dtype, field)
        t.dtype = dtype_enum(wire)
        t.shape.extend(a.shape)
        arrays[field] = a

    rows = None
    if head:
        r.head = head
    if hidden is not None:
        put("hidden", hidden)
        rows = r.hidden.shape[0] if len(r.hidden.shape) else None
    if logits is not None:
        put("logits", logits)
        if rows is None and len(r.logits.shape):
            rows = r.logits.shape[0]
    if reference_head:
        r.reference_head = reference_head
    if reference_hidden is not None:
        put("reference_hidden", reference_hidden)
    if reference_logits is not None:
        put("reference_logits", reference_logits)
    meta.ids_shape = None
    if target_ids is not None:
        put("target_ids", target_ids, ids=True)
        meta.ids_shape = tuple(r.target_ids.shape)
    if head_version is not None:
        r.head_version = int(head_version)
    if reference_head_version is not None:
        r.reference_head_version = int(reference_head_version)
    _set_output_options(r, ignore_index, top_k, entropy, reference_entropy, forward_kl,
                        reverse_kl, jsd_beta, temperature, reference_temperature)
    meta.sequences = None
    if sequence_lengths is not None:
        lengths = [int(x) for x in np.asarray(sequence_lengths, dtype=np.int64).reshape(-1)]
        r.sequence_lengths.extend(lengths)
        meta.sequences = len(lengths)
    meta.rows = rows
    meta.top_k = r.top_k
    meta.outputs = {"entropy": r.entropy, "reference_entropy": r.reference_entropy,
                    "forward_kl": r.forward_kl, "reverse_kl": r.reverse_kl,
                    "jsd": jsd_beta is not None}
    meta.head = bool(head)
    meta.reference_head = bool(reference_head)
    return WireRequest(r, arrays), meta


def request_from(item, index):
    """Accepts a Request, a dict of score kwargs or a ready ScoreRequest; gives it a request_id
    (its index) when it has none."""
    pb2 = _pb.pb2()
    if isinstance(item, pb2.ScoreRequest):
        raise TypeError("score_stream takes logitserve.Request objects or dicts of score() "
                        "arguments, not raw ScoreRequest messages")
    kwargs = dict(item.kwargs if isinstance(item, Request) else item)
    if not kwargs.get("request_id"):
        kwargs["request_id"] = str(index)
    return build_request(**kwargs)


_ROW_TENSORS = ("hidden", "logits", "reference_hidden", "reference_logits", "target_ids")


def _present(r, field):
    return r.HasField(field)


def row_bytes(request, meta):
    """Bytes per row of the row tensors the request carries (arrays or data; shared-memory tensors
    count 0); 0 when N is unknown or 0."""
    n = meta.rows
    if not n:
        return 0
    total = 0
    for field in _ROW_TENSORS:
        if field in request.arrays:
            total += request.arrays[field].nbytes // n
        else:
            total += request.tensor_data_bytes(field) // n
    return total


def plan_chunks(request, meta, max_rows, max_bytes):
    """Chunks (row_begin, row_end, seq_begin, seq_end) of `request` (a WireRequest): one chunk
    when it has at most `max_rows` rows (0 = no limit) and fits in `max_bytes` (0 = no limit); else
    consecutive chunks cut at row boundaries, or only at sequence boundaries when sequence_lengths
    is set (a single sequence over the limit is INVALID_ARGUMENT, as in the C++ client)."""
    n = meta.rows
    nseq = request.sequence_count()
    too_many_rows = bool(max_rows) and n is not None and (n > max_rows or nseq > max_rows)
    too_big = bool(max_bytes) and request.message_size() + request.array_bytes() > max_bytes
    if n is None or not (too_many_rows or too_big):
        return [(0, n or 0, 0, nseq)]
    msg = request.message
    for field in _ROW_TENSORS:
        if not _present(msg, field):
            continue
        t = getattr(msg, field)
        if len(t.shape) < 1 or t.shape[0] != n:
            raise InvalidArgument("%s: first dimension %s differs from the request's %d rows; cannot "
                                  "split the request" % (field, list(t.shape)[:1] or "(none)", n))
    per_row = row_bytes(request, meta)
    limit = max_rows if max_rows else n
    if max_bytes and per_row:
        by_bytes = (max_bytes - MESSAGE_HEADROOM_BYTES) // per_row
        if by_bytes < 1:
            raise InvalidArgument("one row needs %d bytes, over the server's message limit of %d "
                                  "bytes" % (per_row, max_bytes))
        limit = min(limit, by_bytes)
    chunks = []
    if not nseq:
        for b in range(0, n, limit):
            chunks.append((b, min(n, b + limit), 0, 0))
        return chunks
    lengths = list(msg.sequence_lengths)
    if any(x < 0 for x in lengths) or sum(lengths) != n:
        raise InvalidArgument("sequence_lengths: must be >= 0 and sum to the %d rows; cannot split "
                              "the request" % n)
    max_entries = max_rows if max_rows else nseq
    row = seq = 0
    while seq < nseq:
        b_row, b_seq = row, seq
        while seq < nseq and seq - b_seq < max_entries and row - b_row + lengths[seq] <= limit:
            row += lengths[seq]
            seq += 1
        if seq == b_seq:
            raise InvalidArgument("sequence_lengths[%d] = %d rows exceeds the server's limit of %d rows "
                                  "per request; a sequence is never split" % (seq, lengths[seq], limit))
        chunks.append((b_row, row, b_seq, seq))
    return chunks


def chunk_request(request, chunk):
    """The WireRequest restricted to one chunk's rows and sequences (the arrays are shared)."""
    pb2 = _pb.pb2()
    r0, r1, s0, s1 = chunk
    msg = request.message
    out = pb2.ScoreRequest()
    out.CopyFrom(msg)
    for field in _ROW_TENSORS:
        if field in request.arrays:
            getattr(out, field).shape[0] = r1 - r0
        elif _present(msg, field):
            getattr(out, field).CopyFrom(slice_rows(getattr(msg, field), r0, r1))
    del out.sequence_lengths[:]
    out.sequence_lengths.extend(msg.sequence_lengths[s0:s1])
    return WireRequest(out, request.arrays, r0, r1)


_ROW_NUMBER = re.compile(r"\brow (\d+)")


def rebase_rows(message, first_row):
    """`message` about a chunk starting at `first_row` with every "row R" made "row R + first_row"
    (the row of the whole request)."""
    return _ROW_NUMBER.sub(lambda m: "row %d" % (int(m.group(1)) + first_row), message)


def chunk_error(e, chunk, total_rows, chunks):
    """The chunk's error, same type, its message naming the chunk's rows and, inside the server's
    message, the rows of the whole request."""
    details = "rows [%d, %d) of %d (request split into %d chunks): %s" % (
        chunk[0], chunk[1], total_rows, chunks, rebase_rows(e.details or "", chunk[0]))
    return type(e)(details, code=e.code)


def pin_versions(request, first_response, meta):
    """Later chunks of a split request run on the versions the first chunk used, so one result
    never mixes head versions (a swap in between gives FAILED_PRECONDITION)."""
    msg = request.message
    if meta.head and not msg.HasField("head_version"):
        msg.head_version = first_response.head_version
    if meta.reference_head and not msg.HasField("reference_head_version"):
        msg.reference_head_version = first_response.reference_head_version


def check_same_versions(responses, chunks):
    """FAILED_PRECONDITION when the chunks of one request ran on different head versions (a head
    replaced while a pipelined request was in flight): such a result is never returned."""
    first = responses[0]
    for resp, chunk in zip(responses[1:], chunks[1:]):
        if (resp.head_version, resp.reference_head_version) != (first.head_version,
                                                                 first.reference_head_version):
            raise FailedPrecondition(
                "head_version: a head was replaced while the request was in flight (rows [%d, %d) "
                "ran on version %d/%d, earlier rows on %d/%d); pin head_version or retry" % (
                    chunk[0], chunk[1], resp.head_version, resp.reference_head_version,
                    first.head_version, first.reference_head_version))


def _check(field, values, rows, per_row):
    if len(values) != rows * per_row:
        raise Internal("server response field %s has %d values, expected %d" %
                       (field, len(values), rows * per_row))


def _joined(parts, dtype):
    """The parts (arrays or protobuf repeated fields) as one new array of `dtype`."""
    if len(parts) == 1:
        return np.array(parts[0], dtype=dtype)
    if not parts:
        return np.zeros(0, dtype)
    return np.concatenate([np.asarray(p, dtype=dtype) for p in parts])


def assemble(responses, chunks, meta, request_id):
    """One ScoreResult from the chunks' responses (in chunk order): every response's sizes are
    checked first (Internal names the first field that is off), then each output is one new
    array joined from the chunks' values."""
    res = ScoreResult(request_id)
    res.chunks = len(responses)
    k_ids = None
    if meta.ids_shape is not None:
        k_ids = 1 if len(meta.ids_shape) < 2 else int(meta.ids_shape[1])
    outputs = [name for name in _PER_ROW_OUTPUTS if meta.outputs[name]]
    stats = ()
    if meta.sequences is not None:
        stats = (("sums", "sequence_sums"), ("means", "sequence_means"))
    for resp, (r0, r1, s0, s1) in zip(responses, chunks):
        rows = r1 - r0
        if k_ids is not None:
            _check("target_logprobs", resp.target_logprobs, rows, k_ids)
        if meta.top_k:
            _check("top_k_ids", resp.top_k_ids, rows, meta.top_k)
            _check("top_k_logprobs", resp.top_k_logprobs, rows, meta.top_k)
        for name in outputs:
            _check(name, getattr(resp, name), rows, 1)
        nseq = s1 - s0
        for key, attr in stats:
            msg = getattr(resp, attr)
            if len(msg.token_count) != nseq:
                raise Internal("server response sequence_%s has %d sequences, expected %d" %
                               (key, len(msg.token_count), nseq))
            if k_ids is not None:
                _check("sequence_%s.target_logprobs" % key, msg.target_logprobs, nseq, k_ids)
            for name in outputs:
                _check("sequence_%s.%s" % (key, name), getattr(msg, name), nseq, 1)
        res.queue_us += resp.queue_us
        res.compute_us += resp.compute_us
    if responses:
        res.head_version = responses[0].head_version
        res.reference_head_version = responses[0].reference_head_version
    n = meta.rows or 0
    ids_2d = meta.ids_shape is not None and len(meta.ids_shape) >= 2
    if k_ids is not None:
        lp = _joined([r.target_logprobs for r in responses], np.float32)
        res.target_logprobs = lp.reshape(n, k_ids) if ids_2d else lp
    if meta.top_k:
        res.top_k_ids = _joined([r.top_k_ids for r in responses], np.int32).reshape(n, meta.top_k)
        res.top_k_logprobs = _joined([r.top_k_logprobs for r in responses],
                                     np.float32).reshape(n, meta.top_k)
    for name in outputs:
        setattr(res, name, _joined([getattr(r, name) for r in responses], np.float32))
    for key, attr in stats:
        msgs = [getattr(r, attr) for r in responses]
        fields = {"token_count": _joined([m.token_count for m in msgs], np.int64)}
        if k_ids is not None:
            lp = _joined([m.target_logprobs for m in msgs], np.float32)
            fields["target_logprobs"] = lp.reshape(meta.sequences, k_ids) if ids_2d else lp
        for name in outputs:
            fields[name] = _joined([getattr(m, name) for m in msgs], np.float32)
        setattr(res, attr, SequenceStats(**fields))
    return res


def stream_result(resp, meta):
    """A ScoreStreamResponse: the result, or a failed result carrying its typed error."""
    if resp.status_code:
        res = ScoreResult(resp.request_id)
        res.error = error_for(resp.status_code, resp.status_message)
        return res
    nseq = meta.sequences or 0
    return assemble([resp.response], [(0, meta.rows or 0, 0, nseq)], meta, resp.request_id)


# ---- load_head -----------------------------------------------------------------------------

def load_head_chunks(name, weight, version, bias, dtype, logit_scale, logits_scaling,
                     final_logit_softcapping, chunk_bytes):
    """The LoadHeadRequest messages of an upload (spec first, then weight bytes, then bias bytes)."""
    pb2 = _pb.pb2()
    w = as_array(weight, "weight")
    if w.ndim != 2:
        raise ValueError("weight: expected a [vocab_size, hidden_size] array, got shape %s" % (w.shape,))
    wt = float_tensor(w, dtype, "weight")
    wire = {pb2.DATA_TYPE_BFLOAT16: "bf16", pb2.DATA_TYPE_FLOAT16: "fp16",
            pb2.DATA_TYPE_FLOAT32: "fp32"}[wt.dtype]
    bias_bytes = b""
    if bias is not None:
        b = as_array(bias, "bias")
        if b.shape != (w.shape[0],):
            raise ValueError("bias: expected shape [%d], got %s" % (w.shape[0], list(b.shape)))
        if b.dtype == np.uint16 and wire != "bf16":
            raise ValueError("bias: uint16 bfloat16 bits need a bf16 weight")
        bias_bytes = float_tensor(b, wire, "bias").data
    spec = pb2.HeadSpec(name=name, vocab_size=w.shape[0], hidden_size=w.shape[1], dtype=wt.dtype,
                        version=int(version or 0), has_bias=bias is not None,
                        logit_scale=float(logit_scale or 0.0),
                        logits_scaling=float(logits_scaling or 0.0),
                        final_logit_softcapping=float(final_logit_softcapping or 0.0))
    step = max(1, int(chunk_bytes))
    data = wt.data
    msgs = []
    first = True
    for off in range(0, max(len(data), 1), step):
        m = pb2.LoadHeadRequest(weight_data=data[off:off + step])
        if first:
            m.spec.CopyFrom(spec)
            first = False
        msgs.append(m)
    for off in range(0, len(bias_bytes), step):
        msgs.append(pb2.LoadHeadRequest(bias_data=bias_bytes[off:off + step]))
    return msgs


# ---- channels ------------------------------------------------------------------------------

def _ip_kind(hostport):
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return "ipv%d" % ipaddress.ip_address(host).version
    except ValueError:
        return None


def resolve_target(target, load_balancing=None):
    """(gRPC target string, lb policy or None).

    `target` is "host:port", a gRPC URI ("dns:///name:port", "ipv4:a:p,b:p", "unix:..."), or
    several IP addresses (a list, or one comma-separated string). Several addresses or a dns:
    target get round_robin unless load_balancing says otherwise."""
    if isinstance(target, (list, tuple)):
        addrs = [str(a).strip() for a in target]
    elif "," in target and ":" in target and "://" not in target and \
            not target.startswith(("ipv4:", "ipv6:", "unix:", "dns:")):
        addrs = [a.strip() for a in target.split(",")]
    else:
        addrs = [target]
    multi = False
    if len(addrs) > 1:
        kinds = {_ip_kind(a) for a in addrs}
        if len(kinds) != 1 or None in kinds:
            raise ValueError("several addresses must all be IPv4 or all IPv6 literals (host:port); "
                             "for names use one dns:///name:port target (got %r)" % (target,))
        target = "%s:%s" % (kinds.pop(), ",".join(addrs))
        multi = True
    else:
        target = addrs[0]
        multi = target.startswith("dns:") or (target.startswith(("ipv4:", "ipv6:")) and "," in target)
    policy = load_balancing if load_balancing is not None else ("round_robin" if multi else None)
    return target, policy


def channel_options(lb_policy, initial_backoff, max_backoff, extra=()):
    opts = [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
        # Reconnect on the retry schedule, so a retry after UNAVAILABLE really tries again.
        ("grpc.initial_reconnect_backoff_ms", max(1, int(initial_backoff * 1000))),
        ("grpc.max_reconnect_backoff_ms", max(1, int(max_backoff * 1000))),
        ("grpc.enable_retries", 0),  # retries are ours (UNAVAILABLE only, with backoff)
    ]
    if lb_policy:
        opts.append(("grpc.lb_policy_name", lb_policy))
    opts.extend(extra)
    return opts


class Backoff:
    """Exponential backoff: the k-th retry waits min(initial * multiplier^(k-1), max), less up to
    20% jitter."""

    def __init__(self, initial, maximum, multiplier):
        self.next = initial
        self.maximum = maximum
        self.multiplier = multiplier

    def step(self):
        wait = self.next * (1.0 - 0.2 * random.random())
        self.next = min(self.next * self.multiplier, self.maximum)
        return wait


# ---- grpc.health.v1 without generated stubs ------------------------------------------------
# HealthCheckRequest { string service = 1; }  HealthCheckResponse { ServingStatus status = 1; }
# Hand-encoded so that this package never registers grpc/health/v1/health.proto in the protobuf
# descriptor pool (it would clash with grpcio-health-checking when both are imported).

HEALTH_METHOD = "/grpc.health.v1.Health/Check"
_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


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


def health_request_bytes(service):
    raw = service.encode("utf-8")
    return b"" if not raw else b"\x0a" + _varint(len(raw)) + raw


def health_status_from_bytes(data):
    status, i = 0, 0
    while i < len(data):
        key, i = _read_varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
            if field == 1:
                status = value
        elif wire == 2:
            length, i = _read_varint(data, i)
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise Internal("malformed HealthCheckResponse")
    return _SERVING_STATUS.get(status, "UNKNOWN")


def _read_varint(data, i):
    shift = value = 0
    while True:
        if i >= len(data):
            raise Internal("malformed HealthCheckResponse")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i
