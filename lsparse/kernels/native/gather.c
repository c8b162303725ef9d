// The CPU path's gathered products over fp32 rows of a neuron cache, in place: numpy's `rows[slots] @ x`
// first copies the gathered rows (at 7B geometry a copy larger than the product), so that sparse lost to
// OpenBLAS's dense product from about 20% active; reading the rows where they lie keeps it ahead almost to
// 100% (docs/BENCHMARKS.md, `lsparse bench kernels`). Built at first use by lsparse/kernels/native.py.
#include <stdint.h>

#include "half.h"

#define LANES 16  // independent partial sums, so that the compiler vectorizes the dot product

// y[i] = rows[slots[i]] . x, rows being d floats apart
void lsparse_gather_mv(const float* rows, int64_t d, const int64_t* slots, int64_t n, const float* x, float* y) {
  for (int64_t i = 0; i < n; i++) {
    const float* row = rows + slots[i] * d;
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES) {
      for (int k = 0; k < LANES; k++) acc[k] += row[j + k] * x[j + k];
    }
    float sum = 0.0f;
    for (; j < d; j++) sum += row[j] * x[j];
    for (int k = 0; k < LANES; k++) sum += acc[k];
    y[i] = sum;
  }
}

// out = sum over i of a[i] * rows[slots[i]], four rows per pass over out
void lsparse_gather_vm(const float* rows, int64_t d, const int64_t* slots, int64_t n, const float* a, float* out) {
  for (int64_t j = 0; j < d; j++) out[j] = 0.0f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float *r0 = rows + slots[i] * d, *r1 = rows + slots[i + 1] * d;
    const float *r2 = rows + slots[i + 2] * d, *r3 = rows + slots[i + 3] * d;
    const float a0 = a[i], a1 = a[i + 1], a2 = a[i + 2], a3 = a[i + 3];
    for (int64_t j = 0; j < d; j++) out[j] += a0 * r0[j] + a1 * r1[j] + a2 * r2[j] + a3 * r3[j];
  }
  for (; i < n; i++) {
    const float* r = rows + slots[i] * d;
    const float ai = a[i];
    for (int64_t j = 0; j < d; j++) out[j] += ai * r[j];
  }
}

// The same products over rows kept as stored: MLX's affine 4- or 8-bit groups (codes in little-endian words,
// element i at bit i * bits of the row; then one fp16 scale and one fp16 bias per group), the image's and the
// Metal kernels' row format. No row is ever decoded: a 4-bit cache takes a seventh of the RAM of fp32 rows
// and the decode that cost more than the products is gone.

// One row's sum over a group of `group` codes times x (x_even/x_odd: x split by parity, for 4 bits).
static float group_dot4(const uint8_t* codes, const float* x_even, const float* x_odd, int group) {
  float even = 0.0f, odd = 0.0f;
  for (int b = 0; b < group / 2; b++) {
    even += (float)(codes[b] & 15) * x_even[b];
    odd += (float)(codes[b] >> 4) * x_odd[b];
  }
  return even + odd;
}

static float group_dot8(const uint8_t* codes, const float* x, int group) {
  float acc = 0.0f;
  for (int b = 0; b < group; b++) acc += (float)codes[b] * x[b];
  return acc;
}

// y[i] = row(slots[i]) . x for rows of row_bytes bytes; scratch holds 2 * d + d / group floats
void lsparse_gather_mv_q(const uint8_t* rows, int64_t row_bytes, int64_t d, int bits, int group,
                         const int64_t* slots, int64_t n, const float* x, float* y, float* scratch) {
  const int64_t groups = d / group, code_bytes = d * bits / 8;
  float* x_even = scratch;
  float* x_odd = scratch + d / 2;
  float* x_sum = scratch + d;
  for (int64_t j = 0; j < d / 2; j++) {
    x_even[j] = x[2 * j];
    x_odd[j] = x[2 * j + 1];
  }
  for (int64_t g = 0; g < groups; g++) {
    float s = 0.0f;
    for (int k = 0; k < group; k++) s += x[g * group + k];
    x_sum[g] = s;
  }
  for (int64_t i = 0; i < n; i++) {
    const uint8_t* row = rows + slots[i] * row_bytes;
    const uint16_t* scales = (const uint16_t*)(row + code_bytes);
    const uint16_t* biases = scales + groups;
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
      const float dot = bits == 4 ? group_dot4(row + g * group / 2, x_even + g * group / 2, x_odd + g * group / 2, group)
                                  : group_dot8(row + g * group, x + g * group, group);
      acc += lsparse_half_to_float(scales[g]) * dot + lsparse_half_to_float(biases[g]) * x_sum[g];
    }
    y[i] = acc;
  }
}

// out = sum over i of a[i] * row(slots[i]); scratch holds d floats
void lsparse_gather_vm_q(const uint8_t* rows, int64_t row_bytes, int64_t d, int bits, int group,
                         const int64_t* slots, int64_t n, const float* a, float* out, float* scratch) {
  const int64_t groups = d / group, code_bytes = d * bits / 8;
  float* out_even = scratch;  // 4 bits: even and odd outputs apart, so that the loops vectorize
  float* out_odd = scratch + d / 2;
  for (int64_t j = 0; j < d; j++) (bits == 4 ? scratch : out)[j] = 0.0f;
  float bias_sum[groups > 0 ? groups : 1];
  for (int64_t g = 0; g < groups; g++) bias_sum[g] = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const uint8_t* row = rows + slots[i] * row_bytes;
    const uint16_t* scales = (const uint16_t*)(row + code_bytes);
    const uint16_t* biases = scales + groups;
    for (int64_t g = 0; g < groups; g++) {
      const float s = a[i] * lsparse_half_to_float(scales[g]);
      bias_sum[g] += a[i] * lsparse_half_to_float(biases[g]);  // a group's biases add the same to each of its outputs
      if (bits == 4) {
        const uint8_t* codes = row + g * group / 2;
        float* e = out_even + g * group / 2;
        float* o = out_odd + g * group / 2;
        for (int b = 0; b < group / 2; b++) {
          e[b] += s * (float)(codes[b] & 15);
          o[b] += s * (float)(codes[b] >> 4);
        }
      } else {
        const uint8_t* codes = row + g * group;
        float* o = out + g * group;
        for (int b = 0; b < group; b++) o[b] += s * (float)codes[b];
      }
    }
  }
  if (bits == 4) {
    for (int64_t j = 0; j < d / 2; j++) {
      out[2 * j] = out_even[j];
      out[2 * j + 1] = out_odd[j];
    }
  }
  for (int64_t j = 0; j < d; j++) out[j] += bias_sum[j / group];
}
