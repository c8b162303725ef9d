// Rows of the neuron cache, as the kernels read them. A row is d weights in MLX's affine quantization: the
// codes packed into 32-bit words, then one fp16 scale and one fp16 bias per group of GROUP weights
// (w = scale * code + bias); with BITS 16, d plain fp16 weights (GROUP 0). This is the image's row format
// (docs/IMAGE_FORMAT.md), so bundles read from flash are used as they are.
//
// A lane works on a block of VALUES consecutive weights of a row: 16 bytes of it (four 32-bit words), the
// load MLX's qmv_fast and qvm make per lane. GROUP (32, 64 or 128) is a multiple of VALUES (at most 32), so a
// block lies in one group and takes one scale and one bias. The four words are read as four 4-byte loads:
// a row of an image need not start on a 16-byte boundary.
#include <metal_stdlib>
using namespace metal;

template <int BITS, int GROUP>
struct Row {
  static constexpr int VALUES = 128 / BITS;  // weights per lane per block: 32 at 4 bits, 16 at 8
  static constexpr int PER_WORD = 32 / BITS;

  // d, from a row's length in 32-bit words: d * BITS / 32 words of codes, then d / GROUP of scales and biases
  static int width(int row_words) {
    return row_words * 32 * GROUP / (BITS * GROUP + 32);
  }

  // The block at `col` of this row dotted with xr, its VALUES weights of x held in registers; xsum is their
  // sum: sum (s q + b) x = s (q . x) + b (sum x), one multiply per weight, as MLX's qmv does.
  static float dot(const device uint32_t* row, int d, int col, const thread float* xr, float xsum) {
    const device uint32_t* words = row + col / PER_WORD;
    const device half* scales = (const device half*)(row + d / PER_WORD);
    float q = 0.0f;
    for (int w = 0; w < 4; w++) {
      uint32_t packed = words[w];
      for (int k = 0; k < PER_WORD; k++) {
        q += float(packed & ((1u << BITS) - 1u)) * xr[w * PER_WORD + k];
        packed >>= BITS;
      }
    }
    return float(scales[col / GROUP]) * q + float(scales[d / GROUP + col / GROUP]) * xsum;
  }

  // acc[k] += a * row[col + k] for the VALUES weights of the block at `col`
  static void axpy(const device uint32_t* row, int d, int col, float a, thread float* acc) {
    const device uint32_t* words = row + col / PER_WORD;
    const device half* scales = (const device half*)(row + d / PER_WORD);
    const float s = a * float(scales[col / GROUP]);
    const float b = a * float(scales[d / GROUP + col / GROUP]);
    for (int w = 0; w < 4; w++) {
      uint32_t packed = words[w];
      for (int k = 0; k < PER_WORD; k++) {
        acc[w * PER_WORD + k] += s * float(packed & ((1u << BITS) - 1u)) + b;
        packed >>= BITS;
      }
    }
  }
};

template <int GROUP>
struct Row<16, GROUP> {
  static constexpr int VALUES = 8;

  static int width(int row_words) {
    return row_words * 2;
  }

  static float dot(const device uint32_t* row, int d, int col, const thread float* xr, float xsum) {
    const device half* h = (const device half*)row + col;
    float acc = 0.0f;
    for (int k = 0; k < VALUES; k++) {
      acc += float(h[k]) * xr[k];
    }
    return acc;
  }

  static void axpy(const device uint32_t* row, int d, int col, float a, thread float* acc) {
    const device half* h = (const device half*)row + col;
    for (int k = 0; k < VALUES; k++) {
      acc[k] += a * float(h[k]);
    }
  }
};

// x's block at `col` into registers; returns the block's sum
template <int VALUES>
inline float load_block(const device float* x, int col, thread float* xr) {
  float sum = 0.0f;
  for (int k = 0; k < VALUES; k++) {
    xr[k] = x[col + k];
    sum += xr[k];
  }
  return sum;
}

// Whether a neuron is active, from its gate (OPT: fc1) pre-activation: for ReLU-family models where it exceeds
// the cut (0, or FATReLU's threshold); with CATS (SwiGLU images) where |silu(pre)| does.
template <int CATS>
struct Gate {
  static bool active(float pre, float cut) {
    if (CATS) {
      return fabs(pre / (1.0f + exp(-pre))) > cut;
    }
    return pre > cut;
  }
};
template <int BITS, int GROUP>
[[kernel]] void custom_kernel_lsparse_gather_down__4_128_uint32_t_int32_t_float_float(
  const device uint32_t* w [[buffer(0)]],
  const constant int* w_shape [[buffer(1)]],
  const device int32_t* slots [[buffer(2)]],
  const constant int* slots_shape [[buffer(3)]],
  const device float* a [[buffer(4)]],
  device float* partial [[buffer(5)]],
  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],
  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {
  // partial[s][j] = sum of a[i] * row(slots[i])[j] over split s's slots (SPLIT of them): the down projection
  // over a layer's neuron cache, whose rows are the active neurons' down columns, split over the slot list as
  // MLX's qvm_split_k splits K; the caller sums the splits (a second, small pass). Grid (32 * column blocks,
  // 2 * splits), threadgroup (32, 2): each lane owns a block of VALUES outputs, the two SIMD groups take
  // alternate slots of the split, and the second's sums meet the first's in threadgroup memory. Only the
  // split's slots are visited; slots of -1 and zero coefficients are skipped.
  constexpr int SPLIT = 64;
  constexpr int SIMDS = 2;
  constexpr int V = Row<BITS, GROUP>::VALUES;
  threadgroup float other[32 * V];
  const int n = slots_shape[0];
  const int d = Row<BITS, GROUP>::width(w_shape[1]);
  const int lane = int(thread_position_in_threadgroup.x);
  const int simd = int(thread_position_in_threadgroup.y);
  const int col = (int(threadgroup_position_in_grid.x) * 32 + lane) * V;
  const int split = int(threadgroup_position_in_grid.y);
  const int end = min(n, (split + 1) * SPLIT);
  float acc[V];
  for (int k = 0; k < V; k++) {
    acc[k] = 0.0f;
  }
  if (col < d) {
    for (int i = split * SPLIT + simd; i < end; i += SIMDS) {
      const int slot = slots[i];
      const float coefficient = a[i];
      if (slot >= 0 && coefficient != 0.0f) {
        Row<BITS, GROUP>::axpy(w + size_t(slot) * size_t(w_shape[1]), d, col, coefficient, acc);
      }
    }
  }
  if (simd == 1) {
    for (int k = 0; k < V; k++) {
      other[lane * V + k] = acc[k];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd == 0 && col < d) {
    for (int k = 0; k < V; k++) {
      partial[size_t(split) * size_t(d) + size_t(col + k)] = acc[k] + other[lane * V + k];
    }
  }

}

template [[host_name("custom_kernel_lsparse_gather_down__4_128_uint32_t_int32_t_float_float")]] [[kernel]] decltype(custom_kernel_lsparse_gather_down__4_128_uint32_t_int32_t_float_float<4, 128>) custom_kernel_lsparse_gather_down__4_128_uint32_t_int32_t_float_float<4, 128>;

