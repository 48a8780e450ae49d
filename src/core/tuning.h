// tuning.h — every tuning knob of the library, read from the environment once into one struct
// (docs/tuning.md is the table: name, default, effect, valid values). No CUDA headers: the CPU
// build, the heuristics (src/cuda/heuristics/) and their CPU tests see it.
//
// tuning() is the struct the library uses: the environment as read on first use (thread-safe,
// never re-read), or the innermost ScopedTuning override. A value that is not valid for its knob
// is ignored (the default applies), as documented per knob.
//
// Testing hook (tests and benchmarks; not part of the public API): ScopedTuning replaces the
// struct for its scope, e.g. to force a kernel:
//   kda::detail::Tuning t = kda::detail::tuning();
//   t.decode_kernel = kda::detail::DecodeKernelOverride::kStaged;
//   kda::detail::ScopedTuning scope(t);   // calls in this scope run the staged kernel
// Overrides nest (each restores the previous on destruction) and are process-wide: set them from
// one thread while no call is in flight.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace kda::detail {

// KDA_CUDA_DECODE_KERNEL: the decode kernel to run where it is eligible (else the default choice).
enum class DecodeKernelOverride {
  kAuto,
  kBaseline,
  kTile,
  kStaged,
  kBulk,
  kBulkLatency,
  kWarp,
  kSingle
};

// KDA_CUDA_DECODE_WARP_CACHE: the L2 policy of the warp kernel's state loads and stores.
enum class DecodeStateCache { kAuto, kNormal, kStream };

struct Tuning {
  bool pdl = true;            // KDA_CUDA_PDL: programmatic dependent launch
  bool driver_launch = true;  // KDA_CUDA_DRIVER_LAUNCH: launches through cuLaunchKernelEx
  DecodeKernelOverride decode_kernel = DecodeKernelOverride::kAuto;  // KDA_CUDA_DECODE_KERNEL
  int decode_warp_rows = 0;  // KDA_CUDA_DECODE_WARP_ROWS: 4/8/16 rows per warp (0: heuristic)
  DecodeStateCache decode_warp_cache = DecodeStateCache::kAuto;  // KDA_CUDA_DECODE_WARP_CACHE
  int prefill_vs = 0;              // KDA_CUDA_PREFILL_VS: 16/32/64/128 (0: heuristic)
  bool prefill_ksplit = true;      // KDA_CUDA_PREFILL_KSPLIT: K split at vs <= 32
  bool prefill_wgmma = true;       // KDA_CUDA_PREFILL_WGMMA: wgmma recurrence at vs >= 64
  int prefill_chunk = 0;           // KDA_CUDA_PREFILL_CHUNK: 16 or 64 forces (0: heuristic)
  int prefill_prefetch = 0;        // KDA_CUDA_PREFILL_PREFETCH: blocks (0: off; -1: 2 x SMs)
  int prefill_segment = 0;         // KDA_CUDA_PREFILL_SEGMENT: tokens per segment (0: heuristic;
                                   // -1: one segment per sequence)
  int prefill_fused = 0;           // KDA_CUDA_PREFILL_FUSED: 1 forces the fused kernel where it
                                   // applies, 0 in the environment turns it off (stored as -1)
  int prefill_warm = 0;            // KDA_CUDA_PREFILL_WARM: 1 forces warm-up segments where they
                                   // apply, 0 in the environment turns them off (stored as -1)
  int prefill_warm_chunks = 48;    // KDA_CUDA_PREFILL_WARM_CHUNKS: a warm-up's most 16-token chunks
  int prefill_warm_bits = 12;      // KDA_CUDA_PREFILL_WARM_BITS: a warm-up ends where the dropped
                                   // state is at most 2^-bits of the state it stands for
  bool prefill_single = false;     // KDA_CUDA_PREFILL_SINGLE=1: one cooperative launch, small calls
  bool prefill_graph = true;       // KDA_CUDA_PREFILL_GRAPH: a call's kernels as one graph launch
  bool backward_split = true;      // KDA_CUDA_BACKWARD_SPLIT: 3xTF32 products in the backward
  bool backward_wgmma = true;      // KDA_CUDA_BACKWARD_WGMMA: the chunk's state products on wgmma
  bool backward_wg_passes = true;  // KDA_CUDA_BACKWARD_WG_PASSES=0: the mma.sync state passes
  int num_threads = 0;             // KDA_NUM_THREADS: CPU worker threads (0: hardware)
};

// ---- Parsing (pure; `get` maps a name to its value or nullptr, like std::getenv)

// A string of decimal digits as a number (saturating at 1e6); -1 for null, empty or anything else.
inline long tuning_digits(const char* s) {
  if (s == nullptr || s[0] == '\0') return -1;
  long v = 0;
  for (const char* c = s; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') return -1;
    if (v < 1000000) v = 10 * v + (*c - '0');
  }
  return v;
}

