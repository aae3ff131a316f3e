"""bfloat16 conversion: round to nearest, ties to even, against hand-computed bit patterns."""

from fractions import Fraction

import numpy as np

import logitserve
import reference as ref
from logitserve import _tensors


def bits(values, dtype=np.float32):
    return logitserve.to_bf16_bits(np.array(values, dtype)).tolist()


def test_hand_computed_patterns():
    # 1.0 = 0x3F80; bf16 ulp at 1 is 2^-7.
    assert bits([1.0]) == [0x3F80]
    assert bits([1.0 + 2**-8]) == [0x3F80]             # tie, 0x3F80 even -> down
    assert bits([1.0 + 3 * 2**-8]) == [0x3F82]         # tie between 0x3F81 (odd) and 0x3F82
    assert bits([1.0 + 2**-8 + 2**-20]) == [0x3F81]    # just above the tie -> up
    assert bits([1.0 + 2**-8 - 2**-20]) == [0x3F80]    # just below the tie -> down
    assert bits([-1.0 - 3 * 2**-8]) == [0xBF82]        # sign kept, ties to even in magnitude
    assert bits([0.0, -0.0]) == [0x0000, 0x8000]
    assert bits([np.inf, -np.inf]) == [0x7F80, 0xFF80]
    assert bits([3.3895314e38]) == [0x7F7F]            # bf16 max stays finite
    assert bits([np.finfo(np.float32).max]) == [0x7F80]  # rounds past bf16 max -> +inf
    # float32 subnormal 0x00018000 is a tie between bf16 0x0001 (odd) and 0x0002 (even).
    sub = np.array([0x00018000, 0x00008000, 0x00008001], np.uint32).view(np.float32)
    assert logitserve.to_bf16_bits(sub).tolist() == [0x0002, 0x0000, 0x0001]
    nan = logitserve.to_bf16_bits(np.array([np.nan], np.float32))[0]
    assert (nan & 0x7F80) == 0x7F80 and (nan & 0x7F) != 0  # still a NaN


def test_matches_independent_rounding_on_random_values():
    x = np.random.default_rng(0).normal(0, 10, 4000).astype(np.float32)
    # Force many exact ties: low 16 bits = 0x8000.
    tie_bits = (x.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    x = np.concatenate([x, tie_bits.view(np.float32)])
    got = logitserve.bf16_bits_to_f32(logitserve.to_bf16_bits(x)).astype(np.float64)
    np.testing.assert_array_equal(got, ref.bf16_round(x))


def _exact_bf16(value):
    """Correctly rounded bf16 of a float64 via exact rational arithmetic (normal range)."""
    f = Fraction(value)
    sign = -1 if f < 0 else 1
    f = abs(f)
    e = 0
    while f >= 2:
        f /= 2
        e += 1
    while f < 1:
        f *= 2
        e -= 1
    scaled = f * 128  # 8 significant bits
    lo = scaled.numerator // scaled.denominator
    rem = scaled - lo
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and lo % 2 == 1):
        lo += 1
    return sign * float(Fraction(lo, 128) * Fraction(2) ** e)


def test_float64_has_no_double_rounding():
    # 1 + 2^-8 + 2^-30: float32 rounding alone gives 1 + 2^-8 (a bf16 tie -> 1.0), but the
    # float64 value is above the tie, so the correct bf16 is 1 + 2^-7.
    v = 1.0 + 2**-8 + 2**-30
    assert float(np.float32(v)) == 1.0 + 2**-8
    assert bits([v], np.float64) == [0x3F81]
    vals = np.random.default_rng(1).normal(0, 5, 2000)
    got = logitserve.bf16_bits_to_f32(logitserve.to_bf16_bits(vals)).astype(np.float64)
    want = np.array([_exact_bf16(v) for v in vals])
    np.testing.assert_array_equal(got, want)


def test_tensor_encoding_conventions():
    from logitserve._pb import pb2
    x = np.array([[1.0, 2.5]], np.float32)
    t = _tensors.float_tensor(x, None, "hidden")
    assert t.dtype == pb2().DATA_TYPE_FLOAT32 and list(t.shape) == [1, 2] and len(t.data) == 8
    t = _tensors.float_tensor(x.astype(np.float16), None, "hidden")
    assert t.dtype == pb2().DATA_TYPE_FLOAT16 and len(t.data) == 4
    t = _tensors.float_tensor(np.array([[0x3F80]], np.uint16), None, "hidden")
    assert t.dtype == pb2().DATA_TYPE_BFLOAT16 and t.data == b"\x80\x3f"  # little-endian bf16 bits
    t = _tensors.float_tensor(x, "bf16", "hidden")
    assert t.data == np.array([0x3F80, 0x4020], "<u2").tobytes()
