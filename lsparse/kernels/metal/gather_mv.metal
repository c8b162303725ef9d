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
