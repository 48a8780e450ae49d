// fibers.h — the thread engine of the CPU emulation (engine.h, wgmma_selftest.cpp): every CUDA
// thread of a block is a ucontext fiber, scheduled round-robin on one OS thread; barriers and
// warp collectives yield until all participants arrive. Include after the shim's cuda_runtime.h.
#pragma once
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

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
};
static ucontext_t sched_ctx;
static std::vector<Fiber>* fibers;
static int cur = -1;
static int block_arrived = 0;
static long block_gen = 0;
static int nthreads = 0;
static void yield() { swapcontext(&(*fibers)[cur].ctx, &sched_ctx); }
void yield_fiber() { yield(); }
void warp_sync() {
  WarpCtx* w = warp_ctx;
  const long g = w->gen;
  if (++w->arrived == 32) {
    w->arrived = 0;
    ++w->gen;
    return;
  }
  while (w->gen == g) yield();
}
void block_sync() {
  const long g = block_gen;
  if (++block_arrived == nthreads) {
    block_arrived = 0;
    ++block_gen;
    return;
  }
  while (block_gen == g) yield();
}
static int named_arrived[16];
static long named_gen[16];
void named_sync(int id, int count) {  // bar.sync id, count: the first `count` arrivals release
  if (id < 0 || id > 15 || count % 32 != 0) {
    std::fprintf(stderr, "EMU: bad named barrier\n");
    std::abort();
  }
  const long g = named_gen[id];
  if (++named_arrived[id] == count) {
    named_arrived[id] = 0;
    ++named_gen[id];
    return;
  }
  while (named_gen[id] == g) yield();
}
static std::function<void()> body;
static void trampoline() {
  body();
  (*fibers)[cur].done = true;
  swapcontext(&(*fibers)[cur].ctx, &sched_ctx);
}
// Runs `fn` as block `block` of `grid` with `threads` threads (threadIdx etc. set per fiber).
static void run_block(int threads, unsigned block, unsigned grid, std::function<void()> fn) {
  body = std::move(fn);
  std::vector<Fiber> fib(threads);
  std::vector<WarpCtx> wc((threads + 31) / 32);
  fibers = &fib;
  nthreads = threads;
  block_arrived = 0;
  for (int t = 0; t < threads; ++t) {
    fib[t].stack.resize(1 << 18);
    getcontext(&fib[t].ctx);
    fib[t].ctx.uc_stack.ss_sp = fib[t].stack.data();
    fib[t].ctx.uc_stack.ss_size = fib[t].stack.size();
    fib[t].ctx.uc_link = nullptr;
    makecontext(&fib[t].ctx, trampoline, 0);
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
      warp_ctx = &wc[t / 32];
      lane_id = t % 32;
      swapcontext(&sched_ctx, &fib[t].ctx);
    }
  }
}
}  // namespace emu
