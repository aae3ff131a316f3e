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
