// dispatch.cpp — fast_prefill() and fast_decode() forward to the copy of the kernels compiled for
// the highest instruction-set level this CPU supports (cpu/isa.h), chosen on first use.
#include "cpu/backends.h"
#include "cpu/isa.h"

namespace kda::cpu {

#define KDA_DECLARE_FAST_KERNELS(level)                                   \
  namespace level {                                                       \
  Status fast_prefill(const detail::PrefillProblem& pr, int num_threads); \
  Status fast_decode(const detail::DecodeProblem& pr, int num_threads);   \
  }
#define KDA_FAST_KERNELS(level, supported) \
  FastKernels { #level, supported, &level::fast_prefill, &level::fast_decode }

#ifdef KDA_CPU_HAS_x86_64
KDA_DECLARE_FAST_KERNELS(x86_64)
#endif
#ifdef KDA_CPU_HAS_x86_64_v3
KDA_DECLARE_FAST_KERNELS(x86_64_v3)
#endif
#ifdef KDA_CPU_HAS_generic
KDA_DECLARE_FAST_KERNELS(generic)
#endif
#ifdef KDA_CPU_HAS_native
KDA_DECLARE_FAST_KERNELS(native)
#endif

namespace {

#if defined(KDA_CPU_HAS_x86_64_v3)
// Every x86-64-v3 feature (__builtin_cpu_supports also checks that the OS saves the AVX register
// state). Clang before 19 knows neither the level's name nor the F16C, LZCNT and MOVBE names;
// every CPU with AVX2, FMA and BMI2 has those three.
bool cpu_has_x86_64_v3() {
  __builtin_cpu_init();
#if defined(__clang__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
#else
  return __builtin_cpu_supports("x86-64-v3");
#endif
}
#endif

std::vector<FastKernels> compiled_levels() {
  std::vector<FastKernels> v;
#ifdef KDA_CPU_HAS_x86_64
  v.push_back(KDA_FAST_KERNELS(x86_64, true));
#endif
#ifdef KDA_CPU_HAS_x86_64_v3
  v.push_back(KDA_FAST_KERNELS(x86_64_v3, cpu_has_x86_64_v3()));
#endif
#ifdef KDA_CPU_HAS_generic
  v.push_back(KDA_FAST_KERNELS(generic, true));
#endif
#ifdef KDA_CPU_HAS_native  // built for the build machine's CPU (KDA_NATIVE_CPU)
  v.push_back(KDA_FAST_KERNELS(native, true));
#endif
  return v;
}

}  // namespace

const std::vector<FastKernels>& fast_kernel_levels() {
  static const std::vector<FastKernels> levels = compiled_levels();
  return levels;
}

const FastKernels& fast_kernels() {
  static const FastKernels* const best = [] {
    const FastKernels* b = &fast_kernel_levels().front();
    for (const auto& k : fast_kernel_levels())
      if (k.supported) b = &k;
    return b;
  }();
  return *best;
}

Status fast_prefill(const detail::PrefillProblem& pr, int num_threads) {
  return fast_kernels().prefill(pr, num_threads);
}

Status fast_decode(const detail::DecodeProblem& pr, int num_threads) {
  return fast_kernels().decode(pr, num_threads);
}

}  // namespace kda::cpu
