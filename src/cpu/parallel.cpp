// parallel.cpp — a minimal dynamic parallel-for over std::thread.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
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

int worker_count(int requested, int64_t tasks) {
  const int64_t n = std::min<int64_t>(resolve_num_threads(requested), kMaxNumThreads);
  return static_cast<int>(std::max<int64_t>(std::min<int64_t>(n, tasks), 1));
}

namespace {
std::atomic<int> g_thread_limit{-1};  // testing::set_thread_creation_limit
}  // namespace

namespace testing {
void set_thread_creation_limit(int limit) { g_thread_limit.store(limit); }
}  // namespace testing

// Every worker thread is created before any of them runs a task: when the system refuses one,
// the others are released without work and joined, and the call returns an error with nothing
// written. An exception thrown by fn stops the handing out of work and is rethrown here.
Status parallel_for(int64_t count, int num_threads, const std::function<void(int64_t, int)>& fn) {
  const int nt = worker_count(num_threads, count);
  if (nt <= 1) {
    for (int64_t i = 0; i < count; ++i) fn(i, 0);
    return Status::Ok();
  }
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  enum class Start { kWait, kRun, kAbort } start = Start::kWait;
  std::exception_ptr error;
  auto work = [&](int id) {
    try {
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) fn(i, id);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      next.store(count);
    }
  };
  auto worker = [&](int id) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return start != Start::kWait; });
      if (start == Start::kAbort) return;
    }
    work(id);
  };
  std::vector<std::thread> threads;
  threads.reserve(nt - 1);
  std::string failure;
  for (int i = 1; i < nt && failure.empty(); ++i) {
    try {
      const int limit = g_thread_limit.load();
      if (limit >= 0 && i > limit)
        throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
      threads.emplace_back(worker, i);
    } catch (const std::system_error& e) {
      failure = "CPU backend: could not create worker thread " + std::to_string(i) + " of " +
                std::to_string(nt - 1) + " (" + e.what() +
                "); a smaller exec.num_threads may succeed";
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    start = failure.empty() ? Start::kRun : Start::kAbort;
  }
  cv.notify_all();
  if (failure.empty()) work(0);
  for (auto& t : threads) t.join();
  if (!failure.empty()) return {StatusCode::kInternal, failure};
  if (error) std::rethrow_exception(error);
  return Status::Ok();
}

}  // namespace kda::cpu
