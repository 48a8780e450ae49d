// test_gpu_prefill.cpp — CUDA prefill (src/cuda/prefill/) against the fp64 reference.
//
// Every GPU test starts with KDA_SKIP_WITHOUT_SM90(). The reference is kda::prefill with
// Backend::kCpuReference on widen(data): the same (bf16/fp16-exact) inputs in fp32, computed in
// fp64. Tolerances (relative L2 over the whole tensor) are derived from where the kernel rounds:
//   * output bf16: the rounding of the stored result alone is ~1.7e-3 (tolerance_for(bf16) =
//     3e-3 leaves room for the kernel's own error, measured 1e-4..5e-4 on top in emulation);
//   * output fp16: the result rounding is ~2.5e-4, but the kernel keeps the state operand of
//     S^T W^T and S^T qg^T and the W / qg operands in bf16 (docs/perf_notes.md, "Precision"),
//     which adds up to ~1.5e-3 under weak decay (long memory): 2.5e-3;
//   * states: the update's kb operand is stored in bf16 (the record's kbT; tf32 or bf16 hi + lo
//   U^T), which
//     alone gives ~1.6e-3 (strong decay) .. 1.8e-3 (weak decay): fp32 / fp16 states 3e-3; a bf16
//     state adds its own rounding (1.7e-3): 4e-3.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/kda_math.h"
#include "core/tuning.h"
#include "cuda/common/graph_launch.h"
#include "cuda/cuda_backend.h"
#include "cuda/heuristics/prefill.h"
#include "gpu_support.h"
#include "support.h"