template <typename Get>
Tuning parse_tuning(Get&& get) {
  Tuning t;
  auto is = [](const char* s, const char* name) {
    return s != nullptr && std::strcmp(s, name) == 0;
  };
  const char* s = get("KDA_CUDA_PDL");
  t.pdl = !is(s, "0");
  t.driver_launch = !is(get("KDA_CUDA_DRIVER_LAUNCH"), "0");
  s = get("KDA_CUDA_DECODE_KERNEL");
  if (is(s, "baseline")) t.decode_kernel = DecodeKernelOverride::kBaseline;
  if (is(s, "tile")) t.decode_kernel = DecodeKernelOverride::kTile;
  if (is(s, "staged")) t.decode_kernel = DecodeKernelOverride::kStaged;
  if (is(s, "bulk")) t.decode_kernel = DecodeKernelOverride::kBulk;
  if (is(s, "bulklat")) t.decode_kernel = DecodeKernelOverride::kBulkLatency;
  if (is(s, "warp")) t.decode_kernel = DecodeKernelOverride::kWarp;
  if (is(s, "single")) t.decode_kernel = DecodeKernelOverride::kSingle;
  s = get("KDA_CUDA_DECODE_WARP_ROWS");
  if (is(s, "4") || is(s, "8") || is(s, "16"))
    t.decode_warp_rows = static_cast<int>(tuning_digits(s));
  s = get("KDA_CUDA_DECODE_WARP_CACHE");
  if (is(s, "normal")) t.decode_warp_cache = DecodeStateCache::kNormal;
  if (is(s, "stream")) t.decode_warp_cache = DecodeStateCache::kStream;
  s = get("KDA_CUDA_PREFILL_VS");
  const long vs = tuning_digits(s);
  if ((vs == 16 || vs == 32 || vs == 64 || vs == 128) && s[0] != '0')
    t.prefill_vs = static_cast<int>(vs);
  t.prefill_ksplit = !is(get("KDA_CUDA_PREFILL_KSPLIT"), "0");
  t.prefill_wgmma = !is(get("KDA_CUDA_PREFILL_WGMMA"), "0");
  const long chunk = tuning_digits(get("KDA_CUDA_PREFILL_CHUNK"));
  if (chunk == 16 || chunk == 64) t.prefill_chunk = static_cast<int>(chunk);
  s = get("KDA_CUDA_PREFILL_PREFETCH");
  const long pf = tuning_digits(s);
  if (is(s, "auto"))
    t.prefill_prefetch = -1;
  else if (pf > 0)
    t.prefill_prefetch = static_cast<int>(pf);
  s = get("KDA_CUDA_PREFILL_SEGMENT");
  const long seg = tuning_digits(s);
  if (is(s, "off"))
    t.prefill_segment = -1;
  else if (seg >= 64 && seg % 64 == 0 && seg < 1000000)
    t.prefill_segment = static_cast<int>(seg);
  s = get("KDA_CUDA_PREFILL_FUSED");
  if (is(s, "0")) t.prefill_fused = -1;
  if (is(s, "1")) t.prefill_fused = 1;
  s = get("KDA_CUDA_PREFILL_WARM");
  if (is(s, "0")) t.prefill_warm = -1;
  if (is(s, "1")) t.prefill_warm = 1;
  const long wc = tuning_digits(get("KDA_CUDA_PREFILL_WARM_CHUNKS"));
  if (wc >= 1 && wc <= 4096) t.prefill_warm_chunks = static_cast<int>(wc);
  const long wb = tuning_digits(get("KDA_CUDA_PREFILL_WARM_BITS"));
  if (wb >= 10 && wb <= 32) t.prefill_warm_bits = static_cast<int>(wb);
  t.prefill_single = is(get("KDA_CUDA_PREFILL_SINGLE"), "1");
  t.prefill_graph = !is(get("KDA_CUDA_PREFILL_GRAPH"), "0");
  t.backward_split = !is(get("KDA_CUDA_BACKWARD_SPLIT"), "0");
  t.backward_wgmma = !is(get("KDA_CUDA_BACKWARD_WGMMA"), "0");
  t.backward_wg_passes = !is(get("KDA_CUDA_BACKWARD_WG_PASSES"), "0");
  if ((s = get("KDA_NUM_THREADS")) != nullptr) {
    const int n = std::atoi(s);
    if (n > 0) t.num_threads = n;
  }
  return t;
}

inline Tuning tuning_from_env() {
  return parse_tuning([](const char* name) -> const char* { return std::getenv(name); });
}

// ---- The struct in use

inline std::atomic<const Tuning*>& tuning_override() {
  static std::atomic<const Tuning*> current{nullptr};
  return current;
}

inline const Tuning& tuning() {
  if (const Tuning* o = tuning_override().load(std::memory_order_acquire)) return *o;
  static const Tuning env = tuning_from_env();  // thread-safe, first use only
  return env;
}

class ScopedTuning {
 public:
  explicit ScopedTuning(const Tuning& t) : value_(t), saved_(tuning_override().load()) {
    tuning_override().store(&value_, std::memory_order_release);
  }
  ~ScopedTuning() { tuning_override().store(saved_, std::memory_order_release); }
  ScopedTuning(const ScopedTuning&) = delete;
  ScopedTuning& operator=(const ScopedTuning&) = delete;
  Tuning& value() { return value_; }

 private:
  Tuning value_;
  const Tuning* saved_;
};

}  // namespace kda::detail
