// test_gpu_decode.cpp — the CUDA decode (src/cuda/decode/) against the fp64 CPU reference
// on the same inputs: outputs, state pool, final and per-token states; untouched pool slots stay
// bit-identical; reruns are bitwise deterministic; error paths write nothing.
//
// Every test skips without an sm_90 GPU. Tests with "Smoke" in the name are the small subset run
// under compute-sanitizer (ctest -L smoke).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/problem.h"
#include "core/tuning.h"
#include "cpu/access.h"
#include "cpu/backends.h"
#include "gpu_support.h"
#include "support.h"

namespace {

using namespace kda;
using namespace kda::test;

// ---------------------------------------------------------------------------------------------
// Case: a DecodeCase (make_decode) plus the options DecodeCase does not carry
// ---------------------------------------------------------------------------------------------

struct GpuDecodeCase {
  DecodeCase c;
  bool l2norm = true;
  std::optional<double> scale;
  float lower_bound = -5.0f;
  bool g_fp32 = false, beta_fp32 = false, dt_bias_bf16 = false;
  bool no_gate_params = false;  // softplus / lower-bound gate without A_log and dt_bias
  int strided = 0;  // 1: padded (unaligned) input strides; 2: padded 16-byte-aligned strides
  bool state_strided = false;    // pool with padded (unaligned) strides: no 16-byte vectors
  bool drop_token_slot = false;  // [N, T] indices: one row's last write slot is -1 (skipped)
  bool baseline = false;         // run the baseline kernel (Tuning::decode_kernel)
  bool tile = false;             // run the tile kernel where the staged one would run (=tile)
  bool staged = false;           // force the staged tile kernel (=staged; where eligible)
  bool bulk = false;             // force the bulk kernel (=bulk; where eligible)
  bool bulklat = false;          // force the bulk kernel's latency variant (=bulklat; dense T = 1)
  int warp = 0;                  // force the warp kernel (=warp) with 4 / 8 / 16 rows per warp
  bool single = false;           // force the single-token kernel (=single; dense T = 1)
  detail::DecodeStateCache warp_cache = detail::DecodeStateCache::kAuto;  // its L2 policy
  bool state_aligned_pad =
      false;          // pool rows padded by 8 elements: 16-byte aligned, not contiguous
  int pad_every = 0;  // [N] indices: every pad_every-th row (from row 1) is a padding row

  std::string name() const {
    std::string s = c.name();
    if (!l2norm) s += "_nol2";
    if (scale) s += "_scale";
    if (lower_bound != -5.0f) s += "_lb";
    if (g_fp32) s += "_gf32";
    if (beta_fp32) s += "_betaf32";
    if (dt_bias_bf16) s += "_biasbf16";
    if (no_gate_params) s += "_noAdt";
    if (strided == 1) s += "_strided";
    if (strided == 2) s += "_stridedal";
    if (state_strided) s += "_ststrided";
    if (drop_token_slot) s += "_dropslot";
    if (baseline) s += "_baseline";
    if (tile) s += "_tile";
    if (staged) s += "_staged";
    if (bulk) s += "_bulk";
    if (bulklat) s += "_bulklat";
    if (warp > 0) s += "_warp" + std::to_string(warp);
    if (single) s += "_single";
    if (warp_cache == detail::DecodeStateCache::kNormal) s += "_l2normal";
    if (warp_cache == detail::DecodeStateCache::kStream) s += "_l2stream";
    if (state_aligned_pad) s += "_stpadal";
    if (pad_every > 0) s += "_padevery" + std::to_string(pad_every);
    for (char& ch : s)
      if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    return s;
  }
};

void PrintTo(const GpuDecodeCase& c, std::ostream* os) { *os << c.name(); }

// A copy of `src` whose rows (last dimension) are padded by `pad` elements: every leading stride
// grows; with pad a multiple of 8 the rows stay 16-byte aligned.
HostTensor restride(const HostTensor& src, int64_t pad, uint8_t fill) {
  HostTensor r;
  r.dtype = src.dtype;
  r.shape = src.shape;
  const int n = static_cast<int>(src.shape.size());
  r.strides.assign(n, 1);
  int64_t inner = src.shape[n - 1] + pad;
  for (int i = n - 2; i >= 0; --i) {
    r.strides[i] = inner;
    inner *= std::max<int64_t>(src.shape[i], 1);
  }
  r.storage.assign(static_cast<size_t>(inner) * dtype_size(src.dtype), fill);
  const size_t es = dtype_size(src.dtype);
  for (int64_t i = 0; i < src.numel(); ++i)
    std::memcpy(r.storage.data() + r.offset(i) * es, src.storage.data() + src.offset(i) * es, es);
  return r;
}

// Same values, padded (unaligned) strides, byte-exact.
HostTensor pad_unaligned(const HostTensor& src, uint8_t fill) {
  HostTensor r(src.dtype, src.shape, /*padded=*/true);
  r.fill_bytes(fill);
  const size_t es = dtype_size(src.dtype);
  for (int64_t i = 0; i < src.numel(); ++i)
    std::memcpy(r.storage.data() + r.offset(i) * es, src.storage.data() + src.offset(i) * es, es);
  return r;
}

DecodeData make_data(const GpuDecodeCase& gc) {
  DecodeData d = make_decode(gc.c);
  if (gc.g_fp32) d.g = d.g.to(DType::kFloat32);
  if (gc.beta_fp32) d.beta = d.beta.to(DType::kFloat32);
  if (gc.dt_bias_bf16 && !d.dt_bias.empty()) d.dt_bias = d.dt_bias.to(DType::kBFloat16);
  if (gc.no_gate_params) d.A_log = d.dt_bias = HostTensor();
  for (HostTensor* t : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.out}) {
    const uint8_t fill = t == &d.out ? 0xff : 0x00;
    if (gc.strided == 1) *t = pad_unaligned(*t, fill);
    if (gc.strided == 2) *t = restride(*t, 8, fill);
  }
  if (gc.state_strided) d.state = pad_unaligned(d.state, 0x00);
  if (gc.state_aligned_pad) d.state = restride(d.state, 8, 0x00);
  if (gc.pad_every > 0 && d.idx.shape.size() == 1)
    for (int64_t n = 1; n < d.N; n += gc.pad_every) d.idx.set(n, -1);
  if (gc.drop_token_slot && d.idx.shape.size() == 2 && d.N >= 2 && d.idx.shape[1] >= 2) {
    const int64_t cols = d.idx.shape[1];
    const int64_t read_col = d.nat.empty() ? 0 : static_cast<int64_t>(d.nat.get(1)) - 1;
    const int64_t col = read_col == cols - 1 ? 0 : cols - 1;
    d.idx.set(1 * cols + col, -1);
  }
  return d;
}

