  // out[j] = sum over i of a[i] * row(slots[i])[j]: the down projection over the slots of a layer's neuron
  // cache, whose rows are the active neurons' down columns. Each thread owns one word of the rows (8 outputs
  // at 4 bits, 4 at 8, 2 at fp16): grid (d / outputs per word). Slots and coefficients pass through
  // threadgroup memory a tile at a time, read once per threadgroup instead of once per thread.
  constexpr int TILE = 64;
  threadgroup int tile_slot[TILE];
  threadgroup float tile_a[TILE];
  const int n = slots_shape[0];
  const int d = Row<BITS, GROUP>::width(w_shape[1]);
  const int per = Row<BITS, GROUP>::per_word();
  const int words = d / per;
  const int word = int(thread_position_in_grid.x);
  const uint t = thread_position_in_threadgroup.x;
  const uint threads = threads_per_threadgroup.x;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int base = 0; base < n; base += TILE) {
    for (uint k = t; k < uint(TILE); k += threads) {
      const int i = base + int(k);
      tile_slot[k] = i < n ? slots[i] : -1;
      tile_a[k] = i < n ? a[i] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (word < words) {
      for (int k = 0; k < TILE; k++) {
        if (tile_slot[k] >= 0 && tile_a[k] != 0.0f) {
          Row<BITS, GROUP>::axpy(w + size_t(tile_slot[k]) * size_t(w_shape[1]), word, d, tile_a[k], acc);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next tile overwrites what others may still read
  }
  if (word < words) {
    for (int k = 0; k < per; k++) {
      out[word * per + k] = acc[k];
    }
  }
