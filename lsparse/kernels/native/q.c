// The CPU path's products over 4- and 8-bit rows kept as stored (MLX's affine groups: w = scale * code + bias,
// codes packed little-endian, element i at bit i * bits; then the fp16 scales, then the fp16 biases), at the
// speed of memory: as llama.cpp does, x is quantized to int8 once per token, one scale per weight group, and
// each group's code . x is an exact integer sum (AVX-VNNI or AVX-512 VNNI dpbusd, AVX2 maddubs, or plain C);
// the down product accumulates whole rows in float, an output tile held in registers across all rows. Rows
// are split over OpenMP threads. Built with the other kernels by lsparse/kernels/native.py.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LSPARSE_AVX2 1
#endif
#if defined(LSPARSE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LSPARSE_AVX512 1
#endif

// x for one token, as the products take it: per chunk of 64 elements (4-bit rows: the 32 even-numbered
// elements, then the 32 odd, as a byte's low and high nibbles hold them; 8-bit rows: in order), int8 codes
// with one scale per `group` elements, and each group's exact float sum (for the biases).
void lsparse_quantize_x(const float* x, int64_t d, int group, int bits, int8_t* xq, float* scale, float* sum) {
  for (int64_t g = 0; g < d / group; g++) {
    const float* v = x + g * group;
    float m = 0.0f, s = 0.0f;
    for (int k = 0; k < group; k++) {
      m = fmaxf(m, fabsf(v[k]));
      s += v[k];
    }
    scale[g] = m > 0.0f ? m / 127.0f : 1.0f;
    sum[g] = s;
  }
  for (int64_t j = 0; j < d; j++) {
    const int8_t q = (int8_t)lrintf(x[j] / scale[j / group]);
    int64_t at = j;
    if (bits == 4) {  // within its chunk of 64: even elements first, then odd
      const int64_t chunk = j / 64 * 64, k = j - chunk;
      at = chunk + (k % 2) * 32 + k / 2;
    }
    xq[at] = q;
  }
}

#ifndef LSPARSE_AVX2
// The integer sum code . xq over one chunk of 64 elements, per half (32 elements each): two int32 sums, for a
// group of 32 (the halves belong to two groups) or added together for larger groups.
static void chunk_dot(const uint8_t* codes, const int8_t* xq, int bits, int32_t half[2]) {
  half[0] = half[1] = 0;
  if (bits == 4) {  // codes: 32 bytes; low nibbles the even elements, high nibbles the odd
    for (int b = 0; b < 32; b++) {
      const int h = b / 16;
      half[h] += (codes[b] & 15) * xq[b] + (codes[b] >> 4) * xq[32 + b];
    }
  } else {
    for (int b = 0; b < 64; b++) half[b / 32] += codes[b] * xq[b];
  }
}

#endif

#ifdef LSPARSE_AVX2
// 8 int32 lanes: lanes 0-3 sum the chunk's first half, lanes 4-7 its second
static inline __m256i chunk_dot_avx2(const uint8_t* codes, const int8_t* xq, int bits) {
  if (bits == 4) {
    const __m256i c = _mm256_loadu_si256((const __m256i*)codes), mask = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(c, mask), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
    // even x in bytes 0-31, odd in 32-63: lanes of lo/hi pair with the same half of each
    const __m256i xe = _mm256_loadu_si256((const __m256i*)xq), xo = _mm256_loadu_si256((const __m256i*)(xq + 32));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));  // |p| < 2^13
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
  }
  // 8 bits: codes up to 255 would overflow maddubs's int16 pairs; widen to 16 bits instead
  __m256i acc = _mm256_setzero_si256();
  for (int part = 0; part < 4; part++) {  // 16 elements each; parts 0-1 the first half, 2-3 the second
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(codes + 16 * part)));
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(xq + 16 * part)));
    const __m256i p = _mm256_madd_epi16(c, x);  // 8 int32, each of 2 elements
    // fold the 8 lanes to 4 and place them in the half they belong to
    const __m128i folded = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    acc = _mm256_add_epi32(acc, part < 2 ? _mm256_castsi128_si256(folded)
                                         : _mm256_inserti128_si256(_mm256_setzero_si256(), folded, 1));
  }
  return acc;
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// log2 of a group size (32, 64 or 128): a shift, where a division by a variable costs tens of cycles.
static inline int group_shift(int group) {
  return group == 32 ? 5 : group == 64 ? 6 : 7;
}

// Gathered rows lie anywhere: ask for a row two ahead so that it arrives while this one is multiplied.
static inline void prefetch_row(const uint8_t* row, int64_t row_bytes) {
  for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(row + at);
}

// n fp16 values as floats, times `by` (NULL: 1) and `times` (scalar)
static void halves(const uint16_t* h, int64_t n, const float* by, float times, float* out) {
  int64_t k = 0;
#if defined(LSPARSE_AVX2) && defined(__F16C__)
  for (; k + 8 <= n; k += 8) {
    __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + k))), _mm256_set1_ps(times));
    _mm256_storeu_ps(out + k, by ? _mm256_mul_ps(v, _mm256_loadu_ps(by + k)) : v);
  }
