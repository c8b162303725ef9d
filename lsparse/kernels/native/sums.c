// Each row's checksum, as lsparse/image/bundles.py row_sums defines it: the sum of its 32-bit little-endian
// words, word i weighted by 2i + 1, modulo 2^64. Odd weights make any change to one word change the sum;
// the runtime checks each bundle the first time it reads it. Built by lsparse/kernels/native.py.
#include <stdint.h>
#include <string.h>

void lsparse_row_sums(const uint8_t* rows, int64_t n_rows, int64_t row_bytes, uint64_t* out) {
    int64_t words = row_bytes / 4;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t* row = rows + r * row_bytes;
        uint64_t sum = 0;
        for (int64_t i = 0; i < words; i++) {
            uint32_t w;
            memcpy(&w, row + 4 * i, 4);
            sum += (uint64_t)w * (uint64_t)(2 * i + 1);
        }
        out[r] = sum;
    }
}

// Streaming read bandwidth for reference: the sum of n 64-bit words (the caller times it), on `threads`.
uint64_t lsparse_stream_sum(const uint64_t* words, int64_t n, int threads) {
  uint64_t total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
  for (int64_t i = 0; i < n; i++) total += words[i];
  return total;
}
