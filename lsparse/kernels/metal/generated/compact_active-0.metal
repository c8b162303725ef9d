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
template <int CATS>
[[kernel]] void custom_kernel_lsparse_compact_active__0_float_floatc_int32_t_int32_t(
  const device float* pre [[buffer(0)]],
  const constant int* pre_shape [[buffer(1)]],
  const constant float* threshold [[buffer(2)]],
  device int32_t* indices [[buffer(3)]],
  device int32_t* count [[buffer(4)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],
  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],
  uint3 threads_per_threadgroup [[threads_per_threadgroup]]) {
  // indices[0, count) = the neurons whose pre-activation passes the layer's rule, in ascending order, and -1
  // after them: exact gating's active list from the dense gate product, for the gather kernels' slot lists.
  // One threadgroup: each thread counts the active neurons of a contiguous chunk, a prefix sum across the
  // threadgroup (within SIMD groups, then over their totals) gives each chunk its place, and each thread
  // writes its chunk. The list comes out in neuron order, so bundles are read in file order without a sort.
  threadgroup int simd_totals[32];
  const int n = pre_shape[0];
  const int t = int(thread_position_in_threadgroup.x);
  const int threads = int(threads_per_threadgroup.x);
  const int chunk = (n + threads - 1) / threads;
  const int begin = min(n, t * chunk);
  const int end = min(n, begin + chunk);
  const float cut = threshold[0];
  int mine = 0;
  for (int i = begin; i < end; i++) {
    mine += Gate<CATS>::active(pre[i], cut) ? 1 : 0;
  }
  const int before_in_simd = simd_prefix_exclusive_sum(mine);
  const int simd_total = simd_sum(mine);
  if (thread_index_in_simdgroup == 0) {
    simd_totals[simdgroup_index_in_threadgroup] = simd_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int at = before_in_simd;
  int total = 0;
  for (int s = 0; s < (threads + 31) / 32; s++) {
    at += s < int(simdgroup_index_in_threadgroup) ? simd_totals[s] : 0;
    total += simd_totals[s];
  }
  for (int i = begin; i < end; i++) {
    if (Gate<CATS>::active(pre[i], cut)) {
      indices[at++] = i;
    }
    if (i >= total) {  // positions total..n-1 are padding; this thread's chunk covers its share of them
      indices[i] = -1;
    }
  }
  if (t == 0) {
    count[0] = total;
  }

}

template [[host_name("custom_kernel_lsparse_compact_active__0_float_floatc_int32_t_int32_t")]] [[kernel]] decltype(custom_kernel_lsparse_compact_active__0_float_floatc_int32_t_int32_t<0>) custom_kernel_lsparse_compact_active__0_float_floatc_int32_t_int32_t<0>;

