// Runs an mx.fast.metal_kernel source (header + MLX's generated signature + body) as C++ on
// the CPU. tests/metal_harness.py writes the translation unit: this file, the kernel's header,
// the signature MLX would generate, the body, and a launcher that calls `mtlc::launch`.
//
// Execution model, as on the GPU:
// - the grid is cut into threadgroups exactly as MLX's dispatch_threads does (the edge groups
//   are partial), the groups run one after another in reverse order (no kernel may depend on
//   the order), and the threads of a group run as cooperative fibers (ucontext);
// - `threadgroup` variables are `static`: one copy shared by the threads of the running group;
// - threadgroup_barrier suspends a thread until every live thread of its group arrives;
// - SIMD-group functions (simd_sum, simd_max, ...) run in lockstep: each lane suspends with
//   its operand until every live lane of its SIMD group (32 lanes) has reached the same
//   function, then all get the result. Lanes that returned early are inactive, as on the GPU.
//   A lane waiting at a different function, or a barrier with some threads returned, is
//   divergence the kernels must not rely on: the launch fails with an error naming it.
// What it cannot check: address spaces are erased (one flat memory), so a `constant` input
// pointer (MLX passes inputs of < 8 elements that way) handed to a helper that takes `device`
// would compile here and not on Metal; the kernels keep input pointers out of helper signatures.
// It proves what the source computes, not that the Metal compiler accepts it.
#pragma once

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS keeps the ucontext functions behind it
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};

// ------------------------------------------------------------------ scalar types
typedef _Float16 half;
typedef half float16_t;

struct bfloat16_t {  // storage of MLX's bfloat16_t, round to nearest even like the GPU
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u)
                                            : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};

// ------------------------------------------------------------------ metal:: maths
namespace metal {
inline float exp(float x) { return expf(x); }
inline float log(float x) { return logf(x); }
inline float abs(float x) { return fabsf(x); }
inline float sqrt(float x) { return sqrtf(x); }
inline float rsqrt(float x) { return 1.0f / sqrtf(x); }
inline float tanh(float x) { return tanhf(x); }
inline float fma(float a, float b, float c) { return fmaf(a, b, c); }
template <typename V>
inline V max(V a, V b) { return a < b ? b : a; }
template <typename V>
inline V min(V a, V b) { return b < a ? b : a; }
inline bool isnan(float x) { return x != x; }
inline bool isinf(float x) { return x == INFINITY || x == -INFINITY; }
namespace fast {
using metal::exp;
}
namespace precise {
using metal::exp;
}
}  // namespace metal

