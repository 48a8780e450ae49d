// support.h — host-side test helpers shared by the CPU and GPU tests and the benchmarks:
// owning host tensors of any dtype and stride, random problem generation, and the comparison
// helper (relative L2 error against the reference, NaN check, first mismatches).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kda/kda.h"

namespace kda::test {

// An owning host tensor. `padded` gives every dimension but the last a larger stride than the
// contiguous one (as a view into a fused QKV projection would have).
struct HostTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape, strides;
  std::vector<uint8_t> storage;

  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> shape, bool padded = false);

  bool empty() const { return shape.empty(); }
  int64_t numel() const;
  TensorView view() const;  // CPU view (absent when empty())
  // Logical (row-major over `shape`) element access.
  int64_t offset(int64_t flat) const;
  double get(int64_t flat) const;
  void set(int64_t flat, double x);
  void fill(double x);
  void fill_normal(std::mt19937_64& rng, double stddev, double mean = 0.0);
  void fill_uniform(std::mt19937_64& rng, double lo, double hi);
  void fill_bytes(uint8_t b);  // e.g. poison with 0xff (NaN in every float dtype)
  HostTensor to(DType dt, bool padded = false) const;  // converted copy (exact when widening)
  std::vector<double> values() const;                  // logical values in fp64
};

enum class InitState { kNone, kZero, kRandom };

// One prefill configuration; instance names of parameterized tests come from name().
struct PrefillCase {
  std::vector<int64_t> seqlens = {100};  // dense: B sequences of seqlens[0]; varlen: these lengths
  bool varlen = false;
  int64_t H = 2, HV = 2, K = 32, V = 32;
  DType dtype = DType::kFloat32;
  GateForm gate = GateForm::kSoftplus;
  bool beta_logits = true;
  bool allow_neg_eigval = false;
  bool l2norm = true;
  InitState init = InitState::kRandom;
  bool final_state = true;
  StateLayout layout = StateLayout::kVFirst;
  DType state_dtype = DType::kFloat32;
  bool strided = false;
  bool gate_beta_fp32 = false;  // g and beta in fp32 (the spec allows it with 16-bit q, k, v)
  bool pool = false;            // state pool with shuffled indices (and one padding slot)
  int64_t checkpoint_every = 0;
  double lower_bound = -5.0;
  double gate_extreme = 0.0;   // if != 0, 1 in 7 precomputed gate entries set to this value
  double weak_decay = false;   // precomputed gate near 0 (weak decay)
  double slow_channel_dt = 0;  // if != 0: dt_bias of key channel 0 of the last value head
  uint64_t seed = 1;
  std::string name() const;
};

// All tensors of a prefill call, on the host.
struct PrefillData {
  PrefillCase c;
  int64_t N = 0, B = 0, T = 0;
  HostTensor q, k, v, g, beta, A_log, dt_bias, cu, out, h0, ht, pool, idx, ckpt, ckpt_off;
  std::vector<int64_t> cu_host;  // sequence starts, N + 1
  PrefillParams params() const;  // CPU views
};

// Random inputs per the case (dtype = c.dtype) and zeroed/poisoned outputs.
PrefillData make_prefill(const PrefillCase& c);
// The same problem with every float input widened to fp32 and fp32 outputs: the reference input.
PrefillData widen(const PrefillData& d);
// The decode inputs of token t of a prefill's inputs: q, k, v, g, beta as one-token views into the
// same storage (dense [B, T, ...] tensors), A_log, dt_bias and the gate of `p`; outputs and state
// are left to the caller.
DecodeParams decode_inputs_of_token(const PrefillParams& p, int64_t t);

// Decode configuration.
struct DecodeCase {
  int64_t N = 4, T = 1;          // dense: N x T tokens
  std::vector<int64_t> seqlens;  // varlen when non-empty
  int64_t H = 2, HV = 4, K = 32;
  DType dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  DType state_dtype = DType::kFloat32;
  StateLayout layout = StateLayout::kVFirst;
  GateForm gate = GateForm::kSoftplus;
  bool beta_logits = true;
  bool allow_neg_eigval = false;
  bool beta_per_v = false;
  int indices = 1;  // 0: none, 1: [N], 2: [N, T] (speculative)
  DType index_dtype = DType::kInt32;
  bool num_accepted = false;  // with indices == 2
  bool padding = false;       // some rows get a negative / out-of-range slot
  bool final_state_separate = false;
  bool intermediate = false;
  bool use_initial_state = true;
  bool store_final_state = true;
  int64_t pool_extra = 5;  // P = slots used + pool_extra (unused slots stay untouched)
  uint64_t seed = 1;
  std::string name() const;
};

struct DecodeData {
  DecodeCase c;
  int64_t N = 0, B = 0, T = 0, P = 0, total = 0;
  HostTensor q, k, v, g, beta, A_log, dt_bias, cu, out, state, idx, nat, final_state, inter;
  DecodeParams params() const;
};

DecodeData make_decode(const DecodeCase& c);

// Comparison result of `got` against `ref`, over the logical elements.
struct Compare {
  double rel_l2 = 0;  // ||got - ref|| / ||ref||
  double max_abs = 0;
  int64_t nonfinite = 0;         // NaN/inf in got
  std::string first_mismatches;  // up to 5 "i: got vs ref" entries with |diff| > tol * rms(ref)
  bool ok(double tol) const { return nonfinite == 0 && rel_l2 <= tol; }
};
Compare compare(const HostTensor& got, const HostTensor& ref, double tol);

// Tolerance on rel_l2 for a result stored in `dtype` by the fp32 backends (docs/design.md, 5).
double tolerance_for(DType dtype);

bool bitwise_equal(const HostTensor& a, const HostTensor& b);

// A parameterized-test instance name from a case name: every non-alphanumeric character -> '_'.
std::string test_name(std::string s);

}  // namespace kda::test
