// isa.h — the fast CPU kernels per instruction-set level (cmake/kda_cpu_kernels.cmake).
//
// prefill_chunked.cpp and decode_fast.cpp are compiled once per level (x86_64 and x86_64_v3; or
// one `generic` or `native` copy) with KDA_CPU_ISA set to the level's name. Every
// function they define, and every inline function of the CPU headers they include, lives in the
// inline namespace kda::cpu::KDA_CPU_ISA, so each level's copies keep distinct symbols and the
// linker never hands one level's code to another. Translation units built once use the namespace
// `portable`. dispatch.cpp picks the best level the running CPU supports, once.
#pragma once

#include <vector>

#include "core/problem.h"

#ifndef KDA_CPU_ISA
#define KDA_CPU_ISA portable
#endif

namespace kda::cpu {

// One compiled copy of the fast kernels.
struct FastKernels {
  const char* level;  // "x86_64", "x86_64_v3", "generic" or "native"
  bool supported;     // this CPU can run it
  Status (*prefill)(const detail::PrefillProblem& pr, int num_threads);
  Status (*decode)(const detail::DecodeProblem& pr, int num_threads);
};

// Every level this build compiled, lowest first (the first one runs on any CPU of the target).
const std::vector<FastKernels>& fast_kernel_levels();
// The level fast_prefill() and fast_decode() run: the highest supported one.
const FastKernels& fast_kernels();

}  // namespace kda::cpu
