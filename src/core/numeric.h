// Scalar conversions between the storage dtypes and fp32, bit-exact with CUDA's
// round-to-nearest-even conversions, usable on host and device.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "core/platform.h"
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace fusedloss::core {

FL_HD float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
FL_HD uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// bfloat16 = the top 16 bits of a float.
FL_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
FL_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#endif
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return uint16_t(u >> 16);
}

// IEEE binary16.
FL_HD float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#endif
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    // zero or subnormal: man * 2^-24, exact in fp32
    float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}
FL_HD uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#endif
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // result is subnormal or zero: value / 2^-24 rounded to nearest even
    float v = bits_to_float(a) * 16777216.0f;  // exact scaling by 2^24
    float r = rintf(v);                         // ties to even in the default mode
    return uint16_t(sign | uint16_t(r));
  }
  // normal: rebias the exponent and round the 13 dropped mantissa bits
  uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | uint16_t((rounded - (112u << 23)) >> 13));
}

// float8_e4m3fn: bias 7, 3 mantissa bits, max 448, no infinities, NaN = S.1111.111.
// Round to nearest even; like PyTorch's conversion, |x| >= 480 (and inf) become NaN.
FL_HD float e4m3_to_float(uint8_t b) {
  uint32_t sign = uint32_t(b & 0x80u) << 24;
  uint32_t exp = (b >> 3) & 0xfu, man = b & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_to_float(0x7fc00000u | sign);
  if (exp == 0) {
    float v = float(man) * 0.001953125f;  // man * 2^-9
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}
// Rounds to nearest even. Beyond the largest finite value 448 (anything that rounds past it,
// and inf): +-448 when `saturate` (the hardware's satfinite conversion; newer torch casts), NaN
// otherwise (older torch casts). NaN stays NaN.
FL_HD uint8_t float_to_e4m3(float f, bool saturate) {
  uint32_t u = float_to_bits(f);
  uint8_t sign = uint8_t((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  const uint8_t overflow = uint8_t(sign | (saturate ? 0x7eu : 0x7fu));
  if (a > 0x7f800000u) return uint8_t(sign | 0x7fu);  // NaN
  if (a >= 0x43f00000u) return overflow;              // >= 480 or inf
  if (a < (121u << 23)) {                             // below 2^-6: subnormal or zero
    float r = rintf(bits_to_float(a) * 512.0f);       // units of 2^-9, ties to even
    return uint8_t(sign | uint8_t(r));
  }
  a += ((7u - 127u) << 23) + 0x7ffffu + ((a >> 20) & 1u);
  const uint8_t code = uint8_t(a >> 20);
  return code == 0x7fu ? overflow : uint8_t(sign | code);  // 0x7f: rounded up past 448
}

enum class StorageKind { F32, F16, BF16, E4M3 };

template <StorageKind K> struct Storage;
template <> struct Storage<StorageKind::F32> {
  using type = float;
  static FL_HD float load(float v) { return v; }
  static FL_HD float store(float v) { return v; }
};
template <> struct Storage<StorageKind::F16> {
  using type = uint16_t;
  static FL_HD float load(uint16_t v) { return half_to_float(v); }
  static FL_HD uint16_t store(float v) { return float_to_half(v); }
};
template <> struct Storage<StorageKind::BF16> {
  using type = uint16_t;
  static FL_HD float load(uint16_t v) { return bf16_to_float(v); }
  static FL_HD uint16_t store(float v) { return float_to_bf16(v); }
};

// Read-only: the e4m3 copy is written by float_to_e4m3 with the caller's overflow rule.
template <> struct Storage<StorageKind::E4M3> {
  using type = uint8_t;
  static FL_HD float load(uint8_t v) { return e4m3_to_float(v); }
};

// The element type of a storage kind, and the kind's load/store, by the kind.
template <StorageKind K>
using Elem = typename Storage<K>::type;
template <StorageKind K>
using St = Storage<K>;

}  // namespace fusedloss::core
