# The fast CPU kernels (src/cpu/prefill_chunked.cpp, src/cpu/decode_fast.cpp) are compiled once per
# instruction-set level, each copy into namespace kda::cpu::<level> (the KDA_CPU_ISA definition,
# src/cpu/isa.h), and src/cpu/dispatch.cpp picks the best level this CPU runs, once, at run time.
#
# x86-64: x86_64 (the compiler's baseline, SSE2) and x86_64_v3 (AVX2, FMA, BMI2): the prefill
# kernels run about 13x faster at v3 than at the baseline; x86-64-v4 (AVX-512) measured no faster
# than v3 and is not built. Other processors: one copy with the compiler's default flags.
# KDA_NATIVE_CPU=ON builds a single -march=native copy instead (for this CPU only).

set(KDA_CPU_KERNEL_SOURCES src/cpu/prefill_chunked.cpp src/cpu/decode_fast.cpp)
set(KDA_CPU_LEVELS "")
# The objects of every layer below the dispatcher (kda_core and the kernel copies): what the
# emulator links besides its own api.cpp.
set(KDA_CORE_OBJECTS $<TARGET_OBJECTS:kda_core>)

# kda_add_cpu_level(<level> [compiler flags...]): one copy of the kernels, added to target kda.
function(kda_add_cpu_level level)
  set(lib kda_cpu_${level})
  add_library(${lib} OBJECT ${KDA_CPU_KERNEL_SOURCES})
  target_include_directories(${lib} PRIVATE ${PROJECT_SOURCE_DIR}/include
                             ${PROJECT_BINARY_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_compile_definitions(${lib} PRIVATE KDA_CPU_ISA=${level})
  target_compile_options(${lib} PRIVATE -O3 -fno-math-errno -Wall -Wextra -Wno-unused-parameter
                         -Wno-psabi ${ARGN})
  target_sources(kda PRIVATE $<TARGET_OBJECTS:${lib}>)
  set(KDA_CORE_OBJECTS ${KDA_CORE_OBJECTS} $<TARGET_OBJECTS:${lib}> PARENT_SCOPE)
  set_property(SOURCE src/cpu/dispatch.cpp APPEND PROPERTY COMPILE_DEFINITIONS
               KDA_CPU_HAS_${level})
  set(KDA_CPU_LEVELS ${KDA_CPU_LEVELS} ${level} PARENT_SCOPE)
endfunction()

include(CheckCXXCompilerFlag)
if(KDA_NATIVE_CPU)
  check_cxx_compiler_flag(-march=native KDA_HAS_MARCH_NATIVE)
  if(NOT KDA_HAS_MARCH_NATIVE)
    message(FATAL_ERROR "KDA_NATIVE_CPU: ${CMAKE_CXX_COMPILER} does not accept -march=native")
  endif()
  kda_add_cpu_level(native -march=native)
elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  check_cxx_compiler_flag(-march=x86-64-v3 KDA_HAS_MARCH_X86_64_V3)
  kda_add_cpu_level(x86_64)
  if(KDA_HAS_MARCH_X86_64_V3)
    kda_add_cpu_level(x86_64_v3 -march=x86-64-v3)
  endif()
else()
  kda_add_cpu_level(generic)
endif()
message(STATUS "kda: fast CPU kernels for ${KDA_CPU_LEVELS}")
