# The NCCL communicator of the context-parallel prefill (include/kda/distributed.h:
# make_nccl_communicator), off by default. NCCL comes from its package, e.g. the nvidia-nccl-cu13
# (or -cu12) wheel: -DKDA_ENABLE_NCCL=ON -DKDA_NCCL_ROOT=<site-packages>/nvidia/nccl, the
# directory holding its include/ and lib/.
option(KDA_ENABLE_NCCL "Build the NCCL communicator of the context-parallel prefill (needs CUDA)"
       OFF)
set(KDA_NCCL_ROOT "" CACHE PATH "Where NCCL's include/nccl.h and lib/libnccl.so* are")
if(KDA_ENABLE_NCCL)
  if(NOT KDA_ENABLE_CUDA)
    message(FATAL_ERROR "KDA_ENABLE_NCCL needs KDA_ENABLE_CUDA")
  endif()
  find_path(KDA_NCCL_INCLUDE_DIR nccl.h HINTS ${KDA_NCCL_ROOT}/include)
  find_library(KDA_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${KDA_NCCL_ROOT}/lib)
  if(NOT KDA_NCCL_INCLUDE_DIR OR NOT KDA_NCCL_LIBRARY)
    message(FATAL_ERROR "KDA_ENABLE_NCCL: nccl.h or libnccl not found; set KDA_NCCL_ROOT to the "
                        "directory with NCCL's include/ and lib/ (e.g. the nvidia-nccl-cu13 "
                        "wheel's nvidia/nccl)")
  endif()
  message(STATUS "NCCL: ${KDA_NCCL_INCLUDE_DIR}, ${KDA_NCCL_LIBRARY}")
  target_sources(kda PRIVATE ${PROJECT_SOURCE_DIR}/src/nccl_communicator.cpp)
  target_include_directories(kda PRIVATE ${KDA_NCCL_INCLUDE_DIR})
  target_compile_definitions(kda PRIVATE KDA_WITH_NCCL)
  target_link_libraries(kda PUBLIC ${KDA_NCCL_LIBRARY})
endif()
