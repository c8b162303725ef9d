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
template <int BITS, int GROUP, int SKIP>
[[kernel]] void custom_kernel_lsparse_gather_gate_up__16_0_1_uint32_t_uint32_t_int32_t_float_floatc_float_float(
  const device uint32_t* gate_w [[buffer(0)]],
  const constant int* gate_w_shape [[buffer(1)]],
  const device uint32_t* up_w [[buffer(2)]],
  const device int32_t* slots [[buffer(3)]],
  const constant int* slots_shape [[buffer(4)]],
  const device float* x [[buffer(5)]],
  const constant int* x_shape [[buffer(6)]],
  const constant float* threshold [[buffer(7)]],
  device float* gate [[buffer(8)]],
  device float* up [[buffer(9)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
  // gate[i] = gate row(slots[i]) . x and up[i] = up row(slots[i]) . x in one pass over x: gate_mv's shape
  // (ROWS rows a SIMD group, x's block in registers for all of them) with both rows of each slot. With SKIP
  // (ReLU-family gates, whose activation is 0 unless gate > cut) the up rows wait for the gate's sums and are
  // read only for the rows that pass: up is 0 where the gate does not.
  constexpr int ROWS = 4;
  constexpr int V = Row<BITS, GROUP>::VALUES;
  const int lane = int(thread_position_in_grid.x);
  const int first = int(thread_position_in_grid.y) * ROWS;
  const int n = slots_shape[0];
  const int d = x_shape[0];
  const float cut = threshold[0];
  if (first >= n) {
    return;  // uniform across the SIMD group
  }
  size_t offset[ROWS];
  bool valid[ROWS];
  for (int r = 0; r < ROWS; r++) {
    const int slot = first + r < n ? slots[first + r] : -1;
    valid[r] = slot >= 0;
    offset[r] = valid[r] ? size_t(slot) * size_t(gate_w_shape[1]) : 0;
  }
  float g[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
  float u[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
  float xr[V];
  for (int col = lane * V; col < d; col += 32 * V) {
    const float xsum = load_block<V>(x, col, xr);
    for (int r = 0; r < ROWS; r++) {
      if (valid[r]) {
        g[r] += Row<BITS, GROUP>::dot(gate_w + offset[r], d, col, xr, xsum);
        if (!SKIP) {
          u[r] += Row<BITS, GROUP>::dot(up_w + offset[r], d, col, xr, xsum);
        }
      }
    }
  }
  bool need[ROWS];
  for (int r = 0; r < ROWS; r++) {
    g[r] = simd_sum(g[r]);  // every lane has the row's gate: `need` is uniform across the SIMD group
    need[r] = SKIP && valid[r] && g[r] > cut;
  }
  if (SKIP && (need[0] || need[1] || need[2] || need[3])) {
    for (int col = lane * V; col < d; col += 32 * V) {
      const float xsum = load_block<V>(x, col, xr);
      for (int r = 0; r < ROWS; r++) {
        if (need[r]) {
          u[r] += Row<BITS, GROUP>::dot(up_w + offset[r], d, col, xr, xsum);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; r++) {
    const float total = simd_sum(u[r]);
    if (lane == 0 && first + r < n) {
      gate[first + r] = g[r];
      up[first + r] = total;
    }
  }

}

template [[host_name("custom_kernel_lsparse_gather_gate_up__16_0_1_uint32_t_uint32_t_int32_t_float_floatc_float_float")]] [[kernel]] decltype(custom_kernel_lsparse_gather_gate_up__16_0_1_uint32_t_uint32_t_int32_t_float_floatc_float_float<16, 0, 1>) custom_kernel_lsparse_gather_gate_up__16_0_1_uint32_t_uint32_t_int32_t_float_floatc_float_float<16, 0, 1>;

