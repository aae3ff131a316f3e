"""numpy arrays <-> logitserve.v1.Tensor, and exact bfloat16 rounding.

Floating inputs travel as the dtype chosen by `dtype` (None / "bf16" / "fp16" / "fp32"):

  input numpy dtype   dtype=None          dtype="bf16"            dtype="fp16"   dtype="fp32"
  float32             FLOAT32 as is       round to nearest even   astype(f16)    as is
  float64             FLOAT32 (RNE)       round to nearest even*  astype(f16)    FLOAT32 (RNE)
  float16             FLOAT16 as is       exact (f16 -> f32 -> bf16, RNE)  as is  exact widening
  uint16              BFLOAT16 bit patterns (the convention for bf16 data without a bf16 dtype)

* float64 goes to bf16 through round-to-odd float32, so the result is the correctly rounded bf16 of
  the float64 value (no double rounding).

torch tensors (CPU) are accepted wherever arrays are, without copying where numpy can share the
memory: torch.bfloat16 travels as BFLOAT16 bit for bit (like uint16 bits), every other dtype as its
numpy twin. torch is never imported unless a torch tensor is passed.
"""

import numpy as np

from . import _pb

_FLOAT_DTYPES = {
    "bf16": "BFLOAT16", "bfloat16": "BFLOAT16",
    "fp16": "FLOAT16", "float16": "FLOAT16",
    "fp32": "FLOAT32", "float32": "FLOAT32",
}


def _pb2():
    return _pb.pb2()


def as_array(x, field):
    """numpy view of `x`: numpy arrays and sequences as is, torch CPU tensors shared (bf16 as its
    uint16 bit patterns)."""
    if type(x).__module__.split(".")[0] != "torch":
        return np.asarray(x)
    import torch  # a torch tensor exists, so torch is importable

    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    t = x.detach()
    if t.device.type != "cpu":
        raise TypeError("%s: a torch tensor on %s; pass a CPU tensor (x.cpu())" % (field, t.device))
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def f32_to_bf16_bits(x):
    """Round float32 values to bfloat16 (round to nearest, ties to even); returns uint16 bits.

    NaN stays NaN (quiet, sign kept); overflow rounds to +-inf as IEEE rounding does.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    # In uint32, in place (the hot path of fp32 hidden states sent as bf16): bits + 0x7FFF + lsb
    # wraps only for bit patterns >= 0xFFFF8000, which are all NaN and replaced below.
    rounded = bits >> np.uint32(16)
    rounded &= np.uint32(1)
    rounded += bits
    rounded += np.uint32(0x7FFF)
    rounded >>= np.uint32(16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def f64_to_f32_round_to_odd(x):
    """float64 -> float32 rounding to odd: exact values stay; inexact ones truncate toward zero
    and set the last mantissa bit. Rounding that result to bf16 (16 fewer bits) with
    round-to-nearest-even gives the correctly rounded bf16 of x."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(np.float32)
        inexact = np.isfinite(x) & (t.astype(np.float64) != x)
        # Truncate toward zero: step back one ulp when rounding went away from zero.
        away = inexact & (np.abs(t.astype(np.float64)) > np.abs(x))
        t = np.where(away, np.nextafter(t, np.float32(0)), t).astype(np.float32)
    bits = t.view(np.uint32).copy()
    bits[inexact] |= np.uint32(1)
    return bits.view(np.float32)


def bf16_bits_to_f32(bits):
    """Exact widening of bfloat16 bit patterns (uint16) to float32."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bf16_bits(x):
    """Correctly rounded bfloat16 bit patterns (uint16) of float16/32/64 values (RNE)."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return np.ascontiguousarray(x)
    if x.dtype == np.float64:
        return f32_to_bf16_bits(f64_to_f32_round_to_odd(x))
    return f32_to_bf16_bits(x.astype(np.float32))


def dtype_enum(wire):
    """The logitserve.v1.DataType value of a wire dtype name ("FLOAT32" -> DATA_TYPE_FLOAT32)."""
    return getattr(_pb2(), "DATA_TYPE_" + wire)


def dtype_name(value):
    """The wire dtype name of a logitserve.v1.DataType value (DATA_TYPE_FLOAT32 -> "FLOAT32")."""
    return _pb2().DataType.Name(value).replace("DATA_TYPE_", "", 1)


