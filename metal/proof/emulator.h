// A CPU emulator for the Metal kernels, so that their bodies run, as C++, under AddressSanitizer, UBSan and
// ThreadSanitizer on Linux. One std::thread per Metal thread; threadgroups run one after another, each with
// its threads at once. threadgroup_barrier is a real barrier across the threadgroup; simd_sum and
// simd_shuffle run in lock-step across the (up to) 32 lanes of a SIMD group, and every lane of the group must
// reach the same call: a SIMD function or a barrier inside divergent control flow is reported as an error
// (exit status 3), as is a barrier some threads of a group skip. Partial threadgroups at the grid's edge are
// made as dispatchThreads makes them, with threads_per_threadgroup giving their real size.
//
// The kernel source is included after this header with `threadgroup` arrays rewritten as static (see
// lsparse/kernels/emulate.py): threadgroups run one at a time, so a static array is one threadgroup's memory.
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// IEEE half precision, converted in software (clang's __fp16 needs a runtime library the system lacks).
struct half {
  uint16_t bits;
  operator float() const {
    const uint32_t sign = uint32_t(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;
    uint32_t out;
    if (exponent == 0x1F) {
      out = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
      out = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mantissa;
      do {
        m <<= 1;
        e++;
      } while (!(m & 0x400u));
      out = sign | uint32_t(112 - e) << 23 | ((m & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &out, sizeof f);
    return f;
  }
};
typedef half float16_t;
typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};

namespace emu {

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "EMULATOR ERROR: %s\n", what.c_str());
  std::fflush(stderr);
  std::_Exit(3);
}

// A meeting point for a set of threads that must all arrive at the same call (named by its source line).
// A thread that finishes leaves the set; waiting longer than a few seconds means some thread never comes.
struct Rendezvous {
  std::mutex m;
  std::condition_variable cv;
  int members = 0, arrived = 0, line = -1;
  long generation = 0;
  std::vector<float> values;
  float result = 0.0f;
  const char* what = "";

  void complete() {
    float sum = 0.0f;
    for (float v : values) sum += v;
    result = sum;
    arrived = 0;
    line = -1;
    ++generation;
    cv.notify_all();
  }

  float meet(int at, int lane, float value, const char* op) {
    std::unique_lock<std::mutex> lock(m);
    if (arrived == 0) {
      line = at;
      what = op;
      values.assign(values.size(), 0.0f);
    } else if (line != at) {
      fail(std::string(op) + " at line " + std::to_string(at) + " while other threads of the group wait at " +
           what + " on line " + std::to_string(line) + ": divergent control flow");
    }
    values[lane] = value;
    long mine = generation;
    if (++arrived == members) {
      complete();
      return result;
    }
    if (!cv.wait_for(lock, std::chrono::seconds(5), [&] { return generation != mine; })) {
      fail(std::string(op) + " at line " + std::to_string(at) + ": " + std::to_string(members - arrived) +
           " thread(s) of the group never arrived (divergent control flow)");
    }
    return result;
  }

  void leave() {
    std::unique_lock<std::mutex> lock(m);
    --members;
    if (arrived > 0 && arrived == members) complete();
  }
};

struct Context {
  Rendezvous* group;
  Rendezvous* simd;
  int lane, index_in_group;
  long barriers = 0, simd_ops = 0;
};

inline thread_local Context* current = nullptr;

struct Dims {
  uint x, y, z;
};

inline Dims dims(const char* text) {
  Dims d{1, 1, 1};
  std::sscanf(text, "%u,%u,%u", &d.x, &d.y, &d.z);
  return d;
}

struct Thread {
  uint3 position_in_grid, position_in_threadgroup, threadgroup_position, threads_per_threadgroup;
  uint simdgroup_index, index_in_simdgroup;
};

// Every threadgroup of the grid in turn; within one, a thread per Metal thread, run at once.
inline void run(Dims grid, Dims group, const std::function<void(const Thread&)>& body) {
  for (uint gz = 0; gz * group.z < grid.z; gz++)
    for (uint gy = 0; gy * group.y < grid.y; gy++)
      for (uint gx = 0; gx * group.x < grid.x; gx++) {
        const Dims size{std::min(group.x, grid.x - gx * group.x), std::min(group.y, grid.y - gy * group.y),
                        std::min(group.z, grid.z - gz * group.z)};
        const int count = int(size.x * size.y * size.z);
        const int simds = (count + 31) / 32;
        Rendezvous barrier;
        barrier.members = count;
        barrier.values.assign(count, 0.0f);
        std::vector<Rendezvous> simd(simds);
        for (int s = 0; s < simds; s++) {
          simd[s].members = std::min(32, count - 32 * s);
          simd[s].values.assign(32, 0.0f);
        }
        std::vector<Context> contexts(count);
        std::vector<std::thread> threads;
        for (int i = 0; i < count; i++) {
          const uint lx = i % size.x, ly = (i / size.x) % size.y, lz = i / (size.x * size.y);
          Thread t{{gx * group.x + lx, gy * group.y + ly, gz * group.z + lz}, {lx, ly, lz}, {gx, gy, gz},
                   {size.x, size.y, size.z}, uint(i / 32), uint(i % 32)};
          contexts[i] = Context{&barrier, &simd[i / 32], i % 32, i};
          threads.emplace_back([&, t, i] {
            current = &contexts[i];
            body(t);
            current->simd->leave();
            current->group->leave();
          });
        }
        for (auto& th : threads) th.join();
        for (int i = 1; i < count; i++) {
          if (contexts[i].barriers != contexts[0].barriers)
            fail("threads of one threadgroup passed different numbers of threadgroup barriers");
          if (i % 32 && contexts[i].simd_ops != contexts[i - 1].simd_ops)
            fail("lanes of one SIMD group made different numbers of SIMD-group calls");
        }
      }
}

template <typename T>
struct Buffer {
  std::vector<T> data;
  std::vector<int> shape;

  static Buffer load(const std::string& dir, const std::string& name) {
    Buffer b;
    std::ifstream s(dir + "/" + name + ".shape");
    for (int v; s >> v;) b.shape.push_back(v);
    size_t n = 1;
    for (int v : b.shape) n *= size_t(v);
    b.data.resize(n);
    std::ifstream f(dir + "/" + name + ".bin", std::ios::binary);
    if (!f.read(reinterpret_cast<char*>(b.data.data()), std::streamsize(n * sizeof(T)))) fail("cannot read " + name);
    b.shape.shrink_to_fit();
    b.data.shrink_to_fit();
    return b;
  }

  void save(const std::string& dir, const std::string& name) const {
    std::ofstream f(dir + "/" + name + ".out", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size() * sizeof(T)));
  }
};

}  // namespace emu

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

inline void threadgroup_barrier_at(int line) {
  emu::current->barriers++;
  emu::current->group->meet(line, emu::current->index_in_group, 0.0f, "threadgroup_barrier");
}

inline float simd_sum_at(float x, int line) {
  emu::current->simd_ops++;
  return emu::current->simd->meet(line, emu::current->lane, x, "simd_sum");
}
}  // namespace metal

// Metal's address spaces mean nothing here; defined last, as `thread` would break std::thread above.
#define kernel
#define device
#define constant
#define threadgroup
#define thread

#define threadgroup_barrier(flags) threadgroup_barrier_at(__LINE__)
#define simd_sum(x) simd_sum_at((x), __LINE__)
