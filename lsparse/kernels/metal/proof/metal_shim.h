// Just enough of the Metal Shading Language for `clang++ -fsyntax-only` on Linux: Metal's address spaces as
// clang address spaces, so that device memory passed where a plain (thread) pointer is expected is an error,
// as it is in Metal; and declarations of the built-ins the kernels use. Attributes such as [[buffer(0)]] are
// unknown to clang and ignored (-Wno-unknown-attributes). Two things of Metal's have no C++ form, so the checker
// (lsparse/kernels/proof.py) rewrites them first: threadgroup arrays declared in a kernel become static (clang
// refuses automatic variables in an address space), and the attribute lists of the explicit instantiation go.
#pragma once
#include <cstddef>
#include <cstdint>

#define kernel
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread

typedef __fp16 half;  // clang's storage-only half: arithmetic is done in float, as the kernels do
typedef __fp16 float16_t;
typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags flags);
template <typename T>
T simd_sum(T x);  // Metal's SIMD-group functions take any scalar type and return the same
template <typename T>
T simd_prefix_exclusive_sum(T x);
float simd_shuffle(float x, uint lane);
float simd_shuffle_down(float x, uint delta);
float exp(float x);
float fabs(float x);
int min(int a, int b);
}  // namespace metal
