// fibers.h — the thread engine of the CPU emulation (engine.h, wgmma_selftest.cpp): every CUDA
// thread of a block is a ucontext fiber, scheduled round-robin on one OS thread; barriers and
// warp collectives yield until all participants arrive. Include after the shim's cuda_runtime.h.
// In the ThreadSanitizer mode (tsan.h) each fiber is also a TSan fiber and the barriers are its
// synchronizations.
#pragma once
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "tsan.h"

namespace emu {
dim3 threadIdx_, blockIdx_, blockDim_, gridDim_;
uint8_t* smem_base;
size_t smem_size;
WarpCtx* warp_ctx;
int lane_id;
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  void* tsan = nullptr;  // its TSan fiber (tsan.h)
};
constexpr int kMaxThreads = 1024;
static ucontext_t sched_ctx;
static void* sched_tsan;               // the scheduler's TSan fiber
static Fiber fiber_pool[kMaxThreads];  // the block's threads (stacks kept between blocks)
static int cur = -1;
static int block_arrived = 0;
static long block_gen = 0;
static int nthreads = 0;
static tsan::BarrierTokens block_tokens, named_tokens[16], warp_tokens[32];
static char block_end;  // every fiber releases here at its end; the scheduler acquires
static WarpCtx warp_ctxs[kMaxThreads / 32];
static void yield() {
  Fiber& me = fiber_pool[cur];
  tsan::switch_to(sched_tsan);
  swapcontext(&me.ctx, &sched_ctx);
}
void yield_fiber() { yield(); }
// Waits until `count` participants have arrived (the last one starts the next generation); with
// `tok`, also a memory barrier among them (block, named and warp barriers; a warp collective's
// rendezvous passes none).
static void rendezvous(int& arrived, long& gen, int count, const tsan::BarrierTokens* tok) {
  const long g = gen;
  if (tok) tok->arrive(g);
  if (++arrived == count) {
    arrived = 0;
    ++gen;
  } else {
    while (gen == g) yield();
  }
  if (tok) tok->leave(g);
}
void warp_sync() {
  rendezvous(warp_ctx->arrived, warp_ctx->gen, 32, &warp_tokens[warp_ctx - warp_ctxs]);
}
void warp_collective() { rendezvous(warp_ctx->arrived, warp_ctx->gen, 32, nullptr); }
void block_sync() { rendezvous(block_arrived, block_gen, nthreads, &block_tokens); }
static int named_arrived[16];
static long named_gen[16];
void named_sync(int id, int count) {  // bar.sync id, count: the first `count` arrivals release
  if (id < 0 || id > 15 || count % 32 != 0) {
    std::fprintf(stderr, "EMU: bad named barrier\n");
    std::abort();
  }
  rendezvous(named_arrived[id], named_gen[id], count, &named_tokens[id]);
}
static std::function<void()> body;
static void trampoline() {
  body();
  Fiber& me = fiber_pool[cur];
  me.done = true;
  tsan::release(&block_end);  // after the fiber's last access
  tsan::switch_to(sched_tsan);
  swapcontext(&me.ctx, &sched_ctx);
}
// The engine's own memory, read and written by every fiber without order (TSan: not checked).
static void mark_engine_memory() {
  static bool marked = false;
  if (marked) return;
  marked = true;
  tsan::benign(&threadIdx_, sizeof(dim3));
  tsan::benign(&blockIdx_, sizeof(dim3));
  tsan::benign(&blockDim_, sizeof(dim3));
  tsan::benign(&gridDim_, sizeof(dim3));
  tsan::benign(&warp_ctx, sizeof(warp_ctx));
  tsan::benign(&lane_id, sizeof(lane_id));
  tsan::benign(&cur, sizeof(cur));
  tsan::benign(&sched_tsan, sizeof(sched_tsan));
  tsan::benign(fiber_pool, sizeof(fiber_pool));
  tsan::benign(&block_arrived, sizeof(block_arrived));
  tsan::benign(&block_gen, sizeof(block_gen));
  tsan::benign(named_arrived, sizeof(named_arrived));
  tsan::benign(named_gen, sizeof(named_gen));
  tsan::benign(warp_ctxs, sizeof(warp_ctxs));
}
// Runs `fn` as block `block` of `grid` with `threads` threads (threadIdx etc. set per fiber).
static void run_block(int threads, unsigned block, unsigned grid, std::function<void()> fn) {
  if (threads < 1 || threads > kMaxThreads) {
    std::fprintf(stderr, "EMU: block of %d threads\n", threads);
    std::abort();
  }
  mark_engine_memory();
  body = std::move(fn);
  Fiber* fib = fiber_pool;
  for (int w = 0; w < (threads + 31) / 32; ++w) warp_ctxs[w] = WarpCtx{};
  nthreads = threads;
  block_arrived = 0;
  if (tsan::kOn) tsan::block().reset(threads);
  sched_tsan = tsan::current();
  for (int t = 0; t < threads; ++t) {
    fib[t].done = false;
    if (fib[t].stack.empty()) fib[t].stack.resize(1 << 18);
    getcontext(&fib[t].ctx);
    fib[t].ctx.uc_stack.ss_sp = fib[t].stack.data();
    fib[t].ctx.uc_stack.ss_size = fib[t].stack.size();
    fib[t].ctx.uc_link = nullptr;
    makecontext(&fib[t].ctx, trampoline, 0);
    fib[t].tsan = tsan::create();  // after everything the block reads from the host
  }
  for (bool any = true; any;) {
    any = false;
    for (int t = 0; t < threads; ++t) {
      if (fib[t].done) continue;
      any = true;
      cur = t;
      threadIdx_.x = t;
      blockIdx_.x = block;
      blockDim_.x = threads;
      gridDim_.x = grid;
      warp_ctx = &warp_ctxs[t / 32];
      lane_id = t % 32;
      tsan::switch_to(fib[t].tsan);
      swapcontext(&sched_ctx, &fib[t].ctx);
    }
  }
  tsan::acquire(&block_end);  // the block's end, before the next block or the host reads
  for (int t = 0; t < threads; ++t) tsan::destroy(fib[t].tsan);
}
}  // namespace emu
namespace emu::tsan {
int current_thread() { return emu::cur; }
}  // namespace emu::tsan
