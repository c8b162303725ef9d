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
template <int BITS, int GROUP>
[[kernel]] void custom_kernel_lsparse_gather_mv__4_64_uint32_t_int32_t_float_float(
  const device uint32_t* w [[buffer(0)]],
  const constant int* w_shape [[buffer(1)]],
  const device int32_t* slots [[buffer(2)]],
  const constant int* slots_shape [[buffer(3)]],
  const device float* x [[buffer(4)]],
  const constant int* x_shape [[buffer(5)]],
  device float* y [[buffer(6)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
  // y[i] = row(slots[i]) . x over the slots of a layer's neuron cache (the gate or up rows of the active
  // neurons). One SIMD group of 32 lanes per row: grid (32, capacity), threadgroup (32, rows per group).
  // The slot list has a fixed capacity, padded with -1, so shapes, and the compiled kernel, never change.
  const uint lane = thread_position_in_grid.x;
  const int i = int(thread_position_in_grid.y);
  const int n = slots_shape[0];
  if (i >= n) {
    return;  // all 32 lanes of a SIMD group share i: a uniform branch
  }
  const int slot = slots[i];
  float acc = 0.0f;
  if (slot >= 0) {
    acc = Row<BITS, GROUP>::dot(w + size_t(slot) * size_t(w_shape[1]), x, lane, x_shape[0]);
  }
  acc = simd_sum(acc);
  if (lane == 0) {
    y[i] = acc;
  }

}

template [[host_name("custom_kernel_lsparse_gather_mv__4_64_uint32_t_int32_t_float_float")]] [[kernel]] decltype(custom_kernel_lsparse_gather_mv__4_64_uint32_t_int32_t_float_float<4, 64>) custom_kernel_lsparse_gather_mv__4_64_uint32_t_int32_t_float_float<4, 64>;