namespace kda::test {
namespace {

// ---------------------------------------------------------------------------------------------
// Running the CUDA prefill on a PrefillData
// ---------------------------------------------------------------------------------------------

// Results of one CUDA run, downloaded into host tensors of the inputs' layouts.
struct GpuResult {
  Status status;
  HostTensor out, ht, pool, ckpt;
};

void download(const DeviceTensor* dt, const HostTensor& like, HostTensor* dst) {
  if (like.empty()) return;
  *dst = like;
  dt->download(*dst);
}

// Runs the CUDA prefill on device copies of `d` (poisoned outputs included).
GpuResult run_cuda(const PrefillData& d, cudaStream_t stream = nullptr) {
  GpuResult r;
  DeviceData dd(d);
  size_t bytes = 0;
  r.status = prefill_workspace_size(dd.p, &bytes);
  if (!r.status.ok()) return r;
  DeviceBuffer ws(bytes);
  dd.p.exec.workspace = ws.ptr;
  dd.p.exec.workspace_bytes = bytes;
  dd.p.exec.stream = stream;
  r.status = prefill(dd.p);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
  KDA_TEST_CUDA(cudaGetLastError());
  download(dd.out, d.out, &r.out);
  download(dd.ht, d.ht, &r.ht);
  download(dd.pool, d.pool, &r.pool);
  download(dd.ckpt, d.ckpt, &r.ckpt);
  return r;
}

double out_tolerance(DType dt) {
  return dt == DType::kFloat16 ? 2.5e-3 : tolerance_for(DType::kBFloat16);
}
// The chunk-16 path (the default at vs = 128) multiplies the state by bf16 operands at every
// 16-token step, so the state's bf16 rounding reaches every output beyond the step's 16 tokens
// (chunk 64: beyond 64). Under weak decay, where the state carries most of each output, that adds
// ~1.3e-3 (emulated case A at lower bound -0.05: 2.85e-3 against 2.24e-3 for chunk 64; H200 small
// sweep cases up to 3.1e-3): its outputs are held to the previous bar, 4.5e-3, there (the current
// bar, 2.5e-3, waits on the fix planned in docs/design.md, section 6).
double out_tolerance(DType dt, bool chunk16_weak) {
  return chunk16_weak ? 4.5e-3 : out_tolerance(dt);
}
double state_tolerance(DType dt) { return dt == DType::kBFloat16 ? 4e-3 : 3e-3; }

void expect_close(const char* what, const HostTensor& got, const HostTensor& ref, double tol) {
  if (got.empty()) return;
  const Compare c = compare(got, ref, tol);
  EXPECT_TRUE(c.ok(tol)) << what << ": rel_l2 " << c.rel_l2 << " (tol " << tol << "), max_abs "
                         << c.max_abs << ", nonfinite " << c.nonfinite << ";" << c.first_mismatches;
}

// Rows [row, row + 1) of a state tensor [rows, ...] compared bit for bit.
bool rows_bitwise_equal(const HostTensor& a, const HostTensor& b, int64_t row_a, int64_t row_b) {
  const int64_t per_row = a.numel() / a.shape[0];
  const size_t es = dtype_size(a.dtype);
  for (int64_t i = 0; i < per_row; ++i)
    if (std::memcmp(a.storage.data() + a.offset(row_a * per_row + i) * es,
                    b.storage.data() + b.offset(row_b * per_row + i) * es, es) != 0)
      return false;
  return true;
}

PrefillCase base_case() {
  PrefillCase c;
  c.K = 128;
  c.V = 128;
  c.dtype = DType::kBFloat16;
  return c;
}

// With use_qk_l2norm off the kernel takes q, k as given. Random keys of norm ~sqrt(K) make the
// recurrence expansive (|1 - b |k|^2| >> 1): outputs grow like 1e8 within 80 tokens and every
// rounding is amplified (the fp32 CPU backend lands at ~6e-6, 100x its epsilon; the kernel's tf32
// intermediates at ~1e-2). Callers that switch the in-kernel norm off normalize outside, so the
// tests do the same, to norm 0.5 (a kernel that normalized anyway would fail).
void normalize_rows(HostTensor& t, double norm) {
  const int64_t dim = t.shape.back(), rows = t.numel() / dim;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += t.get(r * dim + i) * t.get(r * dim + i);
    const double f = ss > 0 ? norm / std::sqrt(ss) : 0.0;
    for (int64_t i = 0; i < dim; ++i) t.set(r * dim + i, t.get(r * dim + i) * f);
  }
}

PrefillData make_data(const PrefillCase& c) {
  PrefillData d = make_prefill(c);
  if (!c.l2norm) {
    normalize_rows(d.q, 0.5);
    normalize_rows(d.k, 0.5);
  }
  return d;
}

// ---------------------------------------------------------------------------------------------
// Parameterized sweep
// ---------------------------------------------------------------------------------------------

std::vector<PrefillCase> sweep_cases() {
  std::vector<PrefillCase> v;
  auto add = [&](auto&& edit) {
    PrefillCase c = base_case();
    edit(c);
    v.push_back(c);
  };
  // Lengths: dense, below / at / above a chunk; varlen with empty and long sequences.
  for (int64_t T : {1, 15, 63, 64, 65, 200}) add([&](PrefillCase& c) { c.seqlens = {T}; });
  add([](PrefillCase& c) { c.seqlens = {300, 300}; });
  add([](PrefillCase& c) {
    c.seqlens = {1000};
    c.H = 1;
    c.HV = 1;
  });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {0, 1, 15, 63, 64, 65, 1000};
  });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {5, 0};
  });
  add([](PrefillCase& c) {  // many short sequences: the slot search of the prepare kernel
    c.varlen = true;
    c.seqlens.clear();
    for (int i = 0; i < 70; ++i) c.seqlens.push_back((i * 37) % 90);
    c.H = 1;
    c.HV = 1;
  });
  // GVA and head counts.
  add([](PrefillCase& c) {
    c.H = 2;
    c.HV = 6;
    c.seqlens = {130};
  });
  add([](PrefillCase& c) {
    c.H = 1;
    c.HV = 1;
    c.seqlens = {129};
  });
  add([](PrefillCase& c) {
    c.H = 3;
    c.HV = 12;
    c.varlen = true;
    c.seqlens = {70, 3};
  });
  // Gate forms.
  add([](PrefillCase& c) {
    c.gate = GateForm::kLowerBound;
    c.seqlens = {150};
  });
  add([](PrefillCase& c) {
    c.gate = GateForm::kLowerBound;
    c.lower_bound = -0.05;
    c.seqlens = {300};
  });
  add([](PrefillCase& c) {
    c.gate = GateForm::kPrecomputed;
    c.seqlens = {150};
  });
  add([](PrefillCase& c) {
    c.gate = GateForm::kPrecomputed;
    c.gate_extreme = -1000;
    c.seqlens = {150};
  });
  add([](PrefillCase& c) {
    c.gate = GateForm::kPrecomputed;
    c.weak_decay = true;
    c.seqlens = {300};
  });
  // Beta forms.
  add([](PrefillCase& c) {
    c.beta_logits = false;
    c.seqlens = {100};
  });
  add([](PrefillCase& c) {
    c.allow_neg_eigval = true;
    c.seqlens = {100};
  });
  // Normalization off (keys normalized by the caller, see make_data).
  add([](PrefillCase& c) {
    c.l2norm = false;
    c.seqlens = {80};
  });
  add([](PrefillCase& c) {
    c.l2norm = false;
    c.gate = GateForm::kLowerBound;
    c.beta_logits = false;
    c.seqlens = {140};
  });
  // States.
  add([](PrefillCase& c) {
    c.init = InitState::kNone;
    c.seqlens = {90};
  });
  add([](PrefillCase& c) {
    c.init = InitState::kZero;
    c.seqlens = {90};
  });
  add([](PrefillCase& c) {
    c.final_state = false;
    c.seqlens = {90};
  });
  add([](PrefillCase& c) {
    c.layout = StateLayout::kKFirst;
    c.seqlens = {90};
  });
  add([](PrefillCase& c) {
    c.state_dtype = DType::kBFloat16;
    c.seqlens = {90};
  });
  add([](PrefillCase& c) {
    c.state_dtype = DType::kFloat16;
    c.layout = StateLayout::kKFirst;
    c.seqlens = {90};
  });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {100, 0, 64, 7};
    c.pool = true;
  });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {130, 20, 64};
    c.pool = true;
    c.state_dtype = DType::kBFloat16;
  });
  // Checkpoints.
  add([](PrefillCase& c) {
    c.seqlens = {200, 200};
    c.checkpoint_every = 64;
  });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {300, 0, 127, 128};
    c.checkpoint_every = 128;
    c.layout = StateLayout::kKFirst;
  });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {256, 64, 5};
    c.checkpoint_every = 64;
    c.pool = true;
  });
  // Strided q/k/v/g/beta (rows not 16-byte aligned: the scalar load paths).
  add([](PrefillCase& c) {
    c.strided = true;
    c.seqlens = {100};
    c.H = 2;
    c.HV = 4;
  });
  add([](PrefillCase& c) {
    c.strided = true;
    c.varlen = true;
    c.seqlens = {33, 70};
    c.gate = GateForm::kLowerBound;
  });
  // Gate and beta in fp32 with bf16 / fp16 q, k, v (vector and scalar gate loads).
  add([](PrefillCase& c) {
    c.gate_beta_fp32 = true;
    c.gate = GateForm::kLowerBound;
    c.varlen = true;
    c.seqlens = {70, 0, 130};
  });
  add([](PrefillCase& c) {
    c.gate_beta_fp32 = true;
    c.dtype = DType::kFloat16;
    c.seqlens = {150};
  });
  add([](PrefillCase& c) {
    c.gate_beta_fp32 = true;
    c.strided = true;
    c.gate = GateForm::kPrecomputed;
    c.seqlens = {100};
  });
  // fp16.
  add([](PrefillCase& c) {
    c.dtype = DType::kFloat16;
    c.seqlens = {150};
  });
  add([](PrefillCase& c) {
    c.dtype = DType::kFloat16;
    c.varlen = true;
    c.seqlens = {1, 64, 99};
    c.state_dtype = DType::kFloat16;
  });
  add([](PrefillCase& c) {
    c.dtype = DType::kFloat16;
    c.gate = GateForm::kPrecomputed;
    c.weak_decay = true;
    c.seqlens = {256};
  });
  return v;
}

class GpuPrefillSweep : public ::testing::TestWithParam<PrefillCase> {};

// T of case c's call (varlen: the total; dense: the longest sequence).
int64_t case_tokens(const PrefillCase& c) {
  int64_t T = 0;
  for (int64_t len : c.seqlens) T = c.varlen ? T + len : std::max(T, len);
  return T;
}

// The two-kernel plan of a call on case c: the host's choice (host.h make_params) for its
// sequences x value heads on this device (its SM count in *sms; false without one), under the
// same tuning.
bool host_plan(const PrefillCase& c, cuda::pf::PrefillPlan* plan, int* sms) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  *sms = prop.multiProcessorCount;
  const bool weak = cuda::pf::weak_decay_gate(c.gate == GateForm::kLowerBound, c.lower_bound);
  *plan = cuda::pf::prefill_plan(c.varlen, case_tokens(c), static_cast<int64_t>(c.seqlens.size()),
                                 c.HV, *sms, detail::tuning(), weak);
  return true;
}

// Whether a call on case c takes the chunk-16 path.
bool takes_chunk16(const PrefillCase& c) {
  cuda::pf::PrefillPlan plan;
  int sms = 0;
  return host_plan(c, &plan, &sms) && plan.rec.chunk16;
}

