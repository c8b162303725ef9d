// Rows of the neuron cache, as the kernels read them. A row is d weights in MLX's affine quantization: the
// codes packed into 32-bit words, then one fp16 scale and one fp16 bias per group of GROUP weights
// (w = scale * code + bias); with BITS 16, d plain fp16 weights. This is the image's row format
// (docs/IMAGE_FORMAT.md), so bundles read from flash are used as they are.
#include <metal_stdlib>
using namespace metal;

template <int BITS, int GROUP>
struct Row {
  static int per_word() {
    return 32 / BITS;
  }

  // d, from a row's length in 32-bit words: d * BITS / 32 words of codes, then d / GROUP of scales and biases
  static int width(int row_words) {
    return row_words * 32 * GROUP / (BITS * GROUP + 32);
  }

  // This lane's share of row . x: words lane, lane + 32, ...
  static float dot(const device uint32_t* row, const device float* x, uint lane, int d) {
    const int per = 32 / BITS;
    const int words = d / per;
    const device half* scales = (const device half*)(row + words);
    const device half* biases = scales + d / GROUP;
    const uint32_t mask = (1u << BITS) - 1u;
    float acc = 0.0f;
    for (int w = int(lane); w < words; w += 32) {
      const int i = w * per;
      uint32_t packed = row[w];
      float dot = 0.0f;
      float xsum = 0.0f;
      for (int k = 0; k < per; k++) {
        const float xk = x[i + k];
        dot += float(packed & mask) * xk;
        xsum += xk;
        packed >>= BITS;
      }
      // sum (s q + b) x = s (q . x) + b (sum x): one multiply per weight, as MLX's qmv does
      acc += float(scales[i / GROUP]) * dot + float(biases[i / GROUP]) * xsum;
    }
    return acc;
  }

  // out[k] += a * row[word * per_word + k] for the weights of one word
  static void axpy(const device uint32_t* row, int word, int d, float a, thread float* out) {
    const int per = 32 / BITS;
    const int i = word * per;
    const device half* scales = (const device half*)(row + d / per);
    const device half* biases = scales + d / GROUP;
    const float s = a * float(scales[i / GROUP]);
    const float b = a * float(biases[i / GROUP]);
    uint32_t packed = row[word];
    for (int k = 0; k < per; k++) {
      out[k] += s * float(packed & ((1u << BITS) - 1u)) + b;
      packed >>= BITS;
    }
  }
};

template <int GROUP>
struct Row<16, GROUP> {
  static int per_word() {
    return 2;
  }

  static int width(int row_words) {
    return row_words * 2;
  }

  static float dot(const device uint32_t* row, const device float* x, uint lane, int d) {
    const device half* h = (const device half*)row;
    float acc = 0.0f;
    for (int w = int(lane); w < d / 2; w += 32) {
      acc += float(h[2 * w]) * x[2 * w] + float(h[2 * w + 1]) * x[2 * w + 1];
    }
    return acc;
  }

  static void axpy(const device uint32_t* row, int word, int d, float a, thread float* out) {
    const device half* h = (const device half*)row;
    out[0] += a * float(h[2 * word]);
    out[1] += a * float(h[2 * word + 1]);
  }
};

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