void apply_options(DecodeParams& p, const GpuDecodeCase& gc) {
  p.math.use_qk_l2norm = gc.l2norm;
  if (gc.scale) p.math.scale = gc.scale;
  p.math.lower_bound = gc.lower_bound;
}

// Forces the case's kernel (Tuning::decode_kernel: baseline / tile / staged / bulk / bulklat /
// warp, with the warp kernel's rows and L2 policy) while alive.
class KernelChoice {
 public:
  explicit KernelChoice(const GpuDecodeCase& gc) : scope_(choice(gc)) {}

 private:
  static detail::Tuning choice(const GpuDecodeCase& gc) {
    using O = detail::DecodeKernelOverride;
    detail::Tuning t = detail::tuning();
    if (gc.baseline || gc.tile) t.decode_kernel = gc.baseline ? O::kBaseline : O::kTile;
    if (gc.staged) t.decode_kernel = O::kStaged;
    if (gc.bulk) t.decode_kernel = O::kBulk;
    if (gc.bulklat) t.decode_kernel = O::kBulkLatency;
    if (gc.warp > 0) {
      t.decode_kernel = O::kWarp;
      t.decode_warp_rows = gc.warp;
    }
    if (gc.single) t.decode_kernel = O::kSingle;
    t.decode_warp_cache = gc.warp_cache;
    return t;
  }
  detail::ScopedTuning scope_;
};

// Device copies of every tensor of a DecodeData, and the DecodeParams that point at them.
struct DeviceDecode {
  std::unique_ptr<DeviceTensor> q, k, v, g, beta, A_log, dt_bias, cu, out, state, idx, nat,
      final_state, inter;
  DecodeParams p;

  DeviceDecode(const DecodeData& d, const GpuDecodeCase& gc) {
    p = d.params();
    auto up = [](const HostTensor& h, std::unique_ptr<DeviceTensor>& dt) -> TensorView {
      if (h.empty()) return TensorView{};
      dt = std::make_unique<DeviceTensor>(h);
      return dt->view();
    };
    p.q = up(d.q, q);
    p.k = up(d.k, k);
    p.v = up(d.v, v);
    p.g = up(d.g, g);
    p.beta = up(d.beta, beta);
    p.A_log = up(d.A_log, A_log);
    p.dt_bias = up(d.dt_bias, dt_bias);
    p.cu_seqlens = up(d.cu, cu);
    p.out = up(d.out, out);
    p.state = up(d.state, state);
    p.state_indices = up(d.idx, idx);
    p.num_accepted_tokens = up(d.nat, nat);
    p.final_state = up(d.final_state, final_state);
    p.intermediate_states = up(d.inter, inter);
    apply_options(p, gc);
    p.exec.backend = Backend::kCuda;
  }

  // Copies the outputs back into `r` (a copy of the host inputs with the same layouts).
  void download(DecodeData& r) const {
    out->download(r.out);
    state->download(r.state);
    if (final_state) final_state->download(r.final_state);
    if (inter) inter->download(r.inter);
  }
};

// Runs the GPU decode on device copies of d; returns the downloaded results.
DecodeData run_gpu(const DecodeData& d, const GpuDecodeCase& gc, Status* status = nullptr) {
  DeviceDecode dev(d, gc);
  Status s;
  {
    KernelChoice kc(gc);
    s = decode(dev.p);
  }
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  DecodeData r = d;
  dev.download(r);
  if (status)
    *status = s;
  else
    EXPECT_TRUE(s.ok()) << s.to_string();
  return r;
}

DecodeData run_reference(const DecodeData& d, const GpuDecodeCase& gc) {
  DecodeData r = d;
  DecodeParams p = r.params();
  apply_options(p, gc);
  p.exec.backend = Backend::kCpuReference;
  const Status s = decode(p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return r;
}

// A copy of the given leading-dimension rows of t (contiguous), for comparing only live rows.
HostTensor gather_rows(const HostTensor& t, const std::vector<int64_t>& rows) {
  std::vector<int64_t> shape = t.shape;
  shape[0] = static_cast<int64_t>(rows.size());
  HostTensor r(t.dtype, shape);
  const int64_t row_elems = t.numel() / std::max<int64_t>(t.shape[0], 1);
  const size_t es = dtype_size(t.dtype);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t e = 0; e < row_elems; ++e)
      std::memcpy(r.storage.data() + r.offset(static_cast<int64_t>(i) * row_elems + e) * es,
                  t.storage.data() + t.offset(rows[i] * row_elems + e) * es, es);
  return r;
}

bool row_bitwise_equal(const HostTensor& a, const HostTensor& b, int64_t row) {
  const int64_t row_elems = a.numel() / std::max<int64_t>(a.shape[0], 1);
  const size_t es = dtype_size(a.dtype);
  for (int64_t e = 0; e < row_elems; ++e)
    if (std::memcmp(a.storage.data() + a.offset(row * row_elems + e) * es,
                    b.storage.data() + b.offset(row * row_elems + e) * es, es) != 0)
      return false;
  return true;
}

// Which rows of which tensor a call may touch, from the host copies of its indices.
struct Touched {
  std::vector<int64_t> slots;        // pool slots read or written by some row
  std::vector<int64_t> untouched;    // the other pool slots
  std::vector<int64_t> live_rows;    // sequences that are not padding
  std::vector<int64_t> live_tokens;  // token rows (b * T + t) of the live sequences
};