// The full check of one case against the fp64 reference.
void check_against_reference(const PrefillCase& c) {
  const PrefillData d = make_data(c);
  const PrefillData ref = run_reference(d);
  const GpuResult r = run_cuda(d);
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  expect_close("out", r.out, ref.out, out_tolerance(c.dtype, c.weak_decay && takes_chunk16(c)));
  const double st = state_tolerance(c.state_dtype);
  expect_close("final_state", r.ht, ref.ht, st);
  expect_close("state_pool", r.pool, ref.pool, st);
  expect_close("checkpoints", r.ckpt, ref.ckpt, st);

  // Empty sequences pass their state through unchanged (bit for bit: load and store round-trip).
  if (!d.h0.empty() && !d.ht.empty() && d.h0.dtype == d.ht.dtype)
    for (int64_t n = 0; n < d.N; ++n)
      if (d.cu_host[n + 1] == d.cu_host[n])
        EXPECT_TRUE(rows_bitwise_equal(r.ht, d.h0, n, n)) << "sequence " << n;
  // Pool slots that no sequence owns stay untouched; so does the slot of a sequence whose index
  // is -1 (it starts from zero and writes nothing).
  if (c.pool) {
    std::set<int64_t> used;
    for (int64_t n = 0; n < d.N; ++n) used.insert(static_cast<int64_t>(d.idx.get(n)));
    for (int64_t s = 0; s < d.pool.shape[0]; ++s)
      if (!used.count(s))
        EXPECT_TRUE(rows_bitwise_equal(r.pool, d.pool, s, s)) << "untouched pool slot " << s;
  }
  // Checkpoint rows that no sequence reaches stay as initialized (zero).
  if (c.checkpoint_every > 0) {
    const int64_t rows = d.ckpt.shape[0], written = static_cast<int64_t>(d.ckpt_off.get(d.N));
    for (int64_t row = written; row < rows; ++row)
      EXPECT_TRUE(rows_bitwise_equal(r.ckpt, d.ckpt, row, row));
  }
}

TEST_P(GpuPrefillSweep, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  check_against_reference(GetParam());
}

// The recurrence with and without its K split (the default for blocks of vs <= 32 value columns;
// Tuning::prefill_ksplit = false turns it off): vs = 16 (2 warps) under weak decay, where the
// state's contribution to every chunk is large, and vs = 32 (4 warps) through a pool, checkpoints,
// K-first states and varlen with an empty sequence.
TEST(GpuPrefillKSplit, MatchesReferenceWithAndWithout) {
  KDA_SKIP_WITHOUT_SM90();
  for (bool split : {true, false}) {  // the default (split), then off
    SCOPED_TRACE(split ? "K split on" : "K split off");
    PrefillCase c = base_case();
    c.gate = GateForm::kLowerBound;
    c.lower_bound = -0.05;
    c.seqlens = {300};
    {
      SCOPED_TRACE("vs = 16, weak decay");
      const detail::ScopedTuning scope(tuned([&](detail::Tuning& t) {
        t.prefill_ksplit = split;
        t.prefill_vs = 16;
      }));
      check_against_reference(c);
    }
    c = base_case();
    c.H = 4;
    c.HV = 16;
    c.varlen = true;
    c.seqlens = {129, 0};
    c.pool = true;
    c.checkpoint_every = 64;
    c.layout = StateLayout::kKFirst;
    c.weak_decay = true;
    c.gate = GateForm::kPrecomputed;
    {
      SCOPED_TRACE("vs = 32, pool, checkpoints, K-first, varlen");
      const detail::ScopedTuning scope(tuned([&](detail::Tuning& t) {
        t.prefill_ksplit = split;
        t.prefill_vs = 32;
      }));
      check_against_reference(c);
    }
  }
}

// The configurations of the wgmma recurrence's tests, against the fp64 reference: 96 heads dense
// (vs = 128 on 132 SMs: two warpgroups), 48 value heads of 12 grouped ones over the sequences
// `lens` (vs = 128; varlen, pool, checkpoints, K-first, bf16 state, weak decay), 48 heads fp16
// (vs = 64: one warpgroup); each value split forced, one segment per sequence.
void check_wgmma_configs(const std::vector<int64_t>& lens) {
  auto split = [](int vs) {
    return tuned([vs](detail::Tuning& t) {
      t.prefill_vs = vs;
      t.prefill_segment = -1;
    });
  };
  PrefillCase c = base_case();
  c.H = c.HV = 96;
  c.seqlens = {150};
  c.gate = GateForm::kLowerBound;
  {
    SCOPED_TRACE("96 heads (vs = 128), dense");
    const detail::ScopedTuning scope(split(128));
    check_against_reference(c);
  }
  c = base_case();
  c.H = 12;
  c.HV = 48;
  c.varlen = true;
  c.seqlens = lens;
  c.pool = true;
  c.checkpoint_every = 64;
  c.layout = StateLayout::kKFirst;
  c.state_dtype = DType::kBFloat16;
  c.weak_decay = true;
  c.gate = GateForm::kPrecomputed;
  {
    SCOPED_TRACE(std::to_string(lens.size()) +
                 " sequences x 48 value heads (vs = 128), grouped, varlen, pool, checkpoints, "
                 "K-first, bf16 state");
    const detail::ScopedTuning scope(split(128));
    check_against_reference(c);
  }
  c = base_case();
  c.H = c.HV = 48;
  c.dtype = DType::kFloat16;
  c.seqlens = {200};
  {
    SCOPED_TRACE("48 heads (vs = 64: one warpgroup), fp16");
    const detail::ScopedTuning scope(split(64));
    check_against_reference(c);
  }
}

// The wgmma recurrence on 64-token chunks (vs >= 64: the many-head cases; Tuning::prefill_chunk =
// 64, since vs = 128 takes the chunk-16 path by default) and its mma.sync baseline
// (Tuning::prefill_wgmma = false), both against the fp64 reference; the value split is forced
// here, and for the whole feature matrix by KDA_CUDA_PREFILL_VS in the device script's second pass
// (chunk 16 at 128 where one segment runs, chunk 64 at 64).
TEST(GpuPrefillWgmma, MatchesReferenceWithAndWithout) {
  KDA_SKIP_WITHOUT_SM90();
  for (bool wgmma : {true, false}) {
    SCOPED_TRACE(wgmma ? "wgmma" : "mma.sync");
    const detail::ScopedTuning scope(tuned([&](detail::Tuning& t) {
      t.prefill_chunk = 64;
      t.prefill_wgmma = wgmma;
    }));
    check_wgmma_configs({129, 0, 64, 7});
  }
}

