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
