// parallel.cpp — a minimal dynamic parallel-for over std::thread.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "core/tuning.h"
#include "cpu/backends.h"

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define KDA_HAS_MXCSR 1
#endif

namespace kda::cpu {

int resolve_num_threads(int requested) {
  if (requested > 0) return requested;
  if (const int n = detail::tuning().num_threads; n > 0) return n;  // KDA_NUM_THREADS
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

ScopedFlushDenormals::ScopedFlushDenormals() {
#ifdef KDA_HAS_MXCSR
  saved_ = _mm_getcsr();
  _mm_setcsr(saved_ | 0x8040u);  // FTZ | DAZ
#endif
}

ScopedFlushDenormals::~ScopedFlushDenormals() {
#ifdef KDA_HAS_MXCSR
  _mm_setcsr(saved_);
#endif
}

void parallel_for(int64_t count, int num_threads, const std::function<void(int64_t, int)>& fn) {
  const int64_t nt = std::min<int64_t>(resolve_num_threads(num_threads), count);
  if (nt <= 1) {
    for (int64_t i = 0; i < count; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&](int id) {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) fn(i, id);
  };
  std::vector<std::thread> threads;
  threads.reserve(nt - 1);
  for (int64_t i = 1; i < nt; ++i) threads.emplace_back(worker, static_cast<int>(i));
  worker(0);
  for (auto& t : threads) t.join();
}

}  // namespace kda::cpu