Touched touched_rows(const DecodeData& d, const GpuDecodeCase& gc) {
  DecodeParams p = d.params();
  apply_options(p, gc);
  detail::DecodeProblem pr;
  const Status s = detail::validate_decode(p, &pr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  Touched t;
  std::set<int64_t> slots;
  const int64_t P = d.state.shape[0];
  for (int64_t n = 0; n < pr.d.N; ++n) {
    const cpu::SeqSpan span = cpu::seq_span(pr.d, pr.cu_seqlens, n);
    const int64_t slot = cpu::decode_read_slot(pr, n, span.len);
    if (slot < 0) continue;
    slots.insert(slot);
    t.live_rows.push_back(n);
    for (int64_t j = 0; j < span.len; ++j) t.live_tokens.push_back(span.b * pr.d.T + span.bos + j);
  }
  if (!d.idx.empty())  // every slot named anywhere in the indices may be written
    for (int64_t i = 0; i < d.idx.numel(); ++i) {
      const int64_t x = static_cast<int64_t>(d.idx.get(i));
      if (x >= 0 && x < P) slots.insert(x);
    }
  t.slots.assign(slots.begin(), slots.end());
  for (int64_t x = 0; x < P; ++x)
    if (!slots.count(x)) t.untouched.push_back(x);
  return t;
}

void expect_close(const char* what, const HostTensor& got, const HostTensor& ref, double tol) {
  if (got.numel() == 0 && ref.numel() == 0) return;
  const Compare cmp = compare(got, ref, tol);
  EXPECT_TRUE(cmp.ok(tol)) << what << ": rel_l2 " << cmp.rel_l2 << " (tol " << tol << "), max_abs "
                           << cmp.max_abs << ", nonfinite " << cmp.nonfinite
                           << cmp.first_mismatches;
}

// The full check of one prepared problem.
void check_against_reference(const DecodeData& d, const GpuDecodeCase& gc) {
  const DecodeData ref = run_reference(d, gc);
  const DecodeData got = run_gpu(d, gc);
  const Touched tc = touched_rows(d, gc);
  const bool bf16_state = d.state.dtype == DType::kBFloat16;
  const double tol_state = tolerance_for(d.state.dtype);
  const double tol_out =
      std::max(tolerance_for(d.out.dtype), bf16_state ? tolerance_for(DType::kBFloat16) : 0.0);

  expect_close("out", got.out, ref.out, tol_out);
  expect_close("state (touched slots)", gather_rows(got.state, tc.slots),
               gather_rows(ref.state, tc.slots), tol_state);
  for (int64_t x : tc.untouched) {
    EXPECT_TRUE(row_bitwise_equal(got.state, d.state, x))
        << "untouched pool slot " << x << " changed";
    EXPECT_TRUE(row_bitwise_equal(ref.state, d.state, x))
        << "(reference) untouched pool slot " << x << " changed";
  }
  if (!d.final_state.empty()) {
    expect_close("final_state", gather_rows(got.final_state, tc.live_rows),
                 gather_rows(ref.final_state, tc.live_rows), tol_state);
    std::set<int64_t> live(tc.live_rows.begin(), tc.live_rows.end());
    for (int64_t n = 0; n < d.final_state.shape[0]; ++n)
      if (!live.count(n) || !d.c.store_final_state)
        EXPECT_TRUE(row_bitwise_equal(got.final_state, d.final_state, n))
            << "final_state row " << n << " of a padding row written";
  }
  if (!d.inter.empty()) {
    expect_close("intermediate_states", gather_rows(got.inter, tc.live_tokens),
                 gather_rows(ref.inter, tc.live_tokens), tol_state);
    std::set<int64_t> live(tc.live_tokens.begin(), tc.live_tokens.end());
    for (int64_t r = 0; r < d.inter.shape[0]; ++r)
      if (!live.count(r) || !d.c.store_final_state)
        EXPECT_TRUE(row_bitwise_equal(got.inter, d.inter, r))
            << "intermediate row " << r << " of a padding row written";
  }

  // Bitwise determinism: a second run on fresh copies of the same inputs.
  const DecodeData again = run_gpu(d, gc);
  EXPECT_TRUE(bitwise_equal(again.out, got.out)) << "out differs between two runs";
  EXPECT_TRUE(bitwise_equal(again.state, got.state)) << "state differs between two runs";
  if (!d.final_state.empty()) EXPECT_TRUE(bitwise_equal(again.final_state, got.final_state));
  if (!d.inter.empty()) EXPECT_TRUE(bitwise_equal(again.inter, got.inter));
}

// ---------------------------------------------------------------------------------------------
// The sweep
// ---------------------------------------------------------------------------------------------

class GpuDecode : public ::testing::TestWithParam<GpuDecodeCase> {};

TEST_P(GpuDecode, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  const GpuDecodeCase& gc = GetParam();
  check_against_reference(make_data(gc), gc);
}

GpuDecodeCase base(int64_t K = 128) {
  GpuDecodeCase g;
  g.c.K = K;
  return g;
}

std::vector<GpuDecodeCase> smoke_cases() {
  std::vector<GpuDecodeCase> v;
  v.push_back(
      base(128));  // bf16 in/out, fp32 V-first pool, softplus gate, beta logits, [N] indices
  {
    GpuDecodeCase g = base(64);
    g.c.layout = StateLayout::kKFirst;
    g.c.state_dtype = DType::kBFloat16;
    g.c.T = 2;
    v.push_back(g);
  }
  {
    GpuDecodeCase g = base(128);
    g.c.seqlens = {3, 1, 0, 4};
    g.c.indices = 2;
    g.c.num_accepted = true;
    g.c.padding = true;
    v.push_back(g);
  }
  {
    GpuDecodeCase g = base(96);
    g.c.gate = GateForm::kLowerBound;
    g.c.beta_per_v = true;
    g.c.intermediate = true;
    g.c.T = 3;
    g.strided = 1;
    v.push_back(g);
  }
  return v;
}

std::vector<GpuDecodeCase> sweep_cases() {
  std::vector<GpuDecodeCase> v;
  // Head dims x layouts x state dtypes (two tokens, so the token loop runs).
  for (int64_t K : {32, 64, 96, 128, 160, 256})
    for (StateLayout lay : {StateLayout::kVFirst, StateLayout::kKFirst})
      for (DType st : {DType::kFloat32, DType::kBFloat16}) {
        GpuDecodeCase g = base(K);
        g.c.layout = lay;
        g.c.state_dtype = st;
        g.c.T = 2;
        v.push_back(g);
      }
  // Input / output dtypes.
  {
    GpuDecodeCase g = base(128);
    g.c.dtype = g.c.out_dtype = DType::kFloat16;
    v.push_back(g);
    g.c.out_dtype = DType::kFloat32;
    v.push_back(g);
    g = base(128);
    g.c.out_dtype = DType::kFloat32;
    v.push_back(g);
    g.c.state_dtype = DType::kBFloat16;
    v.push_back(g);
  }
  // Gate and beta forms.
  for (GateForm gf : {GateForm::kPrecomputed, GateForm::kSoftplus, GateForm::kLowerBound})
    for (int bf = 0; bf < 3; ++bf)
      for (bool per_v : {false, true}) {
        GpuDecodeCase g = base(64);
        g.c.gate = gf;
        g.c.beta_logits = bf != 0;
        g.c.allow_neg_eigval = bf == 2;
        g.c.beta_per_v = per_v;
        g.c.out_dtype = DType::kFloat32;
        if (gf == GateForm::kLowerBound && per_v) g.lower_bound = -2.5f;
        v.push_back(g);
      }
  // Preprocessing options and gate parameter dtypes.
  {
    GpuDecodeCase g = base(128);
    g.l2norm = false;
    v.push_back(g);
    g = base(128);
    g.scale = 0.37;
    g.c.out_dtype = DType::kFloat32;
    v.push_back(g);
    g = base(128);
    g.g_fp32 = true;
    g.beta_fp32 = true;
    g.c.beta_per_v = true;
    v.push_back(g);
    g = base(128);
    g.dt_bias_bf16 = true;
    g.c.gate = GateForm::kLowerBound;
    v.push_back(g);
    g = base(64);
    g.no_gate_params = true;
    v.push_back(g);
    g.c.gate = GateForm::kLowerBound;
    v.push_back(g);
  }
  // State indices: none, [N] int64, [N, T] (+ num_accepted), padding rows of every kind.
  {
    GpuDecodeCase g = base(128);
    g.c.indices = 0;
    v.push_back(g);
    g.c.final_state_separate = true;
    v.push_back(g);
    g = base(128);
    g.c.index_dtype = DType::kInt64;
    g.c.padding = true;
    g.c.N = 6;
    v.push_back(g);
    g = base(128);
    g.c.padding = true;
    g.c.N = 5;
    v.push_back(g);
    for (bool nat : {false, true})
      for (bool pad : {false, true})
        for (DType idt : {DType::kInt32, DType::kInt64}) {
          g = base(128);
          g.c.indices = 2;
          g.c.T = 4;
          g.c.num_accepted = nat;
          g.c.padding = pad;
          g.c.index_dtype = idt;
          g.c.N = 5;
          v.push_back(g);
        }
    g = base(64);
    g.c.indices = 2;
    g.c.T = 3;
    g.c.N = 4;
    g.drop_token_slot = true;
    v.push_back(g);
    g.c.num_accepted = true;
    v.push_back(g);
  }
  // Where states go: separate final state, per-token buffer, nowhere; no initial state.
  {
    GpuDecodeCase g = base(128);
    g.c.final_state_separate = true;
    g.c.padding = true;
    v.push_back(g);
    g = base(128);
    g.c.intermediate = true;
    g.c.T = 3;
    g.c.padding = true;
    v.push_back(g);
    g.c.indices = 2;
    g.c.num_accepted = true;
    v.push_back(g);
    g = base(128);
    g.c.store_final_state = false;
    g.c.T = 2;
    v.push_back(g);
    g.c.intermediate = true;
    v.push_back(g);
    g = base(128);
    g.c.use_initial_state = false;
    g.c.T = 2;
    v.push_back(g);
    g.c.final_state_separate = true;
    v.push_back(g);
    g = base(128);
    g.c.T = 0;  // no tokens: the state passes through (in place: written back unchanged)
    v.push_back(g);
  }
  // Tokens per sequence (the loop has no limit) and GVA.
  for (int64_t T : {1, 2, 4, 8, 13}) {
    GpuDecodeCase g = base(128);
    g.c.T = T;
    g.c.indices = 2;
    g.c.num_accepted = true;
    g.c.state_dtype = T % 2 ? DType::kFloat32 : DType::kBFloat16;
    v.push_back(g);
    g = base(128);
    g.c.T = T;
    g.c.intermediate = true;
    v.push_back(g);
  }
  for (auto hh : std::vector<std::pair<int64_t, int64_t>>{{1, 4}, {2, 8}, {4, 4}, {1, 1}, {3, 6}}) {
    GpuDecodeCase g = base(64);
    g.c.H = hh.first;
    g.c.HV = hh.second;
    g.c.T = 2;
    v.push_back(g);
  }
  // Varlen.
  {
    GpuDecodeCase g = base(128);
    g.c.seqlens = {1, 3, 0, 2, 8};
    v.push_back(g);
    g.c.indices = 2;
    g.c.num_accepted = true;
    g.c.padding = true;
    v.push_back(g);
    g.c.index_dtype = DType::kInt64;
    g.c.layout = StateLayout::kKFirst;
    v.push_back(g);
    g = base(64);
    g.c.seqlens = {2, 0, 5, 1};
    g.c.intermediate = true;
    v.push_back(g);
    g.c.intermediate = false;
    g.c.final_state_separate = true;
    g.c.padding = true;
    v.push_back(g);
    g = base(128);
    g.c.seqlens = {20, 1, 3};
    g.c.state_dtype = DType::kBFloat16;
    v.push_back(g);
  }
  // Strides: unaligned (scalar loads), aligned padded (vector loads), strided pool.
  for (StateLayout lay : {StateLayout::kVFirst, StateLayout::kKFirst}) {
    GpuDecodeCase g = base(128);
    g.c.layout = lay;
    g.strided = 1;
    g.c.T = 2;
    v.push_back(g);
    g.strided = 2;
    g.c.beta_per_v = true;
    v.push_back(g);
    g = base(64);
    g.c.layout = lay;
    g.state_strided = true;
    g.c.intermediate = true;
    v.push_back(g);
    g.c.state_dtype = DType::kBFloat16;
    v.push_back(g);
  }
  // More blocks than SMs.
  {
    GpuDecodeCase g = base(128);
    g.c.N = 48;
    g.c.H = 4;
    g.c.HV = 8;
    v.push_back(g);
    g.c.layout = StateLayout::kKFirst;
    g.c.state_dtype = DType::kBFloat16;
    v.push_back(g);
  }
  // V-first, K = 128, dense, T <= 8 on the default kernels: padding rows interleaved, T > 1 with
  // per-token write slots and per-token states, bf16 state, a pool whose rows are aligned but
  // not contiguous (one bulk copy per row), and the tile kernel on the same shape.
  {
    GpuDecodeCase g = base(128);
    g.c.N = 40;
    g.c.H = 4;
    g.c.HV = 8;
    g.c.padding = true;
    g.pad_every = 3;
    v.push_back(g);
    g.pad_every = 0;
    g.c.state_dtype = DType::kBFloat16;
    g.c.T = 3;
    g.c.indices = 2;
    g.c.num_accepted = true;
    v.push_back(g);
    g = base(128);
    g.c.N = 33;
    g.c.H = 2;
    g.c.HV = 8;
    g.c.T = 4;
    g.c.intermediate = true;
    g.c.padding = true;
    v.push_back(g);
    g = base(128);
    g.c.N = 21;
    g.c.HV = 6;
    g.c.H = 3;
    g.c.T = 2;
    g.c.final_state_separate = true;
    g.c.padding = true;
    g.state_aligned_pad = true;
    v.push_back(g);
    g.c.state_dtype = DType::kBFloat16;
    g.c.use_initial_state = false;
    v.push_back(g);
    g = base(128);
    g.c.N = 17;
    g.c.T = 8;
    g.c.indices = 2;
    g.c.num_accepted = true;
    g.c.padding = true;
    v.push_back(g);
    g = base(128);
    g.c.N = 48;
    g.c.H = 8;
    g.c.HV = 16;
    g.c.padding = true;
    g.pad_every = 5;
    v.push_back(g);
    g.tile = true;
    v.push_back(g);
  }
  // The bulk kernel (the default for large fp32 batches), the staged tile kernel (the default for
  // V-first K = 128 with an aligned pool otherwise, so most cases above run it) and the tile
  // kernel, forced on the harder shapes:
  // varlen with an empty sequence (its final state is the initial one), [N, T] write slots with
  // num_accepted, per-v beta, bf16 state, no initial state, separate final state, a pool with
  // aligned non-contiguous rows; an unaligned pool falls back to the tile kernel.
  {
    std::vector<GpuDecodeCase> hard;
    GpuDecodeCase g = base(128);
    g.c.seqlens = {3, 1, 0, 4, 2};
    g.c.indices = 2;
    g.c.num_accepted = true;
    g.c.padding = true;
    g.c.beta_per_v = true;
    hard.push_back(g);
    g = base(128);
    g.c.seqlens = {2, 0, 5, 1};
    g.c.final_state_separate = true;
    g.c.state_dtype = DType::kBFloat16;
    hard.push_back(g);
    g = base(128);
    g.c.N = 9;
    g.c.T = 5;
    g.c.intermediate = true;
    g.c.padding = true;
    g.c.state_dtype = DType::kBFloat16;
    g.c.use_initial_state = false;
    hard.push_back(g);
    g = base(128);
    g.c.N = 7;
    g.c.T = 3;
    g.c.final_state_separate = true;
    g.state_aligned_pad = true;
    g.pad_every = 2;
    g.c.padding = true;
    hard.push_back(g);
    g = base(128);
    g.c.T = 2;
    g.state_strided = true;  // unaligned pool: "staged" runs the tile kernel
    hard.push_back(g);
    for (GpuDecodeCase h : hard) {
      h.bulk = true;
      v.push_back(h);
      h.bulk = false;
      h.staged = true;
      v.push_back(h);
      h.staged = false;
      h.tile = true;
      v.push_back(h);
    }
  }
  // The baseline kernel on the harder cases.
  {
    GpuDecodeCase g = base(64);
    g.c.layout = StateLayout::kKFirst;
    g.c.state_dtype = DType::kBFloat16;
    g.c.T = 3;
    g.baseline = true;
    v.push_back(g);
    g = base(128);
    g.c.seqlens = {3, 1, 0, 4};
    g.c.indices = 2;
    g.c.num_accepted = true;
    g.c.padding = true;
    g.c.beta_per_v = true;
    g.baseline = true;
    v.push_back(g);
    g = base(256);
    g.c.intermediate = true;
    g.c.T = 2;
    g.strided = 1;
    g.baseline = true;
    v.push_back(g);
  }
  return v;
}

// Every smoke and sweep case plus K = 128 cases of the gate and beta forms, a skipped write slot,
// GVA with 4 value heads per head, and both L2 policies of the register kernels.
std::vector<GpuDecodeCase> k128_cases() {
  std::vector<GpuDecodeCase> all = smoke_cases();
  for (const GpuDecodeCase& g : sweep_cases()) all.push_back(g);
  for (GateForm gf : {GateForm::kPrecomputed, GateForm::kSoftplus, GateForm::kLowerBound})
    for (int bf = 0; bf < 3; ++bf) {
      GpuDecodeCase g = base(128);
      g.c.gate = gf;
      g.c.beta_logits = bf != 0;
      g.c.allow_neg_eigval = bf == 2;
      g.c.beta_per_v = bf == 1;
      g.c.out_dtype = DType::kFloat32;
      all.push_back(g);
    }
  GpuDecodeCase w = base(128);  // a skipped [N, T] write slot; GVA with 4 value heads per head
  w.c.indices = 2;
  w.c.T = 3;
  w.drop_token_slot = true;
  all.push_back(w);
  w = base(128);
  w.c.H = 1;
  w.c.HV = 4;
  all.push_back(w);
  for (auto cache : {detail::DecodeStateCache::kNormal, detail::DecodeStateCache::kStream}) {
    GpuDecodeCase g = base(128);
    g.warp_cache = cache;
    g.c.final_state_separate = true;
    g.c.padding = true;
    all.push_back(g);
    g.c.final_state_separate = false;
    g.c.intermediate = true;
    g.c.T = 2;
    all.push_back(g);
  }
  return all;
}

// The warp kernel (forced only) on every case above it could take (V-first, K = 128: any T, dense
// and varlen, every index and state-output mode, input dtypes, strides, padded pool rows; bf16 and
// unaligned pools fall back to the default choice), with 4, 8 and 16 rows per warp in turn.
std::vector<GpuDecodeCase> warp_cases() {
  std::vector<GpuDecodeCase> v;
  const int rows[] = {4, 8, 16};
  for (GpuDecodeCase g : k128_cases()) {
    if (g.c.K != 128 || g.c.layout != StateLayout::kVFirst || g.baseline || g.tile || g.staged ||
        g.bulk)
      continue;
    g.warp = rows[v.size() % 3];
    v.push_back(g);
  }
  return v;
}

// The single-token kernel (the default for dense single-token fp32 V-first K = 128 calls below the
// bulk kernel's batches) forced on every K = 128 V-first case above with one token (input, output,
// g, beta and dt_bias dtypes, gate and beta forms, GVA, no / int64 indices, padding rows, a
// separate final state, padded pool rows, aligned strided inputs; unaligned strides and bf16
// pools fall back to the default choice), plus no initial state, no state write, fp16 inputs
// without l2 norm, no gate parameters at K = 128, every other row padding, and a batch of several
// waves.
std::vector<GpuDecodeCase> single_cases() {
  std::vector<GpuDecodeCase> all = k128_cases(), v;
  {
    GpuDecodeCase g = base(128);
    g.c.use_initial_state = false;
    all.push_back(g);
    g = base(128);
    g.c.store_final_state = false;
    g.c.final_state_separate = true;
    all.push_back(g);
    g = base(128);
    g.c.store_final_state = false;
    all.push_back(g);
    g = base(128);
    g.c.dtype = g.c.out_dtype = DType::kFloat16;
    g.l2norm = false;
    g.c.gate = GateForm::kLowerBound;
    all.push_back(g);
    g = base(128);
    g.no_gate_params = true;
    all.push_back(g);
    g = base(128);
    g.pad_every = 2;
    g.c.N = 7;
    all.push_back(g);
    g = base(128);
    g.c.N = 300;
    all.push_back(g);
  }
  for (GpuDecodeCase g : all) {
    if (g.c.K != 128 || g.c.layout != StateLayout::kVFirst || g.c.T != 1 || !g.c.seqlens.empty() ||
        g.baseline || g.tile || g.staged || g.bulk || g.warp > 0)
      continue;
    g.single = true;
    v.push_back(g);
  }
  return v;
}

std::string case_name(const ::testing::TestParamInfo<GpuDecodeCase>& info) {
  return info.param.name() + "_" + std::to_string(info.index);
}

INSTANTIATE_TEST_SUITE_P(Smoke, GpuDecode, ::testing::ValuesIn(smoke_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Sweep, GpuDecode, ::testing::ValuesIn(sweep_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(WarpSweep, GpuDecode, ::testing::ValuesIn(warp_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(SingleSweep, GpuDecode, ::testing::ValuesIn(single_cases()), case_name);

// ---------------------------------------------------------------------------------------------
// Special cases
// ---------------------------------------------------------------------------------------------

// Varlen with [N, Tmax] indices: a sequence longer than Tmax is a padding row.
TEST(GpuDecodeEdge, VarlenRowLongerThanIndexColumnsIsPadding) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(64);
  gc.c.seqlens = {2, 5, 3};
  gc.c.indices = 2;
  DecodeData d = make_data(gc);
  HostTensor narrow(d.idx.dtype, {d.N, 3});
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t t = 0; t < 3; ++t) narrow.set(n * 3 + t, d.idx.get(n * d.idx.shape[1] + t));
  d.idx = narrow;
  check_against_reference(d, gc);
}

// check_indices = true with valid indices runs normally.
TEST(GpuDecodeSmokeErrors, CheckIndicesAcceptsValidIndices) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(64);
  gc.c.indices = 2;
  gc.c.num_accepted = true;
  gc.c.seqlens = {2, 3, 1};
  const DecodeData d = make_data(gc);
  DeviceDecode dev(d, gc);
  dev.p.check_indices = true;
  const Status s = decode(dev.p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  DecodeData got = d;
  dev.download(got);
  const DecodeData ref = run_reference(d, gc);
  expect_close("out", got.out, ref.out, tolerance_for(d.out.dtype));
}

// check_indices = true: a slot >= P is kInvalidArgument and nothing is written.
TEST(GpuDecodeSmokeErrors, CheckIndicesRejectsSlotOutOfRange) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(64);
  gc.c.N = 4;
  DecodeData d = make_data(gc);
  d.idx.set(2, static_cast<double>(d.P + 2));
  DeviceDecode dev(d, gc);
  dev.p.check_indices = true;
  const Status s = decode(dev.p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("state_indices"), std::string::npos) << s.message();
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  DecodeData got = d;
  dev.download(got);
  EXPECT_TRUE(std::memcmp(got.out.storage.data(), d.out.storage.data(), d.out.storage.size()) == 0)
      << "out written";
  EXPECT_TRUE(
      std::memcmp(got.state.storage.data(), d.state.storage.data(), d.state.storage.size()) == 0)
      << "state written";

  // Without the check the row is a padding row: zero output, the rest as the reference.
  dev.p.check_indices = false;
  EXPECT_TRUE(decode(dev.p).ok());
}

TEST(GpuDecodeErrors, CheckIndicesRejectsNumAcceptedOutOfRange) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(64);
  gc.c.indices = 2;
  gc.c.T = 3;
  gc.c.num_accepted = true;
  DecodeData d = make_data(gc);
  d.nat.set(1, 4);  // > T
  DeviceDecode dev(d, gc);
  dev.p.check_indices = true;
  const Status s = decode(dev.p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("num_accepted_tokens"), std::string::npos) << s.message();
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  DecodeData got = d;
  dev.download(got);
  EXPECT_TRUE(std::memcmp(got.out.storage.data(), d.out.storage.data(), d.out.storage.size()) == 0);
  EXPECT_TRUE(
      std::memcmp(got.state.storage.data(), d.state.storage.data(), d.state.storage.size()) == 0);
}

TEST(GpuDecodeErrors, CheckIndicesRejectsBadCuSeqlens) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(64);
  gc.c.seqlens = {2, 3, 1};
  DecodeData d = make_data(gc);
  d.cu.set(2, 1);  // decreasing
  DeviceDecode dev(d, gc);
  dev.p.check_indices = true;
  const Status s = decode(dev.p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("cu_seqlens"), std::string::npos) << s.message();
  // Without the check, bad cu_seqlens are clamped on the device: no fault.
  dev.p.check_indices = false;
  EXPECT_TRUE(decode(dev.p).ok());
  KDA_TEST_CUDA(cudaDeviceSynchronize());
}

TEST(GpuDecodeErrors, Fp32InputsAreUnsupported) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(64);
  gc.c.dtype = gc.c.out_dtype = DType::kFloat32;
  const DecodeData d = make_data(gc);
  DeviceDecode dev(d, gc);
  const Status s = decode(dev.p);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
  EXPECT_NE(s.message().find("'q'"), std::string::npos) << s.message();
}

