  // y[i] = row(slots[i]) . x over the slots of a layer's neuron cache (the up rows of the active neurons, or
  // the gate's). As MLX's qmv_fast: a SIMD group takes ROWS rows and each lane holds a block of x in registers
  // for all of them, so x is read once per ROWS rows; grid (32, SIMD groups), threadgroup (32, 2). Slots of -1
  // (padding to a multiple of 8) give 0.
  constexpr int ROWS = 4;
  constexpr int V = Row<BITS, GROUP>::VALUES;
  const int lane = int(thread_position_in_grid.x);
  const int first = int(thread_position_in_grid.y) * ROWS;
  const int n = slots_shape[0];
  const int d = x_shape[0];
  if (first >= n) {
    return;  // the 32 lanes of a SIMD group share `first`: a uniform branch
  }
  const device uint32_t* row[ROWS];
  for (int r = 0; r < ROWS; r++) {
    const int slot = first + r < n ? slots[first + r] : -1;
    row[r] = slot >= 0 ? w + size_t(slot) * size_t(w_shape[1]) : nullptr;
  }
  float acc[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
  float xr[V];
  for (int col = lane * V; col < d; col += 32 * V) {
    const float xsum = load_block<V>(x, col, xr);
    for (int r = 0; r < ROWS; r++) {
      if (row[r] != nullptr) {
        acc[r] += Row<BITS, GROUP>::dot(row[r], d, col, xr, xsum);
      }
    }
  }
  for (int r = 0; r < ROWS; r++) {
    const float total = simd_sum(acc[r]);
    if (lane == 0 && first + r < n) {
      y[first + r] = total;
    }
  }
