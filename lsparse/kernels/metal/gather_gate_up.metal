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