// The chunk-16 path (16-token records and recurrence steps; the default at vs = 128 for a
// lower-bound gate, forced here by Tuning::prefill_chunk = 16 at vs = 64 too) on the same
// configurations, with sequences of 15, 16 and 17 tokens around the step length.
TEST(GpuPrefillChunk16, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  const detail::ScopedTuning scope(tuned([](detail::Tuning& t) { t.prefill_chunk = 16; }));
  check_wgmma_configs({129, 0, 64, 7, 15, 16, 17});
}

// The fused kernel (prefill/fused.cuh; Tuning::prefill_fused = 1 forces it wherever it applies:
// the lower-bound gate) against the fp64 reference over
// the feature matrix: empty, 1-15-token and 16-multiple sequences, pools, checkpoints, grouped
// values, K-first and 16-bit states, fp16, fp32 gate and beta, strided inputs (its scalar loads),
// no l2norm, beta without logits, negative eigenvalues, no initial state and weak decay. Each case
// is checked to take the fused plan.
std::vector<PrefillCase> fused_cases() {
  std::vector<PrefillCase> v;
  auto add = [&](auto&& edit) {
    PrefillCase c = base_case();
    c.gate = GateForm::kLowerBound;
    c.H = c.HV = 2;
    edit(c);
    v.push_back(c);
  };
  add([](PrefillCase& c) { c.seqlens = {150}; });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {0, 1, 15, 16, 17, 64, 129};
    c.pool = true;
    c.checkpoint_every = 64;
  });
  add([](PrefillCase& c) {
    c.H = 2;
    c.HV = 6;
    c.seqlens = {200, 200};
    c.checkpoint_every = 128;
    c.layout = StateLayout::kKFirst;
    c.state_dtype = DType::kBFloat16;
    c.dtype = DType::kFloat16;
  });
  add([](PrefillCase& c) {
    c.strided = true;
    c.varlen = true;
    c.seqlens = {33, 70};
  });
  add([](PrefillCase& c) {
    c.gate_beta_fp32 = true;
    c.seqlens = {100};
    c.allow_neg_eigval = true;
  });
  add([](PrefillCase& c) {
    c.seqlens = {120};
    c.beta_logits = false;
    c.l2norm = false;
    c.init = InitState::kNone;
    c.state_dtype = DType::kFloat16;
  });
  add([](PrefillCase& c) {
    c.seqlens = {160};
    c.lower_bound = -0.05;  // weak decay
  });
  add([](PrefillCase& c) {
    c.seqlens = {96};
    c.lower_bound = -1.0;
    c.dtype = DType::kFloat16;
  });
  return v;
}

TEST(GpuPrefillFused, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  const detail::ScopedTuning scope(tuned([](detail::Tuning& t) { t.prefill_fused = 1; }));
  for (const PrefillCase& c : fused_cases()) {
    SCOPED_TRACE(c.name());
    const int64_t T = case_tokens(c);
    const bool lb = c.gate == GateForm::kLowerBound;
    const cuda::pf::PrefillPlan plan =
        cuda::pf::prefill_plan(c.varlen, T, static_cast<int64_t>(c.seqlens.size()), c.HV, 132,
                               detail::tuning(), cuda::pf::weak_decay_gate(lb, c.lower_bound));
    const cuda::pf::FusedChoice f =
        cuda::pf::fused_choice(plan, T, static_cast<int64_t>(c.seqlens.size()), c.HV, 132,
                               detail::tuning(), cuda::pf::fused_applies(lb, c.lower_bound), false);
    ASSERT_TRUE(f.take);
    check_against_reference(c);
  }
}

// The segmented recurrence (heuristics/prefill.h prefill_plan; forced by
// Tuning::prefill_segment = tokens per segment) on every path it can take: the value split of its
// chains (16 / 32 with the K split, 64 / 128 on wgmma, 128 on 16-token steps), against the fp64
// reference. Segments of 64 tokens give the most segments per sequence (the scan's longest
// chain); the cases span empty, 1-15-token and exact-multiple sequences (one segment, two, many),
// pools and checkpoints (on and between segment boundaries), grouped values, K-first bf16
// states, fp16, every gate form (-1000 gates included), weak decay, negative eigenvalues and
// strided inputs.
std::vector<PrefillCase> segment_cases() {
  std::vector<PrefillCase> v;
  PrefillCase c = base_case();
  c.seqlens = {700};
  c.H = c.HV = 1;
  c.gate = GateForm::kLowerBound;
  v.push_back(c);
  c = base_case();
  c.varlen = true;
  c.seqlens = {0, 1, 15, 64, 65, 128, 450};
  c.pool = true;
  c.checkpoint_every = 64;
  v.push_back(c);
  c = base_case();
  c.H = 2;
  c.HV = 6;
  c.seqlens = {200, 200};
  c.checkpoint_every = 128;
  c.layout = StateLayout::kKFirst;
  c.state_dtype = DType::kBFloat16;
  c.dtype = DType::kFloat16;
  v.push_back(c);
  c = base_case();
  c.seqlens = {333};
  c.gate = GateForm::kPrecomputed;
  c.gate_extreme = -1000;
  c.allow_neg_eigval = true;
  c.strided = true;
  v.push_back(c);
  c = base_case();
  c.seqlens = {400};
  c.gate = GateForm::kPrecomputed;
  c.weak_decay = true;
  c.beta_logits = false;
  c.l2norm = false;
  c.init = InitState::kNone;
  v.push_back(c);
  return v;
}

TEST(GpuPrefillSegments, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  struct Config {
    int tokens, vs, chunk;
  };
  for (const Config cfg : {Config{64, 16, 0}, Config{128, 32, 0}, Config{64, 64, 0},
                           Config{192, 128, 0}, Config{64, 128, 16}}) {
    SCOPED_TRACE("segments of " + std::to_string(cfg.tokens) + " tokens, vs = " +
                 std::to_string(cfg.vs) + (cfg.chunk == 16 ? ", 16-token steps" : ""));
    const detail::ScopedTuning scope(tuned([&](detail::Tuning& t) {
      t.prefill_segment = cfg.tokens;
      t.prefill_vs = cfg.vs;
      t.prefill_chunk = cfg.chunk;
    }));
    for (const PrefillCase& c : segment_cases()) {
      SCOPED_TRACE(c.name());
      check_against_reference(c);
    }
  }
}

// The fused kernel's segmented passes (pass 1 over segments and transitions, the scan, pass 2),
// forced with segments of 64 tokens (the most segments: the scan's longest chain) and 192, over
// the segment cases: those of a lower-bound gate run the fused passes, the others (softplus,
// precomputed and -1000 gates) the two-kernel plan.
TEST(GpuPrefillFused, Segments) {
  KDA_SKIP_WITHOUT_SM90();
  for (int tokens : {64, 192}) {
    SCOPED_TRACE("segments of " + std::to_string(tokens) + " tokens");
    const detail::ScopedTuning scope(tuned([&](detail::Tuning& t) {
      t.prefill_fused = 1;
      t.prefill_segment = tokens;
    }));
    for (PrefillCase c : segment_cases()) {
      SCOPED_TRACE(c.name());
      check_against_reference(c);
    }
    for (PrefillCase c : fused_cases()) {
      SCOPED_TRACE(c.name());
      check_against_reference(c);
    }
  }
}

