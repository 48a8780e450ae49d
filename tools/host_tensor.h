// host_tensor.h — what the `kda` program needs besides the library: a contiguous host tensor of
// any kda dtype (elements read and written as double, random fills) and the relative L2 error.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kda/kda.h"

namespace kda::tools {

struct HostTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> storage;  // row-major elements of `dtype`

  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> shape);

  bool empty() const { return shape.empty(); }
  int64_t numel() const { return static_cast<int64_t>(storage.size() / dtype_size(dtype)); }
  TensorView view() const;  // CPU view (absent when empty())
  double get(int64_t i) const;
  void set(int64_t i, double x);  // rounds to nearest even in bf16 / fp16
  void fill(double x);
  void fill_normal(std::mt19937_64& rng, double stddev);
  void fill_uniform(std::mt19937_64& rng, double lo, double hi);
};

// ||got - ref|| / ||ref|| over the elements; infinity when got holds a NaN or an infinity.
double rel_l2_error(const HostTensor& got, const HostTensor& ref);

}  // namespace kda::tools