// ------------------------------------------------------------------ the fiber runtime
namespace mtlc {

constexpr int kSimdWidth = 32;
constexpr size_t kStack = 64 * 1024;
constexpr int kMaxThreads = 1024;

enum State { READY, AT_BARRIER, AT_SIMD, DONE };

struct Fiber;
typedef void (*Resolver)(Fiber** lanes, int n);

struct Coords {  // every attribute MLX can pass, for one thread
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threadgroups_per_grid;
  uint3 threads_per_grid, grid_size, grid_origin;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup;
  uint thread_execution_width, thread_index_in_quadgroup, quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

struct Fiber {
  ucontext_t ctx;
  State state;
  Coords at;
  const void* operand;  // pending SIMD function: this lane's operand, result slot, resolver
  void* result;
  Resolver resolve;
  const char* op_name;
};

struct Launch {
  void (*thread_main)(const Coords&, void*);
  void* closure;
  Fiber* fibers;
  char* stacks;
  Fiber* current;
  ucontext_t scheduler;
  char error[512];
};

inline Launch* g_launch = nullptr;

inline void suspend() {
  Fiber* f = g_launch->current;
  swapcontext(&f->ctx, &g_launch->scheduler);
}

inline void fiber_entry() {
  Fiber* f = g_launch->current;
  g_launch->thread_main(f->at, g_launch->closure);
  f->state = DONE;  // uc_link returns to the scheduler
}

inline void fail(const char* what, const Fiber& f) {
  if (!g_launch->error[0]) {
    snprintf(g_launch->error, sizeof g_launch->error,
             "%s (threadgroup (%u, %u, %u), thread %u)", what,
             f.at.threadgroup_position_in_grid.x, f.at.threadgroup_position_in_grid.y,
             f.at.threadgroup_position_in_grid.z, f.at.thread_index_in_threadgroup);
  }
}

// Runs one threadgroup of n threads to completion; false on divergence or deadlock.
inline bool run_group(int n) {
  Launch& L = *g_launch;
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    f.state = READY;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = L.stacks + size_t(i) * kStack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &L.scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  for (;;) {
    bool progressed = false;
    for (int i = 0; i < n; ++i) {
      if (L.fibers[i].state == READY) {
        L.current = &L.fibers[i];
        swapcontext(&L.scheduler, &L.fibers[i].ctx);
        progressed = true;
      }
    }
    // SIMD functions: resolve a SIMD group once all its live lanes wait at the same one.
    int live = 0, at_barrier = 0, done = 0;
    for (int s0 = 0; s0 < n; s0 += kSimdWidth) {
      const int s1 = s0 + kSimdWidth < n ? s0 + kSimdWidth : n;
      Fiber* lanes[kSimdWidth];
      int waiting = 0, other = 0;
      for (int i = s0; i < s1; ++i) {
        Fiber& f = L.fibers[i];
        if (f.state == AT_SIMD) {
          lanes[waiting++] = &f;
        } else if (f.state != DONE) {
          ++other;
        }
      }
      if (waiting && other) {
        fail("divergent SIMD-group function: some lanes wait elsewhere", *lanes[0]);
        return false;
      }
      if (waiting) {
        for (int i = 1; i < waiting; ++i) {
          if (lanes[i]->resolve != lanes[0]->resolve) {
            fail("lanes of one SIMD group wait at different SIMD-group functions", *lanes[i]);
            return false;
          }
        }
        lanes[0]->resolve(lanes, waiting);
        for (int i = 0; i < waiting; ++i) lanes[i]->state = READY;
        progressed = true;
      }
    }
    for (int i = 0; i < n; ++i) {
      const State s = L.fibers[i].state;
      live += s != DONE;
      at_barrier += s == AT_BARRIER;
      done += s == DONE;
    }
    if (live == 0) return true;
    if (at_barrier && at_barrier == live) {
      if (done) {
        fail("threadgroup_barrier reached after some threads of the group returned",
             L.fibers[0]);
        return false;
      }
      for (int i = 0; i < n; ++i) L.fibers[i].state = READY;
      progressed = true;
    }
    if (!progressed) {
      fail("deadlock: threads wait at a barrier others never reach", L.fibers[0]);
      return false;
    }
  }
}

inline uint div_up(uint a, uint b) { return (a + b - 1) / b; }

// dispatch_threads(grid, group) as MLX issues it: group = min(threadgroup, grid) per axis.
inline const char* launch(const int64_t grid_[3], const int64_t tg_[3],
                          void (*thread_main)(const Coords&, void*), void* closure) {
  static char error[512];
  const uint3 grid = {uint(grid_[0]), uint(grid_[1]), uint(grid_[2])};
  const uint3 tg = {metal::min(uint(tg_[0]), grid.x), metal::min(uint(tg_[1]), grid.y),
                    metal::min(uint(tg_[2]), grid.z)};
  if (uint64_t(tg.x) * tg.y * tg.z > kMaxThreads) return "threadgroup larger than 1024 threads";
  if (!grid.x || !grid.y || !grid.z) return nullptr;
  Launch L;
  L.thread_main = thread_main;
  L.closure = closure;
  L.fibers = new Fiber[kMaxThreads];
  L.stacks = static_cast<char*>(malloc(kMaxThreads * kStack));
  L.error[0] = 0;
  g_launch = &L;
  const uint3 groups = {div_up(grid.x, tg.x), div_up(grid.y, tg.y), div_up(grid.z, tg.z)};
  const int64_t n_groups = int64_t(groups.x) * groups.y * groups.z;
  bool ok = true;
  for (int64_t gi = n_groups - 1; ok && gi >= 0; --gi) {
    const uint3 gp = {uint(gi % groups.x), uint(gi / groups.x % groups.y),
                      uint(gi / (int64_t(groups.x) * groups.y))};
    // Edge groups are partial (non-uniform threadgroups).
    const uint3 size = {metal::min(tg.x, grid.x - gp.x * tg.x),
                        metal::min(tg.y, grid.y - gp.y * tg.y),
                        metal::min(tg.z, grid.z - gp.z * tg.z)};
    const int n = int(size.x * size.y * size.z);
    for (int i = 0; i < n; ++i) {
      Coords& c = L.fibers[i].at;
      const uint3 p = {uint(i) % size.x, uint(i) / size.x % size.y, uint(i) / (size.x * size.y)};
      c.thread_position_in_threadgroup = p;
      c.threadgroup_position_in_grid = gp;
      c.thread_position_in_grid = {gp.x * tg.x + p.x, gp.y * tg.y + p.y, gp.z * tg.z + p.z};
      c.threads_per_threadgroup = size;
      c.dispatch_threads_per_threadgroup = tg;
      c.threadgroups_per_grid = groups;
      c.threads_per_grid = grid;
      c.grid_size = grid;
      c.grid_origin = {0, 0, 0};
      c.thread_index_in_threadgroup = uint(i);
      c.thread_index_in_simdgroup = uint(i) % kSimdWidth;
      c.simdgroup_index_in_threadgroup = uint(i) / kSimdWidth;
      c.simdgroups_per_threadgroup = div_up(uint(n), kSimdWidth);
      c.dispatch_simdgroups_per_threadgroup = div_up(tg.x * tg.y * tg.z, kSimdWidth);
      c.threads_per_simdgroup = kSimdWidth;
      c.thread_execution_width = kSimdWidth;
      c.thread_index_in_quadgroup = uint(i) % 4;
      c.quadgroup_index_in_threadgroup = uint(i) / 4;
      c.quadgroups_per_threadgroup = div_up(uint(n), 4);
      c.dispatch_quadgroups_per_threadgroup = div_up(tg.x * tg.y * tg.z, 4);
    }
    ok = run_group(n);
  }
  if (!ok) memcpy(error, L.error, sizeof error);
  free(L.stacks);
  delete[] L.fibers;
  g_launch = nullptr;
  return ok ? nullptr : error;
}

// One SIMD-group function call of this lane: suspend with the operand, resume with the result.
template <typename Op, typename V>
void resolve_op(Fiber** lanes, int n) {
  V in[kSimdWidth], out[kSimdWidth];
  for (int i = 0; i < n; ++i) in[i] = *static_cast<const V*>(lanes[i]->operand);
  Op::run(in, out, n);
  for (int i = 0; i < n; ++i) *static_cast<V*>(lanes[i]->result) = out[i];
}

template <typename Op, typename V>
V simd_call(V x) {
  Fiber* f = g_launch->current;
  V r{};
  f->operand = &x;
  f->result = &r;
  f->resolve = &resolve_op<Op, V>;
  f->state = AT_SIMD;
  suspend();
  return r;
}

// simd_sum on a full SIMD group as the hardware lowers it: an ascending xor butterfly.
struct OpSum {
  template <typename V>
  static void run(const V* in, V* out, int n) {
    V v[kSimdWidth];
    for (int i = 0; i < n; ++i) v[i] = in[i];
    if (n == kSimdWidth) {
      for (int d = 1; d < kSimdWidth; d *= 2) {
        V w[kSimdWidth];
        for (int i = 0; i < n; ++i) w[i] = v[i] + v[i ^ d];
        for (int i = 0; i < n; ++i) v[i] = w[i];
      }
      for (int i = 0; i < n; ++i) out[i] = v[i];
    } else {
      V acc = v[0];
      for (int i = 1; i < n; ++i) acc = acc + v[i];
      for (int i = 0; i < n; ++i) out[i] = acc;
    }
  }
};
struct OpMax {
  template <typename V>
  static void run(const V* in, V* out, int n) {
    V m = in[0];
    for (int i = 1; i < n; ++i) m = metal::max(m, in[i]);
    for (int i = 0; i < n; ++i) out[i] = m;
  }
};
struct OpMin {
  template <typename V>
  static void run(const V* in, V* out, int n) {
    V m = in[0];
    for (int i = 1; i < n; ++i) m = metal::min(m, in[i]);
    for (int i = 0; i < n; ++i) out[i] = m;
  }
};
struct OpPrefixExclusiveSum {
  template <typename V>
  static void run(const V* in, V* out, int n) {
    V acc = V(0);
    for (int i = 0; i < n; ++i) {
      out[i] = acc;
      acc = acc + in[i];
    }
  }
};
struct OpPrefixInclusiveSum {
  template <typename V>
  static void run(const V* in, V* out, int n) {
    V acc = V(0);
    for (int i = 0; i < n; ++i) {
      acc = acc + in[i];
      out[i] = acc;
    }
  }
};
struct OpBarrier {
  template <typename V>
  static void run(const V* in, V* out, int n) {
    for (int i = 0; i < n; ++i) out[i] = in[i];
  }
};

}  // namespace mtlc

// ------------------------------------------------------------------ Metal-isms
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

inline void threadgroup_barrier(mem_flags) {
  mtlc::g_launch->current->state = mtlc::AT_BARRIER;
  mtlc::suspend();
}
inline void simdgroup_barrier(mem_flags) { mtlc::simd_call<mtlc::OpBarrier>(0); }

template <typename V>
V simd_sum(V x) { return mtlc::simd_call<mtlc::OpSum>(x); }
template <typename V>
V simd_max(V x) { return mtlc::simd_call<mtlc::OpMax>(x); }
template <typename V>
V simd_min(V x) { return mtlc::simd_call<mtlc::OpMin>(x); }
template <typename V>
V simd_prefix_exclusive_sum(V x) { return mtlc::simd_call<mtlc::OpPrefixExclusiveSum>(x); }
template <typename V>
V simd_prefix_inclusive_sum(V x) { return mtlc::simd_call<mtlc::OpPrefixInclusiveSum>(x); }

namespace metal {
using ::simd_max;
using ::simd_min;
using ::simd_prefix_exclusive_sum;
using ::simd_prefix_inclusive_sum;
using ::simd_sum;
}  // namespace metal

// Address spaces: one flat memory on the CPU. A threadgroup variable is shared by the threads
// of the running group: a static (the groups run one at a time).
#define device
#define constant
#define thread
#define threadgroup static