// Warm-up segments (heuristics/prefill.h fused_choice, prefill/fused.cuh fused_warm_start),
// forced with segments of 64 tokens (the most walks), against the fp64 reference, with the walks
// counted (cuda::prefill_warm_counts) so that each case is known to have taken the path it tests:
// under strong decay (lower bound -5, random gates) the segments far enough from their sequence's
// start run from a zero state after a warm-up and none is left to the exact passes; a slow key
// channel (dt_bias -30 in the last value head: that channel never decays, so no bound is reached)
// leaves that head's late segments to the exact passes while the other head stays warm. The cases
// are the fused kernel's (those warm-up segments apply to: l2norm, beta logits, lower bound -5)
// with every sequence of 64 tokens or more 700 tokens longer: varlen batches with empty,
// 1-15-token and long sequences, a state pool, checkpoints, grouped values, K-first 16-bit
// states, fp16, fp32 gate and beta, strided inputs and negative eigenvalues. Each case runs with
// the bound at 2^-16 of the dropped state and at the loosest the knob takes (2^-10,
// Tuning::prefill_warm_bits; 2^-12 by default), which must still hold the reference tolerances.
std::vector<PrefillCase> warm_cases() {
  std::vector<PrefillCase> v;
  for (PrefillCase c : fused_cases()) {  // those warm-up segments apply to, lengthened
    if (!c.l2norm || !c.beta_logits || c.lower_bound != -5.0) continue;
    for (int64_t& len : c.seqlens)
      if (len >= 64) len += 700;
    v.push_back(c);
  }
  PrefillCase slow = v.front();
  slow.seqlens = {1100};
  slow.slow_channel_dt = -30;
  v.push_back(slow);
  return v;
}

TEST(GpuPrefillWarm, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  for (const int bits : {16, 10})
    for (const PrefillCase& c : warm_cases()) {
      SCOPED_TRACE(c.name() + ", 2^-" + std::to_string(bits));
      const detail::ScopedTuning scope(tuned([bits](detail::Tuning& t) {
        t.prefill_warm = 1;
        t.prefill_segment = 64;
        t.prefill_warm_bits = bits;
      }));
      unsigned long long before[3] = {}, after[3] = {};
      ASSERT_TRUE(cuda::prefill_warm_counts(0, before).ok());
      check_against_reference(c);
      ASSERT_TRUE(cuda::prefill_warm_counts(0, after).ok());
      EXPECT_GT(after[1], before[1]) << "no segment ran from a warm-up";
      if (c.slow_channel_dt != 0)
        EXPECT_GT(after[2], before[2]) << "no segment went to the exact passes";
      else
        EXPECT_EQ(after[2], before[2]) << "segments went to the exact passes";
    }
}

// The single launch (prefill/single.cuh; heuristics/prefill.h single_launch: prepare and
// recurrence blocks in one cooperative launch where both fit one per SM) over the fused kernel's
// feature matrix and the segment cases (one segment per sequence here), on the plan's own value
// split and on 64- and 16-token records at vs = 64 and 128: each case takes the single launch,
// matches the fp64 reference and equals the two launches (Tuning::prefill_single off) bit for bit.
bool takes_single(const PrefillCase& c) {
  cuda::pf::PrefillPlan plan;
  int sms = 0;
  if (!host_plan(c, &plan, &sms)) return false;
  const int64_t N = static_cast<int64_t>(c.seqlens.size());
  return cuda::pf::single_launch(
      plan, cuda::pf::prefill_chunk_slots(c.varlen, N, case_tokens(c), N) * c.HV,
      N * c.HV * (128 / plan.rec.vs), sms, detail::tuning());
}

TEST(GpuPrefillSingle, MatchesReferenceAndTwoLaunches) {
  KDA_SKIP_WITHOUT_SM90();
  std::vector<PrefillCase> cases = fused_cases();
  for (const PrefillCase& c : segment_cases()) cases.push_back(c);
  struct Config {
    int vs, chunk;
  };
  for (const Config cfg : {Config{0, 0}, Config{64, 64}, Config{128, 64}, Config{128, 16}}) {
    SCOPED_TRACE("vs = " + std::to_string(cfg.vs) + ", chunk = " + std::to_string(cfg.chunk));
    auto config = [cfg](bool single) {
      return tuned([cfg, single](detail::Tuning& t) {
        t.prefill_vs = cfg.vs;
        t.prefill_chunk = cfg.chunk;
        t.prefill_segment = -1;
        t.prefill_fused = -1;
        t.prefill_single = single;
      });
    };
    for (const PrefillCase& c : cases) {
      SCOPED_TRACE(c.name());
      const PrefillData d = make_data(c);
      GpuResult one, two;
      {
        const detail::ScopedTuning scope(config(true));
        ASSERT_TRUE(takes_single(c));
        check_against_reference(c);
        one = run_cuda(d);
      }
      {
        const detail::ScopedTuning scope(config(false));
        ASSERT_FALSE(takes_single(c));
        two = run_cuda(d);
      }
      ASSERT_TRUE(one.status.ok() && two.status.ok());
      EXPECT_TRUE(bitwise_equal(one.out, two.out));
      EXPECT_TRUE(bitwise_equal(one.ht, two.ht));
      EXPECT_TRUE(bitwise_equal(one.pool, two.pool));
      EXPECT_TRUE(bitwise_equal(one.ckpt, two.ckpt));
    }
  }
}