// The decode is capturable in a CUDA graph (no allocation, no synchronization) and a replay on
// a non-default stream gives the same bits as a direct call.
TEST(GpuDecodeSmokeGraph, CapturedCallMatchesDirectCall) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(128);
  gc.c.indices = 2;
  gc.c.num_accepted = true;
  gc.c.T = 2;
  gc.c.N = 6;
  const DecodeData d = make_data(gc);
  const DecodeData direct = run_gpu(d, gc);

  DeviceDecode dev(d, gc);
  cudaStream_t stream;
  KDA_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  dev.p.exec.stream = stream;
  const Status s = capture_and_replay(stream, [&] { return decode(dev.p); });
  ASSERT_TRUE(s.ok()) << s.to_string();
  DecodeData got = d;
  dev.download(got);
  EXPECT_TRUE(bitwise_equal(got.out, direct.out));
  EXPECT_TRUE(bitwise_equal(got.state, direct.state));
  KDA_TEST_CUDA(cudaStreamDestroy(stream));
}

// The default kernel (staged or bulk for V-first K = 128) and the tile kernel agree.
TEST(GpuDecodeSmokeKernels, DefaultMatchesTile) {
  KDA_SKIP_WITHOUT_SM90();
  for (DType st : {DType::kFloat32, DType::kBFloat16}) {
    GpuDecodeCase gc = base(128);
    gc.c.N = 24;
    gc.c.H = 4;
    gc.c.HV = 8;
    gc.c.T = 2;
    gc.c.state_dtype = st;
    gc.c.padding = true;
    gc.c.intermediate = true;
    gc.c.out_dtype = DType::kFloat32;
    const DecodeData d = make_data(gc);
    gc.tile = true;
    const DecodeData tile = run_gpu(d, gc);
    gc.tile = false;
    const DecodeData def = run_gpu(d, gc);
    const double tol = st == DType::kFloat32 ? 1e-6 : 1e-5;
    expect_close("out (default vs tile)", def.out, tile.out, tol);
    expect_close("state (default vs tile)", def.state, tile.state, tol);
    expect_close("inter (default vs tile)", def.inter, tile.inter, tol);
  }
}

