// fp32 -> IEEE binary16 with round-to-nearest-even, the inverse of kernels::Float16ToFloat on
// every fp16 value. Used to build fp16 heads; a candidate for kernels/dtype.h beside
// FloatToBFloat16 should another component need it.
#pragma once

#include <cstdint>
#include <cstring>

namespace logitserve {

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

}  // namespace logitserve