// The graph launch of a call's kernels (common/graph_launch.h; Tuning::prefill_graph): the fused
// kernel's feature matrix on two launches and the segment cases on four (forced 64-token
// segments), one after another on the legacy stream and on a stream of the test's own, so that
// each stream's cached graph is updated with other kernels, grids and parameters on every call;
// each run matches the fp64 reference and equals one launch per kernel bit for bit.
TEST(GpuPrefillGraph, MatchesReferenceAndDirectLaunches) {
  KDA_SKIP_WITHOUT_SM90();
  cudaStream_t own;
  KDA_TEST_CUDA(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  struct Run {
    PrefillCase c;
    int segment;
  };
  std::vector<Run> runs;
  for (const PrefillCase& c : fused_cases()) runs.push_back({c, -1});
  for (const PrefillCase& c : segment_cases()) runs.push_back({c, 64});
  int i = 0;
  for (const Run& run : runs) {
    SCOPED_TRACE(run.c.name() + ", segment " + std::to_string(run.segment));
    cudaStream_t stream = (i++ % 2 == 0) ? nullptr : own;
    auto config = [&run](bool graph) {
      return tuned([&run, graph](detail::Tuning& t) {
        t.prefill_segment = run.segment;
        t.prefill_fused = -1;
        t.prefill_graph = graph;
      });
    };
    const PrefillData d = make_data(run.c);
    GpuResult graph, direct;
    {
      const detail::ScopedTuning scope(config(true));
      check_against_reference(run.c);
      const unsigned long long before = cuda::chain_launch_count();
      graph = run_cuda(d, stream);
      EXPECT_EQ(cuda::chain_launch_count(), before + 1) << "the call did not take the graph launch";
    }
    {
      const detail::ScopedTuning scope(config(false));
      const unsigned long long before = cuda::chain_launch_count();
      direct = run_cuda(d, stream);
      EXPECT_EQ(cuda::chain_launch_count(), before);
    }
    ASSERT_TRUE(graph.status.ok() && direct.status.ok());
    EXPECT_TRUE(bitwise_equal(graph.out, direct.out));
    EXPECT_TRUE(bitwise_equal(graph.ht, direct.ht));
    EXPECT_TRUE(bitwise_equal(graph.pool, direct.pool));
    EXPECT_TRUE(bitwise_equal(graph.ckpt, direct.ckpt));
  }
  cudaStreamDestroy(own);
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuPrefillSweep, ::testing::ValuesIn(sweep_cases()),
                         [](const ::testing::TestParamInfo<PrefillCase>& info) {
                           return test_name(info.param.name());
                         });

// ---------------------------------------------------------------------------------------------
// Single tests
// ---------------------------------------------------------------------------------------------

TEST(GpuPrefillSmoke, DenseBf16) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.seqlens = {130, 130};
  c.gate = GateForm::kLowerBound;
  const PrefillData d = make_prefill(c);
  const PrefillData ref = run_reference(d);
  const GpuResult r = run_cuda(d);
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  expect_close("out", r.out, ref.out, out_tolerance(c.dtype));
  expect_close("final_state", r.ht, ref.ht, state_tolerance(c.state_dtype));
}

TEST(GpuPrefillSmoke, VarlenPoolCheckpointsStrided) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.varlen = true;
  c.seqlens = {0, 1, 70, 128};
  c.pool = true;
  c.checkpoint_every = 64;
  c.strided = true;
  c.layout = StateLayout::kKFirst;
  c.state_dtype = DType::kBFloat16;
  c.H = 1;
  c.HV = 2;
  const PrefillData d = make_prefill(c);
  const PrefillData ref = run_reference(d);
  const GpuResult r = run_cuda(d);
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  expect_close("out", r.out, ref.out, out_tolerance(c.dtype));
  expect_close("state_pool", r.pool, ref.pool, state_tolerance(c.state_dtype));
  expect_close("checkpoints", r.ckpt, ref.ckpt, state_tolerance(c.state_dtype));
}

// The prepare kernel's opt-in L2 prefetch (a hint) at distance 1, so that small grids exercise
// it (dense and varlen, where it guesses past a sequence's end), and explicitly off: results
// bitwise the same as the default (off), and within the reference tolerance.
TEST(GpuPrefillSmokePrefetch, HintChangesNothing) {
  KDA_SKIP_WITHOUT_SM90();
  for (bool varlen : {false, true}) {
    SCOPED_TRACE(varlen ? "varlen" : "dense");
    PrefillCase c = base_case();
    c.varlen = varlen;
    c.seqlens = varlen ? std::vector<int64_t>{70, 0, 130, 5} : std::vector<int64_t>{200, 200};
    const PrefillData d = make_prefill(c);
    const PrefillData ref = run_reference(d);
    GpuResult base;
    {
      const detail::ScopedTuning scope(tuned([](detail::Tuning& t) { t.prefill_prefetch = 0; }));
      base = run_cuda(d);
    }
    ASSERT_TRUE(base.status.ok()) << base.status.to_string();
    expect_close("out", base.out, ref.out, out_tolerance(c.dtype));
    for (int distance : {1, 0}) {
      SCOPED_TRACE("prefetch distance " + std::to_string(distance));
      const detail::ScopedTuning scope(
          tuned([&](detail::Tuning& t) { t.prefill_prefetch = distance; }));
      const GpuResult r = run_cuda(d);
      ASSERT_TRUE(r.status.ok()) << r.status.to_string();
      EXPECT_TRUE(bitwise_equal(r.out, base.out));
      EXPECT_TRUE(bitwise_equal(r.ht, base.ht));
    }
  }
}

// Prefill over T tokens, then one decode step, both on the GPU, equals prefill over T + 1 tokens:
// the decode reads the prefill's final state (a [B, HV, V, K] fp32 tensor used as the pool, row n
// = sequence n) and updates it in place. The decoded token and state are checked against the fp64
// reference of the longer prefill (the prefill's tolerances: the decode step itself is fp32-exact)
// and against the GPU's own longer prefill. T = 1, 64 (a chunk boundary), 100.
TEST(GpuPrefillDecode, DecodeAfterPrefillEqualsLongerPrefill) {
  KDA_SKIP_WITHOUT_SM90();
  for (int64_t T : {1, 64, 100}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    PrefillCase c = base_case();
    c.seqlens = {T + 1, T + 1};
    c.H = 2;
    c.HV = 4;
    c.gate = GateForm::kLowerBound;
    const PrefillData d = make_prefill(c);
    const PrefillData ref = run_reference(d);
    const GpuResult full = run_cuda(d);
    ASSERT_TRUE(full.status.ok()) << full.status.to_string();

    // The prefix: views of the first T tokens of the same device inputs; final state into ht.
    DeviceData dd(d);
    const PrefillParams whole = dd.p;
    for (TensorView* t : {&dd.p.q, &dd.p.k, &dd.p.v, &dd.p.g, &dd.p.beta, &dd.p.out})
      t->shape[1] = T;
    size_t bytes = 0;
    ASSERT_TRUE(prefill_workspace_size(dd.p, &bytes).ok());
    DeviceBuffer ws(bytes);
    dd.p.exec.workspace = ws.ptr;
    dd.p.exec.workspace_bytes = bytes;
    Status s = prefill(dd.p);
    ASSERT_TRUE(s.ok()) << s.to_string();

    // Token T, decoded from the prefix's final state in place.
    DecodeParams dp = decode_inputs_of_token(whole, T);
    HostTensor out1(d.out.dtype, {2, 1, c.HV, c.V});
    DeviceTensor dout(out1);
    dp.out = dout.view();
    dp.state = dd.ht->view();
    dp.exec.backend = Backend::kCuda;
    s = decode(dp);
    ASSERT_TRUE(s.ok()) << s.to_string();
    KDA_TEST_CUDA(cudaDeviceSynchronize());
    dout.download(out1);
    HostTensor state;
    download(dd.ht, d.ht, &state);

    // Token T of the longer prefill: the reference's and the GPU's.
    HostTensor ref_last(DType::kFloat32, {2, 1, c.HV, c.V}),
        gpu_last(DType::kFloat32, {2, 1, c.HV, c.V});
    for (int64_t n = 0; n < 2; ++n)
      for (int64_t i = 0; i < c.HV * c.V; ++i) {
        const int64_t src = (n * (T + 1) + T) * c.HV * c.V + i;
        ref_last.set(n * c.HV * c.V + i, ref.out.get(src));
        gpu_last.set(n * c.HV * c.V + i, full.out.get(src));
      }
    expect_close("decoded token vs reference", out1, ref_last, out_tolerance(c.dtype));
    expect_close("state vs reference", state, ref.ht, state_tolerance(c.state_dtype));
    expect_close("decoded token vs GPU prefill", out1, gpu_last, 2 * out_tolerance(c.dtype));
    expect_close("state vs GPU prefill", state, full.ht, 2 * state_tolerance(c.state_dtype));
  }
}