// Bitwise equal, or within tol.
void expect_same_or_close(const char* what, const HostTensor& got, const HostTensor& ref,
                          double tol) {
  if (bitwise_equal(got, ref)) return;
  expect_close(what, got, ref, tol);
}

// The bulk kernel (default for V-first K = 128; and its latency variant), the staged tile kernel,
// the tile kernel and the warp kernel (fp32 state, 4, 8 and 16 rows per warp) agree:
// fp32 and bf16 state, padding rows, T = 1..4, per-token states. Bulk and staged run the same
// arithmetic in the same order (bitwise equal expected); the tile and warp kernels sum the k
// products in other orders, so they agree within reassociation: ~1e-7 for fp32, and for a bf16
// state an occasional one-ulp (2^-8) flip of the per-token rounding.
TEST(GpuDecodeSmokeStaged, StagedMatchesTile) {
  KDA_SKIP_WITHOUT_SM90();
  for (DType st : {DType::kFloat32, DType::kBFloat16}) {
    const double tol = st == DType::kFloat32 ? 1e-5 : 3e-3;
    for (int64_t T = 1; T <= 4; ++T) {
      SCOPED_TRACE(std::string(dtype_name(st)) + " T = " + std::to_string(T));
      GpuDecodeCase gc = base(128);
      gc.c.N = 12;
      gc.c.H = 4;
      gc.c.HV = 8;
      gc.c.T = T;
      gc.c.state_dtype = st;
      gc.c.padding = true;
      gc.pad_every = 3;
      gc.c.intermediate = true;
      gc.c.out_dtype = DType::kFloat32;
      // Per-token states, then the in-place final state only.
      for (bool inter : {true, false}) {
        SCOPED_TRACE(inter ? "intermediate states" : "in-place final state");
        gc.c.intermediate = inter;
        const DecodeData d = make_data(gc);
        GpuDecodeCase k = gc;
        k.tile = true;
        const DecodeData tile = run_gpu(d, k);
        k.tile = false;
        k.staged = true;
        const DecodeData staged = run_gpu(d, k);
        k.staged = false;
        k.bulk = true;
        const DecodeData bulk = run_gpu(d, k);
        expect_same_or_close("out (staged vs tile)", staged.out, tile.out, tol);
        expect_same_or_close("state (staged vs tile)", staged.state, tile.state, tol);
        expect_same_or_close("inter (staged vs tile)", staged.inter, tile.inter, tol);
        EXPECT_TRUE(bitwise_equal(bulk.out, staged.out)) << "out (bulk vs staged)";
        EXPECT_TRUE(bitwise_equal(bulk.state, staged.state)) << "state (bulk vs staged)";
        EXPECT_TRUE(bitwise_equal(bulk.inter, staged.inter)) << "inter (bulk vs staged)";
        if (st == DType::kFloat32)  // the warp kernel: the k sums in another order
          for (int rows : {4, 8, 16}) {
            SCOPED_TRACE("warp kernel, rows per warp " + std::to_string(rows));
            k.bulk = false;
            k.warp = rows;
            const DecodeData warp = run_gpu(d, k);
            k.warp = 0;
            expect_same_or_close("out (warp vs staged)", warp.out, staged.out, tol);
            expect_same_or_close("state (warp vs staged)", warp.state, staged.state, tol);
            expect_same_or_close("inter (warp vs staged)", warp.inter, staged.inter, tol);
            if (rows == 8 && T == 1 && !inter) {  // the single-token kernel: the warp kernel's sums
              k.single = true;
              const DecodeData single = run_gpu(d, k);
              k.single = false;
              EXPECT_TRUE(bitwise_equal(single.out, warp.out)) << "out (single vs warp, 8 rows)";
              EXPECT_TRUE(bitwise_equal(single.state, warp.state))
                  << "state (single vs warp, 8 rows)";
            }
          }
        if (T == 1) {  // the bulk kernel's latency variant (dense single-token calls)
          k.bulk = false;
          k.bulklat = true;
          const DecodeData lat = run_gpu(d, k);
          k.bulklat = false;
          EXPECT_TRUE(bitwise_equal(lat.out, staged.out)) << "out (bulk latency variant vs staged)";
          EXPECT_TRUE(bitwise_equal(lat.state, staged.state))
              << "state (bulk latency variant vs staged)";
          EXPECT_TRUE(bitwise_equal(lat.inter, staged.inter))
              << "inter (bulk latency variant vs staged)";
        }
      }
    }
  }
}