#endif
  for (; k < n; k++) out[k] = lsparse_half_to_float(h[k]) * times * (by ? by[k] : 1.0f);
}

// One row's product with x: sum over groups of scale * (code . x) + bias * sum(x)
static float row_dot(const uint8_t* row, int64_t d, int bits, int group, const int8_t* xq, const float* xscale,
                     const float* xsum) {
  const int64_t groups = d / group, code_bytes = d * bits / 8, chunk_bytes = 64 * bits / 8;
  const uint16_t* scales = (const uint16_t*)(row + code_bytes);
  float factor[groups], bias[groups];  // per group: the row's scale times x's; the row's bias times x's sum
  halves(scales, groups, xscale, 1.0f, factor);
  halves(scales + groups, groups, xsum, 1.0f, bias);
  float acc = 0.0f;
  for (int64_t g = 0; g < groups; g++) acc += bias[g];
  const int shift = group_shift(group);
#ifdef LSPARSE_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // two chains: an FMA's latency hidden
  for (int64_t c = 0; c < d / 64; c++) {
    const __m256 isum = _mm256_cvtepi32_ps(chunk_dot_avx2(row + c * chunk_bytes, xq + c * 64, bits));
    const __m256 f = group == 32 ? _mm256_set_m128(_mm_set1_ps(factor[2 * c + 1]), _mm_set1_ps(factor[2 * c]))
                                 : _mm256_set1_ps(factor[(c * 64) >> shift]);  // the halves' groups' factors
    if (c % 2)
      acc1 = _mm256_fmadd_ps(isum, f, acc1);
    else
      acc0 = _mm256_fmadd_ps(isum, f, acc0);
  }
  acc += hsum(_mm256_add_ps(acc0, acc1));
#else
  for (int64_t c = 0; c < d / 64; c++) {
    int32_t half[2];
    chunk_dot(row + c * chunk_bytes, xq + c * 64, bits, half);
    acc += (float)half[0] * factor[(c * 64) >> shift] + (float)half[1] * factor[(c * 64 + 32) >> shift];
  }
#endif
  return acc;
}

// y[i] = row(slots[i]) . x (slots NULL: row i, the rows in order), x as lsparse_quantize_x left it; d a multiple
// of 64
void lsparse_mv_q8x(const uint8_t* rows, int64_t row_bytes, int64_t d, int bits, int group, const int64_t* slots,
                    int64_t n, const int8_t* xq, const float* xscale, const float* xsum, float* y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    if (i + 2 < n) prefetch_row(rows + (slots ? slots[i + 2] : i + 2) * row_bytes, row_bytes);
    y[i] = row_dot(rows + (slots ? slots[i] : i) * row_bytes, d, bits, group, xq, xscale, xsum);
  }
}