TEST(GpuPrefill, BitwiseDeterministic) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.varlen = true;
  c.seqlens = {300, 17, 64};
  c.checkpoint_every = 64;
  const PrefillData d = make_prefill(c);
  const GpuResult a = run_cuda(d), b = run_cuda(d);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.ht, b.ht));
  EXPECT_TRUE(bitwise_equal(a.ckpt, b.ckpt));
}

// The accuracy bar of targets.md (case A): 1 x 8192 tokens, H = 8, bf16 inputs, initial state
// 0.05 randn (bf16-exact); output <= 2.5e-3 and final state <= 2.0e-3 rel L2 vs the fp64
// recurrence. Gate: lower bound -5 (A_log, dt_bias ~ U(0, 1)), the softplus form, weak decay.
constexpr double kOutputBar = 2.5e-3, kStateBar = 2.0e-3;

// The accuracy check of case A's shape: the initial state halved (bf16-exact), the CUDA prefill
// against the fp64 reference, the output within out_bar and the final state within kStateBar.
void check_accuracy(PrefillData d, const char* name, double out_bar) {
  for (int64_t i = 0; i < d.h0.numel(); ++i)
    d.h0.set(i, detail::bf16_bits_to_float(
                    detail::float_to_bf16_bits(static_cast<float>(0.5 * d.h0.get(i)))));
  const PrefillData ref = run_reference(d);
  const GpuResult r = run_cuda(d);
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const Compare co = compare(r.out, ref.out, out_bar), cs = compare(r.ht, ref.ht, kStateBar);
  std::printf("  %s: output rel L2 %.3e, final state rel L2 %.3e\n", name, co.rel_l2, cs.rel_l2);
  EXPECT_TRUE(co.ok(out_bar)) << "output rel_l2 " << co.rel_l2 << co.first_mismatches;
  EXPECT_TRUE(cs.ok(kStateBar)) << "final state rel_l2 " << cs.rel_l2 << cs.first_mismatches;
}

// The 16-token path forced, one segment per sequence.
detail::Tuning chunk16_tuning() {
  return tuned([](detail::Tuning& t) {
    t.prefill_vs = 128;
    t.prefill_chunk = 16;
    t.prefill_segment = -1;
  });
}

void accuracy_case_a(GateForm gate, double lower_bound, const char* label = "",
                     int64_t tokens = 8192, int64_t heads = 8) {
  PrefillCase c = base_case();
  c.seqlens = {tokens};
  c.H = heads;
  c.HV = heads;
  c.gate = gate;
  c.lower_bound = lower_bound;
  c.beta_logits = true;
  c.seed = 2026;
  // The 16-token path under weak decay: the known output gap (see CaseAChunk16 below).
  const double out_bar = lower_bound > -1.0 && takes_chunk16(c) ? 4.5e-3 : kOutputBar;
  char name[96];
  std::snprintf(name, sizeof(name), "case A%s (gate %d, lb %g)", label, static_cast<int>(gate),
                lower_bound);
  check_accuracy(make_prefill(c), name, out_bar);
}

TEST(GpuPrefillAccuracy, CaseALowerBound) {
  KDA_SKIP_WITHOUT_SM90();
  accuracy_case_a(GateForm::kLowerBound, -5.0);
}
TEST(GpuPrefillAccuracy, CaseASoftplus) {
  KDA_SKIP_WITHOUT_SM90();
  accuracy_case_a(GateForm::kSoftplus, -5.0);
}
TEST(GpuPrefillAccuracy, CaseAWeakDecay) {
  KDA_SKIP_WITHOUT_SM90();
  accuracy_case_a(GateForm::kLowerBound, -0.05);
}

// The same bar on the chunk-16 path (forced, one segment per sequence: case A takes segments on
// 64-token steps by default), whose
// 16-token steps multiply the state by bf16 operands four times as often as chunk 64 does. Under
// weak decay its output misses the output bar (2.85e-3 measured on the H200): that case is held
// to the previous bar, 4.5e-3, until the output product takes S^T in two bf16 terms
// (docs/design.md, section 6).
TEST(GpuPrefillAccuracy, CaseAChunk16) {
  KDA_SKIP_WITHOUT_SM90();
  const detail::ScopedTuning scope(chunk16_tuning());
  accuracy_case_a(GateForm::kLowerBound, -5.0, ", chunk 16");
  accuracy_case_a(GateForm::kSoftplus, -5.0, ", chunk 16");
  accuracy_case_a(GateForm::kLowerBound, -0.05, ", chunk 16");
}

// Case A's shape with the softplus gate at a Kimi-Linear / Mamba-style initialization: A_log =
// log A, A ~ U(1, 16); dt_bias = softplus^-1(dt), dt log-uniform in [0.001, 0.1]. Per-token log
// decays are then -A softplus(g + dt_bias), mostly between -1 and -0.001: weak decay, from the
// data. The default plan takes 64-token steps for it (heuristics/prefill.h weak_decay_gate); the
// 16-token path, forced, misses the output bar there (2.92e-3 in emulation) and is held to the
// bar of CaseAChunk16's weak-decay case.
void accuracy_kimi_gate(const char* label, double out_bar) {
  PrefillCase c = base_case();
  c.seqlens = {8192};
  c.H = c.HV = 8;
  c.gate = GateForm::kSoftplus;
  c.beta_logits = true;
  c.seed = 2027;
  PrefillData d = make_prefill(c);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t i = 0; i < d.A_log.numel(); ++i) d.A_log.set(i, std::log(1.0 + 15.0 * u(rng)));
  for (int64_t i = 0; i < d.dt_bias.numel(); ++i) {
    const double dt = std::exp(std::log(1e-3) + (std::log(0.1) - std::log(1e-3)) * u(rng));
    d.dt_bias.set(i, std::log(std::expm1(dt)));
  }
  check_accuracy(std::move(d), (std::string("Kimi gate init") + label).c_str(), out_bar);
}

