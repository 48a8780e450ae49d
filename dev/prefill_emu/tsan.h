// tsan.h — the emulator's ThreadSanitizer mode (KDA_EMU_TSAN=ON: -fsanitize=thread -DEMU_TSAN;
// every function here is a no-op otherwise). Each CUDA thread's fiber is a TSan fiber, switched
// without synchronization, so TSan sees the threads of a block as concurrent and reports every
// pair of shared- or global-memory accesses that no synchronization of the CUDA memory model
// orders. The synchronizations, modelled after the PTX memory model (release / acquire):
//   * __syncthreads, bar.sync (named barriers), __syncwarp: every participant's accesses before the
//     barrier happen before every participant's accesses after it. Warp collectives (shuffles,
//     ballot, mma.sync, ldmatrix, stmatrix, wgmma's rendezvous) order nothing.
//   * mbarriers: an arrival (and a bulk copy's completion of its bytes) releases into the phase
//     it belongs to; a wait that returns acquires the phase of its parity.
//   * atomics on the same address (relaxed) with fences (__threadfence_block): a fence followed by
//     an atomic write releases what came before the fence; an atomic read followed by a fence
//     acquires what the writes it read from (and their release sequence) released. The atomic
//     accesses themselves are not checked against plain accesses of their address: PTX orders an
//     atomic write before whatever follows, in program order, a read that observed it
//     (observation order), which C++ and so TSan have no counterpart for (a counter reset by the
//     last of its atomic increments is race-free in PTX, a race in C++).
//   * copies and products that run asynchronously are checked over their whole window: a cp.async
//     writes at issue and again when its group is waited for, a wgmma reads its shared-memory
//     operand at issue and again when its group is waited for, a bulk copy writes at issue (its
//     completion, the earliest point any waiter may read, follows at once).
// Blocks run one after another, each started after the previous one ended (so races between
// blocks of one grid are not modelled) and launches are ordered as kernel boundaries are. The
// generic and async proxies are one memory here: proxy fences are not checked.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

#ifdef EMU_TSAN
extern "C" {
// (As GCC declares them among its built-ins under -fsanitize=thread.)
void __tsan_read_range(void* addr, long size);
void __tsan_write_range(void* addr, long size);
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void AnnotateBenignRaceSized(const char* f, int l, const volatile void* mem, size_t size,
                             const char* desc);
void AnnotateIgnoreReadsBegin(const char* f, int l);
void AnnotateIgnoreReadsEnd(const char* f, int l);
void AnnotateIgnoreWritesBegin(const char* f, int l);
void AnnotateIgnoreWritesEnd(const char* f, int l);
}
#endif

