// A CPU emulator for the Metal kernels, so that their bodies run, as C++, under AddressSanitizer, UBSan and
// ThreadSanitizer on Linux. One std::thread per Metal thread; threadgroups run one after another, each with
// its threads at once. threadgroup_barrier is a real barrier across the threadgroup; simd_sum and
// simd_prefix_exclusive_sum run in lock-step across the (up to) 32 lanes of a SIMD group, and every lane of
// the group must reach the same call: a SIMD function or a barrier inside divergent control flow is reported
// as an error (exit status 3), as is a barrier some threads of a group skip. Partial threadgroups at the grid's edge are
// made as dispatchThreads makes them, with threads_per_threadgroup giving their real size.
//
// The kernel source is included after this header with `threadgroup` arrays rewritten as static (see
// lsparse/kernels/emulate.py): threadgroups run one at a time, so a static array is one threadgroup's memory.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
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

#include "../../native/half.h"

// Metal's half: stored as IEEE half, read as float.
struct half {
  uint16_t bits;
  operator float() const {
    return lsparse_half_to_float(bits);
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
  std::vector<float> values, before;  // each member's value, and the sum of the values of the lanes before it
  float result = 0.0f;
  const char* what = "";

  void complete() {
    float sum = 0.0f;
    for (size_t i = 0; i < values.size(); i++) {
      before[i] = sum;
      sum += values[i];
    }
    result = sum;
    arrived = 0;
    line = -1;
    ++generation;
    cv.notify_all();
  }

  // The sum of the values of every member, once all have arrived (or, with `prefix`, of the lanes before this).
  float meet(int at, int lane, float value, const char* op, bool prefix = false) {
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
      return prefix ? before[lane] : result;
    }
    if (!cv.wait_for(lock, std::chrono::seconds(5), [&] { return generation != mine; })) {
      fail(std::string(op) + " at line " + std::to_string(at) + ": " + std::to_string(members - arrived) +
           " thread(s) of the group never arrived (divergent control flow)");
    }
    return prefix ? before[lane] : result;
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
        barrier.before.assign(count, 0.0f);
        std::vector<Rendezvous> simd(simds);
        for (int s = 0; s < simds; s++) {
          simd[s].members = std::min(32, count - 32 * s);
          simd[s].values.assign(32, 0.0f);
          simd[s].before.assign(32, 0.0f);
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

// Values travel as float: exact for the integers the kernels sum (counts below 2^24).
template <typename T>
inline T simd_sum_at(T x, int line) {
  emu::current->simd_ops++;
  return T(emu::current->simd->meet(line, emu::current->lane, float(x), "simd_sum"));
}

template <typename T>
inline T simd_prefix_exclusive_sum_at(T x, int line) {
  emu::current->simd_ops++;
  return T(emu::current->simd->meet(line, emu::current->lane, float(x), "simd_prefix_exclusive_sum", true));
}

using std::exp;
using std::fabs;
using std::min;
}  // namespace metal

// Metal's address spaces mean nothing here; defined last, as `thread` would break std::thread above.
#define kernel
#define device
#define constant
#define threadgroup
#define thread

#define threadgroup_barrier(flags) threadgroup_barrier_at(__LINE__)
#define simd_sum(x) simd_sum_at((x), __LINE__)
#define simd_prefix_exclusive_sum(x) simd_prefix_exclusive_sum_at((x), __LINE__)