TEST(GpuPrefillAccuracy, KimiGateInit) {
  KDA_SKIP_WITHOUT_SM90();
  accuracy_kimi_gate("", kOutputBar);
}
TEST(GpuPrefillAccuracy, KimiGateInitChunk16) {
  KDA_SKIP_WITHOUT_SM90();
  const detail::ScopedTuning scope(chunk16_tuning());
  accuracy_kimi_gate(", chunk 16", 4.5e-3);
}

// One sequence of 65536 tokens on two heads: many segments by default (heuristics/prefill.h),
// every segment's start through the scan; the bars of case A.
TEST(GpuPrefillAccuracy, LongSequenceManySegments) {
  KDA_SKIP_WITHOUT_SM90();
  accuracy_case_a(GateForm::kLowerBound, -5.0, ", 64k tokens", 65536, 2);
  accuracy_case_a(GateForm::kLowerBound, -0.05, ", 64k tokens", 65536, 2);
}

// Error does not grow with the sequence length (the state stays fp32).
TEST(GpuPrefillAccuracy, ErrorFlatInLength) {
  KDA_SKIP_WITHOUT_SM90();
  double err[2];
  const int64_t lens[2] = {512, 4096};
  for (int i = 0; i < 2; ++i) {
    PrefillCase c = base_case();
    c.seqlens = {lens[i]};
    c.H = 2;
    c.HV = 2;
    c.gate = GateForm::kLowerBound;
    c.lower_bound = -0.05;
    const PrefillData d = make_prefill(c);
    const PrefillData ref = run_reference(d);
    const GpuResult r = run_cuda(d);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    err[i] = compare(r.out, ref.out, 1).rel_l2;
  }
  EXPECT_LT(err[1], 1.5 * err[0] + 2e-4) << "T=512: " << err[0] << ", T=4096: " << err[1];
}

// Captured into a CUDA graph and replayed: same result as a direct call (no allocation or
// synchronization inside the call).
TEST(GpuPrefill, CudaGraphCapture) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.varlen = true;
  c.seqlens = {100, 64, 0, 31};
  c.final_state = true;
  const PrefillData d = make_prefill(c);
  const GpuResult direct = run_cuda(d);
  ASSERT_TRUE(direct.status.ok()) << direct.status.to_string();

  DeviceData dd(d);
  size_t bytes = 0;
  ASSERT_TRUE(prefill_workspace_size(dd.p, &bytes).ok());
  DeviceBuffer ws(bytes);
  cudaStream_t stream;
  KDA_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  dd.p.exec.workspace = ws.ptr;
  dd.p.exec.workspace_bytes = bytes;
  dd.p.exec.stream = stream;
  const Status s = capture_and_replay(stream, [&] { return prefill(dd.p); });
  ASSERT_TRUE(s.ok()) << s.to_string();
  HostTensor out = d.out, ht = d.ht;
  dd.out->download(out);
  dd.ht->download(ht);
  EXPECT_TRUE(bitwise_equal(out, direct.out));
  EXPECT_TRUE(bitwise_equal(ht, direct.ht));
  cudaStreamDestroy(stream);
}

TEST(GpuPrefill, WorkspaceTooSmall) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.seqlens = {100};
  const PrefillData d = make_prefill(c);
  DeviceData dd(d);
  size_t bytes = 0;
  ASSERT_TRUE(prefill_workspace_size(dd.p, &bytes).ok());
  ASSERT_GT(bytes, 0u);
  DeviceBuffer ws(bytes);
  dd.p.exec.workspace = ws.ptr;
  dd.p.exec.workspace_bytes = bytes - 1;
  Status s = prefill(dd.p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.argument(), "workspace") << s.message();
  dd.p.exec.workspace = nullptr;
  dd.p.exec.workspace_bytes = 0;
  s = prefill(dd.p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  // Nothing was written: the output is still the poison pattern.
  HostTensor out = d.out;
  dd.out->download(out);
  EXPECT_TRUE(bitwise_equal(out, d.out));
}

// check_indices on CUDA tensors: the indices are copied to the host and checked before anything
// runs; a slot >= P or one slot shared by two sequences is an error naming state_indices, and
// nothing is written (output and pool untouched). A valid call with the check passes.
TEST(GpuPrefill, CheckIndicesOnCudaTensors) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.varlen = true;
  c.seqlens = {40, 70, 30};
  c.pool = true;
  PrefillData d = make_prefill(c);
  const int64_t P = d.pool.shape[0];
  for (int bad = 0; bad < 3; ++bad) {
    PrefillData e = d;
    e.idx.set(0, 0);
    e.idx.set(1, 1);
    e.idx.set(2, bad == 0 ? P : (bad == 1 ? 0 : 2));  // out of range, shared with sequence 0, valid
    DeviceData dd(e);
    dd.p.check_indices = true;
    size_t bytes = 0;
    ASSERT_TRUE(prefill_workspace_size(dd.p, &bytes).ok());
    DeviceBuffer ws(bytes);
    dd.p.exec.workspace = ws.ptr;
    dd.p.exec.workspace_bytes = bytes;
    const Status s = prefill(dd.p);
    if (bad == 2) {
      EXPECT_TRUE(s.ok()) << s.to_string();
      continue;
    }
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_EQ(s.argument(), "state_indices") << s.message();
    HostTensor out = e.out, pool = e.pool;
    dd.out->download(out);
    dd.pool->download(pool);
    EXPECT_TRUE(bitwise_equal(out, e.out)) << "output written by a refused call";
    EXPECT_TRUE(bitwise_equal(pool, e.pool)) << "pool written by a refused call";
  }
}

TEST(GpuPrefill, UnsupportedHeadDim) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.K = 64;
  c.V = 64;
  c.seqlens = {10};
  const PrefillData d = make_prefill(c);
  DeviceData dd(d);
  const Status s = prefill(dd.p);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("'q'"), std::string::npos) << s.message();
}

TEST(GpuPrefill, UnsupportedFp32Inputs) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.dtype = DType::kFloat32;
  c.seqlens = {10};
  const PrefillData d = make_prefill(c);
  DeviceData dd(d);
  const Status s = prefill(dd.p);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("'q'"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace kda::test