namespace emu::tsan {
#ifdef EMU_TSAN
inline constexpr bool kOn = true;
inline void release(const void* tok) { __tsan_release(const_cast<void*>(tok)); }
inline void acquire(const void* tok) { __tsan_acquire(const_cast<void*>(tok)); }
inline void* current() { return __tsan_get_current_fiber(); }
inline void* create() { return __tsan_create_fiber(0); }
inline void destroy(void* f) { __tsan_destroy_fiber(f); }
inline void switch_to(void* f) { __tsan_switch_to_fiber(f, 1u /* no synchronization */); }
inline void reads(const void* p, size_t n) {
  __tsan_read_range(const_cast<void*>(p), static_cast<long>(n));
}
inline void writes(const void* p, size_t n) {
  __tsan_write_range(const_cast<void*>(p), static_cast<long>(n));
}
// Memory of the engine itself (the scheduler's per-thread globals, barrier counters, a warp's
// exchange slots): its unordered accesses are the emulation's, not the kernel's.
inline void benign(const void* p, size_t n) {
  AnnotateBenignRaceSized(__FILE__, __LINE__, p, n, "emu");
}
// Within an Ignore scope this fiber's accesses are not checked (an mbarrier's bookkeeping).
struct Ignore {
  Ignore() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~Ignore() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
};
#else
inline constexpr bool kOn = false;
inline void release(const void*) {}
inline void acquire(const void*) {}
inline void* current() { return nullptr; }
inline void* create() { return nullptr; }
inline void destroy(void*) {}
inline void switch_to(void*) {}
inline void reads(const void*, size_t) {}
inline void writes(const void*, size_t) {}
inline void benign(const void*, size_t) {}
struct Ignore {};
#endif

// A barrier's synchronization objects, one per generation modulo 4 (a generation's waiters
// leave before the generation after the next can complete).
struct BarrierTokens {
  char gen[4];
  void arrive(long g) const { release(&gen[g & 3]); }
  void leave(long g) const { acquire(&gen[g & 3]); }
};

// One fiber's asynchronous operations of one kind (cp.async writes, wgmma operand reads): the
// ranges touched since the last commit, and the committed groups not yet waited for.
struct AsyncGroups {
  std::vector<std::pair<const void*, uint32_t>> open;
  std::deque<std::vector<std::pair<const void*, uint32_t>>> groups;
  void commit() {
    groups.push_back(std::move(open));
    open.clear();
  }
  // The groups older than the newest `pending` are complete: `touch` each of their ranges.
  template <typename Touch>
  void wait(int pending, Touch touch) {
    while (static_cast<int>(groups.size()) > pending) {
      for (const auto& r : groups.front()) touch(r.first, r.second);
      groups.pop_front();
    }
  }
};

// What one fiber (CUDA thread) carries for the model: its asynchronous groups, the atomics it read
// since its last fence, its last fence.
struct FiberModel {
  AsyncGroups cp, wg;
  std::vector<std::pair<const void*, size_t>> atomics_read;  // (address, its releases then)
  const char* fence = nullptr;                               // the token of the last fence
};

// Per block: every fiber's model, the fences' tokens, and for each atomic location the tokens of
// the fences that preceded the atomic writes to it.
struct BlockModel {
  std::vector<FiberModel> fibers;
  std::deque<char> fence_tokens;
  std::unordered_map<const void*, std::vector<const char*>> released;
  void reset(int threads) {
    fibers.assign(threads, FiberModel{});
    fence_tokens.clear();
    released.clear();
  }
};
inline BlockModel& block() {
  static BlockModel m;
  return m;
}
int current_thread();  // the running fiber's thread index (fibers.h)
inline FiberModel& me() { return block().fibers[current_thread()]; }

// cp.async: a 16-byte write into shared memory (at issue, by the caller's memcpy) that lands again
// when its group is waited for (cp.async.wait_all: the uncommitted copies too).
inline void cp_async_issued(const void* dst) {
  if (kOn) me().cp.open.emplace_back(dst, 16u);
}
inline void cp_async_committed() {
  if (kOn) me().cp.commit();
}
inline void cp_async_waited(int pending) {
  if (!kOn) return;
  AsyncGroups& g = me().cp;
  if (pending == 0 && !g.open.empty()) g.commit();
  g.wait(pending, writes);
}
// wgmma: each shared-memory operand element read at issue is read again when its group is
// waited for.
inline void wgmma_read(const void* p, uint32_t n) {
  if (kOn) me().wg.open.emplace_back(p, n);
}
inline void wgmma_committed() {
  if (kOn) me().wg.commit();
}
inline void wgmma_waited(int pending) {
  if (kOn) me().wg.wait(pending, reads);
}
// Atomics and fences (see the header comment).
// An atomic read-modify-write of `p` (every atomic the kernels use is one).
inline void atomic_rmw(const void* p) {
  if (!kOn) return;
  const Ignore ig;
  FiberModel& f = me();
  auto& rel = block().released[p];
  f.atomics_read.emplace_back(p, rel.size());
  if (f.fence != nullptr) rel.push_back(f.fence);
}
inline void fence() {
  if (!kOn) return;
  FiberModel& f = me();
  {
    const Ignore ig;
    for (const auto& [p, n] : f.atomics_read) {
      const auto& rel = block().released[p];
      for (size_t i = 0; i < n && i < rel.size(); ++i) acquire(rel[i]);
    }
    f.atomics_read.clear();
    f.fence = &block().fence_tokens.emplace_back();
  }
  release(f.fence);
}
}  // namespace emu::tsan