// out[j] += sum over the rows of scaled[i, group of j] * code_i[j] (out: d floats, even elements then odd
// within each tile of 64 for 4 bits, in order for 8), each row read once, in order, across all its tiles:
// gathered rows stream from memory as the prefetcher likes them, while out stays in the first-level cache.
static void rows_into(const uint8_t* rows, int64_t row_bytes, int64_t d, int bits, int group, const int64_t* slots,
                      int64_t start, int64_t stop, const float* scaled, float* out) {
  const int64_t groups = d / group, tiles = d / 64, tile_bytes = 64 * bits / 8;
  const int shift = group_shift(group);
  int64_t i = start;
#if defined(LSPARSE_AVX512)
  if (bits == 4) {  // four rows a pass: out's tile loaded and stored once for all four
    const __m128i mask = _mm_set1_epi8(15);
    for (; i + 4 <= stop; i += 4) {
      const uint8_t* r[4];
      const float* s[4];
      for (int k = 0; k < 4; k++) {
        if (i + 4 + k < stop) prefetch_row(rows + slots[i + 4 + k] * row_bytes, row_bytes);
        r[k] = rows + slots[i + k] * row_bytes;
        s[k] = scaled + (i + k) * groups;
      }
      for (int64_t t = 0; t < tiles; t++) {
        float* o = out + t * 64;
        __m512 e0 = _mm512_loadu_ps(o), e1 = _mm512_loadu_ps(o + 16), o0 = _mm512_loadu_ps(o + 32),
               o1 = _mm512_loadu_ps(o + 48);
        const int64_t g0 = (t * 64) >> shift, g1 = (t * 64 + 32) >> shift;
        for (int k = 0; k < 4; k++) {
          const uint8_t* codes = r[k] + t * tile_bytes;
          const __m128i c0 = _mm_loadu_si128((const __m128i*)codes), c1 = _mm_loadu_si128((const __m128i*)(codes + 16));
          const __m512 v0 = _mm512_set1_ps(s[k][g0]), v1 = _mm512_set1_ps(s[k][g1]);
#define LSPARSE_F(v) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))
          e0 = _mm512_fmadd_ps(v0, LSPARSE_F(_mm_and_si128(c0, mask)), e0);
          e1 = _mm512_fmadd_ps(v1, LSPARSE_F(_mm_and_si128(c1, mask)), e1);
          o0 = _mm512_fmadd_ps(v0, LSPARSE_F(_mm_and_si128(_mm_srli_epi16(c0, 4), mask)), o0);
          o1 = _mm512_fmadd_ps(v1, LSPARSE_F(_mm_and_si128(_mm_srli_epi16(c1, 4), mask)), o1);
#undef LSPARSE_F
        }
        _mm512_storeu_ps(o, e0);
        _mm512_storeu_ps(o + 16, e1);
        _mm512_storeu_ps(o + 32, o0);
        _mm512_storeu_ps(o + 48, o1);
      }
    }
  }
#endif
  for (; i < stop; i++) {
    if (i + 2 < stop) prefetch_row(rows + slots[i + 2] * row_bytes, row_bytes);
    const uint8_t* row = rows + slots[i] * row_bytes;
    const float* s = scaled + i * groups;
    for (int64_t t = 0; t < tiles; t++) {
      const float s0 = s[(t * 64) >> shift], s1 = s[(t * 64 + 32) >> shift];
      const uint8_t* codes = row + t * tile_bytes;
      float* o = out + t * 64;
#if defined(LSPARSE_AVX2)
      const __m256 v0 = _mm256_set1_ps(s0), v1 = _mm256_set1_ps(s1);
      if (bits == 4) {  // parts: even of half 0, even of half 1, odd of half 0, odd of half 1 (out's order)
        const __m128i c0 = _mm_loadu_si128((const __m128i*)codes), c1 = _mm_loadu_si128((const __m128i*)(codes + 16));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i q[4] = {_mm_and_si128(c0, mask), _mm_and_si128(c1, mask),
                              _mm_and_si128(_mm_srli_epi16(c0, 4), mask), _mm_and_si128(_mm_srli_epi16(c1, 4), mask)};
        for (int part = 0; part < 4; part++) {
          const __m256 v = part % 2 ? v1 : v0;
          float* p = o + 16 * part;
          _mm256_storeu_ps(p, _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[part])),
                                              _mm256_loadu_ps(p)));
          _mm256_storeu_ps(p + 8, _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                         _mm_srli_si128(q[part], 8))), _mm256_loadu_ps(p + 8)));
        }
      } else {
        for (int part = 0; part < 8; part++) {
          const __m128i c = _mm_loadl_epi64((const __m128i*)(codes + 8 * part));
          _mm256_storeu_ps(o + 8 * part, _mm256_fmadd_ps(part < 4 ? v0 : v1,
                                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)),
                                                         _mm256_loadu_ps(o + 8 * part)));
        }
      }
#else
      if (bits == 4) {
        for (int b = 0; b < 32; b++) {  // byte b: elements 2b (low nibble) and 2b + 1 (high) of the tile
          o[b] += (b < 16 ? s0 : s1) * (float)(codes[b] & 15);
          o[32 + b] += (b < 16 ? s0 : s1) * (float)(codes[b] >> 4);
        }
      } else {
        for (int b = 0; b < 64; b++) o[b] += (b < 32 ? s0 : s1) * (float)codes[b];
      }
#endif
    }
  }
}

// out = sum over i of a[i] * row(slots[i]), rows whose a[i] is 0 left out by the caller; d a multiple of 64;
// scratch holds n * (d / group) + threads * d floats
void lsparse_vm_q(const uint8_t* rows, int64_t row_bytes, int64_t d, int bits, int group, const int64_t* slots,
                  int64_t n, const float* a, float* out, float* scratch, int threads) {
  const int64_t groups = d / group, code_bytes = d * bits / 8;
  float* partial = scratch + n * groups;  // one d-float sum per thread
  float bias[groups], row_bias[groups];
  for (int64_t g = 0; g < groups; g++) bias[g] = 0.0f;
  for (int64_t i = 0; i < n; i++) {  // each row's scales and biases converted once, times its coefficient
    const uint16_t* scales = (const uint16_t*)(rows + slots[i] * row_bytes + code_bytes);
    halves(scales, groups, NULL, a[i], scratch + i * groups);
    halves(scales + groups, groups, NULL, a[i], row_bias);
    for (int64_t g = 0; g < groups; g++) bias[g] += row_bias[g];
  }
  if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < threads; t++) {
    float* mine = partial + t * d;
    memset(mine, 0, d * sizeof(float));
    rows_into(rows, row_bytes, d, bits, group, slots, n * t / threads, n * (t + 1) / threads, scratch, mine);
  }
  for (int64_t tile = 0; tile < d / 64; tile++) {  // the threads' sums, back in element order, plus the biases
    for (int k = 0; k < 64; k++) {
      float sum = 0.0f;
      for (int t = 0; t < threads; t++) sum += partial[t * d + tile * 64 + k];
      const int64_t element = tile * 64 + (bits == 4 ? (k < 32 ? 2 * k : 2 * (k - 32) + 1) : k);
      out[element] = sum + bias[element / group];
    }
  }
}