def _wire_dtype(name, field):
    key = str(name).lower()
    if key not in _FLOAT_DTYPES:
        raise ValueError("%s: dtype must be one of bf16, fp16, fp32 (got %r)" % (field, name))
    return _FLOAT_DTYPES[key]


def float_array(array, dtype, field):
    """(wire dtype name, C-contiguous little-endian array of that dtype) for a float input (see
    the module comment for the dtype rules). No copy when the array already is in wire form."""
    a = as_array(array, field)
    if a.dtype == np.uint16:
        if dtype is not None and _wire_dtype(dtype, field) != "BFLOAT16":
            raise ValueError("%s: uint16 arrays are bfloat16 bit patterns; dtype must be bf16" % field)
        return "BFLOAT16", np.ascontiguousarray(a, dtype="<u2")
    if a.dtype.kind != "f":
        raise TypeError("%s: expected a float16/float32/float64 array or uint16 bfloat16 bit patterns, "
                        "got dtype %s" % (field, a.dtype))
    if dtype is None:
        wire = "FLOAT16" if a.dtype == np.float16 else "FLOAT32"
    else:
        wire = _wire_dtype(dtype, field)
    if wire == "BFLOAT16":
        return wire, to_bf16_bits(a).astype("<u2", copy=False)
    if wire == "FLOAT16":
        return wire, np.ascontiguousarray(a, dtype="<f2")
    return wire, np.ascontiguousarray(a, dtype="<f4")


def id_array(array, field):
    """(INT32 or INT64, C-contiguous little-endian array) of token ids (Python ints, any integer
    numpy dtype, torch tensors); int32 arrays travel as INT32, everything else as INT64."""
    a = as_array(array, field)
    if a.size == 0 and a.dtype.kind not in "iu":
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError("%s: expected integer token ids, got dtype %s" % (field, a.dtype))
    if a.dtype == np.int32:
        return "INT32", np.ascontiguousarray(a, "<i4")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError("%s: id out of the int64 range" % field)
    return "INT64", np.ascontiguousarray(a, "<i8")


def float_tensor(array, dtype, field):
    """A float Tensor from a numpy array (see the module comment for the dtype rules)."""
    pb2 = _pb2()
    wire, data = float_array(array, dtype, field)
    return pb2.Tensor(dtype=dtype_enum(wire), shape=list(data.shape), data=data.tobytes())


def id_tensor(array, field):
    """An INT32/INT64 Tensor of token ids (Python ints, any integer numpy dtype, torch tensors)."""
    pb2 = _pb2()
    wire, data = id_array(array, field)
    return pb2.Tensor(dtype=dtype_enum(wire), shape=list(data.shape), data=data.tobytes())


_NUMPY_OF = {"FLOAT32": "<f4", "BFLOAT16": "<u2", "FLOAT16": "<f2", "INT32": "<i4", "INT64": "<i8"}


def tensor_to_numpy(t):
    """Decodes a Tensor (BFLOAT16 comes back as float32, exactly)."""
    name = dtype_name(t.dtype)
    a = np.frombuffer(t.data, dtype=_NUMPY_OF[name]).reshape(tuple(t.shape))
    return bf16_bits_to_f32(a) if name == "BFLOAT16" else a.astype(a.dtype.newbyteorder("="))


_SIZE_OF = {"FLOAT32": 4, "BFLOAT16": 2, "FLOAT16": 2, "INT32": 4, "INT64": 8}


def slice_rows(t, begin, end):
    """Rows [begin, end) of a row-major Tensor whose first dimension is the row count (for a
    shared-memory tensor: the same region, at those rows' offset)."""
    pb2 = _pb2()
    shape = [end - begin] + list(t.shape[1:])
    if t.HasField("shared_memory"):
        row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * _SIZE_OF[dtype_name(t.dtype)]
        ref = pb2.SharedMemoryRef(region=t.shared_memory.region,
                                  offset=t.shared_memory.offset + begin * row_bytes,
                                  byte_size=(end - begin) * row_bytes)
        return pb2.Tensor(dtype=t.dtype, shape=shape, shared_memory=ref)
    rows = t.shape[0]
    row_bytes = len(t.data) // rows if rows else 0
    return pb2.Tensor(dtype=t.dtype, shape=shape, data=t.data[begin * row_bytes:end * row_bytes])
