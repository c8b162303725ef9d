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