// [N, Tmax] write slots that repeat within a row: the state after the later token lands last
// (the bulk kernel waits for its bulk store to complete before the next token's store; the warp
// kernel's lanes store the same addresses in program order), for every kernel that takes the
// shape.
TEST(GpuDecode, RepeatedWriteSlotsInARow) {
  KDA_SKIP_WITHOUT_SM90();
  GpuDecodeCase gc = base(128);
  gc.c.N = 6;
  gc.c.T = 4;
  gc.c.indices = 2;
  DecodeData d = make_data(gc);
  // Row 1 writes tokens 1..3 to token 1's slot, row 4 writes tokens 0..3 to one slot.
  for (int64_t t = 2; t < 4; ++t) d.idx.set(1 * 4 + t, static_cast<int64_t>(d.idx.get(1 * 4 + 1)));
  for (int64_t t = 1; t < 4; ++t) d.idx.set(4 * 4 + t, static_cast<int64_t>(d.idx.get(4 * 4)));
  for (int kernel = 0; kernel < 4; ++kernel) {
    SCOPED_TRACE(kernel == 0 ? "bulk" : kernel == 1 ? "staged" : kernel == 2 ? "tile" : "warp");
    GpuDecodeCase k = gc;
    k.bulk = kernel == 0;
    k.staged = kernel == 1;
    k.tile = kernel == 2;
    k.warp = kernel == 3 ? 8 : 0;
    check_against_reference(d, k);
  }
}

