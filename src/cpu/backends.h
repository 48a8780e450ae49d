// backends.h — entry points of the two CPU backends (inputs already validated).
#pragma once

#include <cstdint>
#include <functional>

#include "core/problem.h"

namespace kda::cpu {

// fp64 token-by-token reference (reference.cpp).
void reference_prefill(const detail::PrefillProblem& pr);
void reference_decode(const detail::DecodeProblem& pr);
// Analytic fp64 backward of the prefill (reference_backward.cpp).
void reference_prefill_backward(const detail::PrefillBackwardProblem& bp);

// Fast fp32 backend (prefill_chunked.cpp, decode_fast.cpp): threads over (sequence, value head).
// An error (threads that could not be created) leaves every output untouched.
Status fast_prefill(const detail::PrefillProblem& pr, int num_threads);
Status fast_decode(const detail::DecodeProblem& pr, int num_threads);

// The slot rules of core/index_rules.h on host tensors; rules::kNoSlot (-1) means none.
// Read slot of decode row n of T_n = len tokens (kNoSlot: a padding row).
int64_t decode_read_slot(const detail::DecodeProblem& pr, int64_t n, int64_t len);
// Slot receiving the state after token t of row n with [N, Tmax] indices.
int64_t decode_token_slot(const detail::DecodeProblem& pr, int64_t n, int64_t t);
// Pool slot of prefill sequence n (kNoSlot without a pool or for a slot outside [0, P)).
inline int64_t prefill_pool_slot(const detail::PrefillProblem& pr, int64_t n) {
  if (!pr.state_pool.present()) return rules::kNoSlot;
  return rules::pool_slot(detail::load_index(pr.state_indices, n), pr.state_pool.shape[0]);
}

// Runs fn(i, worker) for i in [0, count) on worker_count(num_threads, count) threads; work is
// handed out dynamically; worker in [0, threads used). When a thread cannot be created, no fn
// runs and the result is a kInternal error naming it; an exception of fn is rethrown.
Status parallel_for(int64_t count, int num_threads, const std::function<void(int64_t, int)>& fn);
// Threads requested: num_threads > 0, else $KDA_NUM_THREADS, else all hardware threads.
int resolve_num_threads(int requested);
// Threads a call of `tasks` tasks runs on: resolve_num_threads, at most kMaxNumThreads and tasks,
// at least 1.
int worker_count(int requested, int64_t tasks);

namespace testing {
// Thread creation in parallel_for fails (std::system_error, as when the system refuses) for
// every worker thread after the first `limit` ones of a call; a negative limit (the default)
// lifts it.
void set_thread_creation_limit(int limit);
}  // namespace testing

// Flushes denormal results and operands to zero on this thread while alive (x86 MXCSR), and
// restores the caller's mode afterwards. Contributions below 1e-38 are far under fp32 rounding of
// the results; without it, strongly decaying gates make the fp32 kernels 10x slower.
class ScopedFlushDenormals {
 public:
  ScopedFlushDenormals();
  ~ScopedFlushDenormals();
  ScopedFlushDenormals(const ScopedFlushDenormals&) = delete;
  ScopedFlushDenormals& operator=(const ScopedFlushDenormals&) = delete;

 private:
  unsigned saved_ = 0;
};

}  // namespace kda::cpu
