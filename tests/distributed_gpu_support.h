// distributed_gpu_support.h — the GPU context-parallel tests' problems: one case shape (bf16,
// K = V = 128, H = 2, HV = 4) and device copies of a prefill's tensors on a chosen GPU.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distributed_support.h"
#include "gpu_support.h"

namespace kda::test {

// A split of one problem across ranks (token counts per rank).
struct DeviceSplit {
  std::string name;
  std::vector<int64_t> counts, seqlens;
  bool varlen;
  GateForm gate;
  StateLayout layout = StateLayout::kVFirst;
  int64_t checkpoint_every = 0;  // checkpoints (global rows and offsets)
  bool pool = false;             // pool mode (make_split_prefill's slots)
};

inline void PrintTo(const DeviceSplit& s, std::ostream* os) { *os << s.name; }

// The problem of a split. A precomputed gate is drawn weak (near 0) so that M carries the start
// state across a slice.
inline PrefillCase case_of(const DeviceSplit& s) {
  PrefillCase c;
  c.seqlens = s.seqlens;
  c.varlen = s.varlen;
  c.H = 2;
  c.HV = 4;
  c.K = c.V = 128;
  c.dtype = DType::kBFloat16;
  c.gate = s.gate;
  c.weak_decay = s.gate == GateForm::kPrecomputed;
  c.layout = s.layout;
  c.checkpoint_every = s.checkpoint_every;
  c.pool = s.pool;
  return c;
}

// Device copies on GPU `device` of the tensors of `d`, and `d`'s params over them (q, k, v, g,
// beta, A_log, dt_bias, out, initial_state; the host views of the others). add() copies more.
struct DeviceCopies {
  int device;
  std::vector<std::unique_ptr<DeviceTensor>> keep;
  PrefillParams p;
  DeviceTensor* out = nullptr;

  DeviceCopies(const PrefillData& d, int device_index) : device(device_index), p(d.params()) {
    for (auto [view, host] : {std::pair{&p.q, &d.q},
                              {&p.k, &d.k},
                              {&p.v, &d.v},
                              {&p.g, &d.g},
                              {&p.beta, &d.beta},
                              {&p.A_log, &d.A_log},
                              {&p.dt_bias, &d.dt_bias},
                              {&p.initial_state, &d.h0},
                              {&p.out, &d.out}})
      *view = add(*host);
    out = keep.back().get();
  }
  // A device copy of `h` (absent when h is empty), kept alive with the others.
  TensorView add(const HostTensor& h) {
    if (h.empty()) return TensorView{};
    KDA_TEST_CUDA(cudaSetDevice(device));
    keep.push_back(std::make_unique<DeviceTensor>(h));
    TensorView t = keep.back()->view();
    t.device_index = device;
    return t;
  }
};

}  // namespace kda::test
