// IEEE half precision to float in software, for C and C++: compilers differ on native half types (clang 14
// has no _Float16 on x86, and its __fp16 needs a runtime library Debian lacks). Used by the CPU kernels
// (gather.c) and by the Metal emulator (metal/proof/emulator.h).
#pragma once
#include <stdint.h>
#include <string.h>

static inline float lsparse_half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = mantissa;
    do {
      m <<= 1;
      e++;
    } while (!(m & 0x400u));
    bits = sign | (uint32_t)(112 - e) << 23 | ((m & 0x3FFu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