// The fast kernel and the baseline kernel agree (the differential test of the two CUDA paths).
TEST(GpuDecodeSmokeBaseline, FastMatchesBaseline) {
  KDA_SKIP_WITHOUT_SM90();
  for (StateLayout lay : {StateLayout::kVFirst, StateLayout::kKFirst}) {
    GpuDecodeCase gc = base(128);
    gc.c.layout = lay;
    gc.c.T = 3;
    gc.c.intermediate = true;
    gc.c.out_dtype = DType::kFloat32;
    const DecodeData d = make_data(gc);
    const DecodeData fast = run_gpu(d, gc);
    gc.baseline = true;
    const DecodeData slow = run_gpu(d, gc);
    expect_close("out (fast vs baseline)", fast.out, slow.out, 1e-5);
    expect_close("inter (fast vs baseline)", fast.inter, slow.inter, 1e-5);
  }
}

// Twenty calls on the same pool slots captured in one CUDA graph, as a serving engine replays
// them: every call reads the state the previous one wrote (launched with PDL: each kernel's state
// loads must follow its griddepcontrol.wait). Against twenty calls of the fp64 reference, for the
// default kernel and every kernel that takes the shape.
TEST(GpuDecodeSmokeGraph, TwentyCallsOnTheSameSlots) {
  KDA_SKIP_WITHOUT_SM90();
  constexpr int kCalls = 20;
  GpuDecodeCase gc = base(128);
  gc.c.N = 3;
  gc.c.out_dtype = DType::kFloat32;
  const DecodeData d = make_data(gc);
  DecodeData ref = d;
  for (int i = 0; i < kCalls; ++i) {
    DecodeParams p = ref.params();
    apply_options(p, gc);
    p.exec.backend = Backend::kCpuReference;
    ASSERT_TRUE(decode(p).ok());
  }
  const Touched tc = touched_rows(d, gc);
  for (int kernel = 0; kernel < 7; ++kernel) {
    GpuDecodeCase k = gc;
    k.warp = kernel == 1 ? 4 : kernel == 2 ? 8 : kernel == 3 ? 16 : 0;
    k.bulklat = kernel == 4;
    k.staged = kernel == 5;
    k.single = kernel == 6;
    SCOPED_TRACE(k.name());
    DeviceDecode dev(d, k);
    cudaStream_t stream;
    KDA_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    dev.p.exec.stream = stream;
    Status s;
    {
      KernelChoice kc(k);
      s = capture_and_replay(stream, [&] {
        for (int i = 0; i < kCalls; ++i)
          if (Status c = decode(dev.p); !c.ok()) return c;
        return Status::Ok();
      });
    }
    KDA_TEST_CUDA(cudaStreamDestroy(stream));
    ASSERT_TRUE(s.ok()) << s.to_string();
    DecodeData got = d;
    dev.download(got);
    expect_close("out (last call)", got.out, ref.out, tolerance_for(DType::kFloat32));
    expect_close("state (touched slots)", gather_rows(got.state, tc.slots),
                 gather_rows(ref.state, tc.slots), tolerance_for(DType::kFloat32));
    for (int64_t x : tc.untouched)
      EXPECT_TRUE(row_bitwise_equal(got.state, d.state, x)) << "untouched pool slot " << x;
  }
}

}  // namespace
