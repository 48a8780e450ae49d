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
void fast_prefill(const detail::PrefillProblem& pr, int num_threads);
void fast_decode(const detail::DecodeProblem& pr, int num_threads);

// Decode slot rules shared by both backends (spec section 5); -1 means none / padding row.
int64_t decode_read_slot(const detail::DecodeProblem& pr, int64_t n, int64_t len);
int64_t decode_token_slot(const detail::DecodeProblem& pr, int64_t n, int64_t t);

// Runs fn(i, worker) for i in [0, count) on up to num_threads threads (0 = all hardware threads,
// or $KDA_NUM_THREADS); work is handed out dynamically; worker in [0, threads used).
void parallel_for(int64_t count, int num_threads, const std::function<void(int64_t, int)>& fn);
int resolve_num_threads(int requested);

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
