// Element types the kernels read, and exact scalar conversions to fp32 (host and device).
#pragma once

#include <cstdint>
#include <cstring>

#include "logitserve/kernels/block_stats.h"

namespace logitserve::kernels {

// Floating-point element types of logits, hidden states and head weights.
enum class FloatType : uint8_t { kFloat32, kBFloat16, kFloat16 };

inline constexpr int64_t SizeOf(FloatType t) { return t == FloatType::kFloat32 ? 4 : 2; }

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
LOGITSERVE_HD float BFloat16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// fp16 -> fp32 is exact (every binary16 value, subnormals, infinities and NaN included).
LOGITSERVE_HD float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalise
    uint32_t e = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    u = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// fp32 -> bf16 with round-to-nearest-even (NaN stays NaN).
LOGITSERVE_HD uint16_t FloatToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// fp32 -> IEEE binary16 with round-to-nearest-even, the inverse of Float16ToFloat on every fp16
// value (NaN stays NaN, with its top payload bits). Host only: used to build fp16 heads and inputs.
inline uint16_t FloatToFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: keep the top payload bits, force quiet
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  // 65520 = 0x477ff000 is the midpoint between 65504 (max fp16) and 2^16: ties round to even,
  // i.e. to infinity; so does everything above, including +-inf itself.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs >= 0x38800000u) {  // >= 2^-14: normal fp16
    // Round the 13 dropped mantissa bits to nearest even; a carry ripples into the exponent,
    // which is then re-biased from 127 to 15.
    const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)));
  }
  // Subnormal fp16 (or zero): the result is round(|f| * 2^24) as an integer mantissa.
  const uint32_t exp = abs >> 23;
  const uint32_t shift = 126u - exp;  // |f| * 2^24 = mant * 2^-(126 - exp), mant with its 1 bit
  if (shift > 24u) return sign;       // below 2^-25: rounds to zero
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  uint32_t result = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (result & 1u))) ++result;  // may become 0x400: min normal
  return static_cast<uint16_t>(sign | result);
}

// "fp32", "bf16", "fp16": the names of --synthetic-head's dtype=, of logs and of test names.
inline constexpr const char* FloatTypeName(FloatType type) {
  switch (type) {
    case FloatType::kFloat32:
      return "fp32";
    case FloatType::kBFloat16:
      return "bf16";
    case FloatType::kFloat16:
      return "fp16";
  }
  return "?";
}

// Reads element i of a row of the given type as fp32.
LOGITSERVE_HD float LoadAsFloat(FloatType t, const void* row, int64_t i) {
  switch (t) {
    case FloatType::kFloat32:
      return static_cast<const float*>(row)[i];
    case FloatType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(row)[i]);
    case FloatType::kFloat16:
    default:
      return Float16ToFloat(static_cast<const uint16_t*>(row)[i]);
  }
}

}  // namespace logitserve::kernels
