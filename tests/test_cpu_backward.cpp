// test_cpu_backward.cpp — the fp64 reference backward of the prefill against central finite
// differences of the fp64 reference forward, over the feature matrix; dtype handling,
// determinism, and every bad-input path of the backward.
//
// Finite differences: the reference takes fp32 inputs and writes fp32 outputs (it computes in
// fp64). Inputs are put on a grid of 2^-12 so that x +- h and x +- 2h (h = 2^-7) are exact in
// fp32; the derivative is Richardson's (4 D(h) - D(2h)) / 3 (truncation O(h^4), below 1e-8 here).
// What remains is the fp32 rounding of out and final_state inside the loss L = <d_out, out> +
// <d_final_state, final_state>: each rounding is at most |x| 2^-24, so the loss carries a random
// error of rms at most e_L = 2^-24 sqrt(sum (d_out * out)^2 + ...), and a Richardson derivative
// one of rms at most sqrt(2 (4/3)^2 + 2 (1/6)^2) e_L / (2h) ~ e_L / h. Each gradient's RMS error
// is held to 4 times that (plus 1e-9 for fp64 and the gradient's own fp32 rounding).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "support.h"

namespace kda::test {
namespace {

constexpr double kGrid = 1.0 / 4096;  // inputs on multiples of 2^-12
constexpr double kStep = 1.0 / 128;   // h

struct BackwardCase {
  PrefillCase c;
  bool d_out = true;            // upstream gradient of out present
  double softplus_extreme = 0;  // if != 0, 1 in 5 gate inputs set to this (softplus x > 20)
  std::string tag;
  std::string name() const { return test_name(tag + "_" + c.name()); }
};

// Inputs, upstream gradients and gradient outputs of one backward problem, all fp32 on the host.
struct Problem {
  PrefillData d;
  HostTensor d_out, d_ht;
  HostTensor dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0;

  std::vector<HostTensor*> inputs() {
    return {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.A_log, &d.dt_bias, &d.h0};
  }
  std::vector<HostTensor*> grads() {
    return {&dq, &dk, &dv, &dg, &dbeta, &dA_log, &ddt_bias, &dh0};
  }

  PrefillBackwardParams params() const {
    PrefillBackwardParams p;
    p.forward = d.params();
    p.d_out = d_out.view();
    p.d_final_state = d_ht.view();
    p.dq = dq.view();
    p.dk = dk.view();
    p.dv = dv.view();
    p.dg = dg.view();
    p.dbeta = dbeta.view();
    p.dA_log = dA_log.view();
    p.ddt_bias = ddt_bias.view();
    p.d_initial_state = dh0.view();
    p.exec.backend = Backend::kCpuReference;
    return p;
  }
};

HostTensor like(const HostTensor& t, DType dt) {
  HostTensor r(dt, t.shape);
  r.fill_bytes(0xff);  // poison: every element must be written
  return r;
}

Problem make_problem(const BackwardCase& bc) {
  Problem P;
  P.d = make_prefill(bc.c);
  PrefillData& d = P.d;
  if (bc.softplus_extreme != 0)
    for (int64_t i = 0; i < d.g.numel(); i += 5) d.g.set(i, bc.softplus_extreme);
  for (HostTensor* t : P.inputs())
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, std::round(t->get(i) / kGrid) * kGrid);
  std::mt19937_64 rng(bc.c.seed + 100);
  if (bc.d_out) {
    P.d_out = HostTensor(d.out.dtype, d.out.shape);
    P.d_out.fill_normal(rng, 1.0);
  }
  if (!d.ht.empty()) {
    P.d_ht = HostTensor(d.ht.dtype, d.ht.shape);
    P.d_ht.fill_normal(rng, 1.0);
  }
  P.dq = like(d.q, d.q.dtype);
  P.dk = like(d.k, d.k.dtype);
  P.dv = like(d.v, d.v.dtype);
  P.dg = like(d.g, d.g.dtype);
  P.dbeta = like(d.beta, d.beta.dtype);
  P.dA_log = like(HostTensor(DType::kFloat32, {bc.c.HV}), DType::kFloat32);
  P.ddt_bias = like(HostTensor(DType::kFloat32, {bc.c.HV, bc.c.K}), DType::kFloat32);
  const std::vector<int64_t> st = bc.c.layout == StateLayout::kVFirst
                                      ? std::vector<int64_t>{d.N, bc.c.HV, bc.c.V, bc.c.K}
                                      : std::vector<int64_t>{d.N, bc.c.HV, bc.c.K, bc.c.V};
  P.dh0 = like(HostTensor(bc.c.state_dtype, st), bc.c.state_dtype);
  return P;
}

// L = <d_out, out> + <d_ht, final_state> by the reference forward; *err_rms: e_L (see the top).
double loss(Problem& P, double* err_rms) {
  PrefillParams p = P.d.params();
  p.exec.backend = Backend::kCpuReference;
  const Status s = prefill(p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  double L = 0, e2 = 0;
  auto add = [&](const HostTensor& up, const HostTensor& x) {
    for (int64_t i = 0; !up.empty() && i < up.numel(); ++i) {
      const double t = up.get(i) * x.get(i);
      L += t;
      e2 += t * t;
    }
  };
  add(P.d_out, P.d.out);
  add(P.d_ht, P.d.ht);
  if (err_rms) *err_rms = std::ldexp(std::sqrt(e2), -24);
  return L;
}

// dL/dx at element i of x by Richardson's central differences; *err: its error estimate.
double fd_derivative(Problem& P, HostTensor* x, int64_t i, double* err) {
  const double x0 = x->get(i);
  double L[4], e_L = 0;
  const double offsets[4] = {kStep, -kStep, 2 * kStep, -2 * kStep};
  for (int j = 0; j < 4; ++j) {
    x->set(i, x0 + offsets[j]);
    double e;
    L[j] = loss(P, &e);
    e_L = std::max(e_L, e);
  }
  x->set(i, x0);
  const double d1 = (L[0] - L[1]) / (2 * kStep), d2 = (L[2] - L[3]) / (4 * kStep);
  *err = e_L / kStep;
  return (4 * d1 - d2) / 3;
}

const char* kNames[] = {"dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "d_initial_state"};

class BackwardSweep : public ::testing::TestWithParam<BackwardCase> {};

TEST_P(BackwardSweep, GradientsMatchFiniteDifferences) {
  const BackwardCase& bc = GetParam();
  Problem P = make_problem(bc);
  const Status s = prefill_backward(P.params());
  ASSERT_TRUE(s.ok()) << s.to_string();
  const bool gate_params = bc.c.gate != GateForm::kPrecomputed;
  std::vector<HostTensor*> in = P.inputs(), gr = P.grads();
  std::mt19937_64 rng(bc.c.seed + 7);
  for (size_t t = 0; t < in.size(); ++t) {
    HostTensor& g = *gr[t];
    for (int64_t i = 0; i < g.numel(); ++i)
      ASSERT_TRUE(std::isfinite(g.get(i))) << kNames[t] << "[" << i << "]";
    if (in[t]->empty()) {
      // Without A_log / dt_bias / initial state the gradient is the one at 0 (zero for the
      // precomputed gate); the initial state's is checked in InitialStateGradientWithoutState.
      if (t == 5 || t == 6) {
        if (!gate_params)
          for (int64_t i = 0; i < g.numel(); ++i) EXPECT_EQ(g.get(i), 0.0) << kNames[t];
      }
      continue;
    }
    // Up to 48 elements per tensor, evenly spaced from a random offset.
    const int64_t n = in[t]->numel(), step = std::max<int64_t>(1, n / 48);
    if (n == 0) continue;
    double num = 0, den = 0, err2 = 0, worst = 0;
    int64_t count = 0, worst_i = 0;
    for (int64_t i = static_cast<int64_t>(rng() % step); i < n; i += step, ++count) {
      double err;
      const double fd = fd_derivative(P, in[t], i, &err), an = g.get(i);
      num += (fd - an) * (fd - an);
      den += an * an;
      err2 += err * err;
      if (std::fabs(fd - an) > worst) {
        worst = std::fabs(fd - an);
        worst_i = i;
      }
    }
    const double rms_err = std::sqrt(num / count), bound = 4 * std::sqrt(err2 / count) + 1e-9;
    EXPECT_LE(rms_err, bound) << kNames[t] << ": rms error " << rms_err << " vs bound " << bound
                              << " (gradient rms " << std::sqrt(den / count) << "; worst at "
                              << worst_i << ": analytic " << g.get(worst_i) << ")";
    // The gradient is not trivially zero where the input matters.
    const bool q_unused = t == 0 && !bc.d_out;  // q reaches only out
    if ((t < 5 || gate_params) && !q_unused) EXPECT_GT(den, 0.0) << kNames[t];
  }
}

std::vector<BackwardCase> backward_cases() {
  std::vector<BackwardCase> cs;
  auto add = [&](const char* tag, auto mutate) {
    BackwardCase b;
    b.tag = tag;
    b.c.seqlens = {21, 21};
    b.c.H = 1;
    b.c.HV = 2;
    b.c.K = b.c.V = 8;
    mutate(b);
    cs.push_back(b);
  };
  for (GateForm g : {GateForm::kPrecomputed, GateForm::kSoftplus, GateForm::kLowerBound})
    for (bool be : {false, true})
      add("forms", [&](BackwardCase& b) {
        b.c.gate = g;
        b.c.beta_logits = be;
      });
  add("neg_eigval", [](BackwardCase& b) { b.c.allow_neg_eigval = true; });
  add("gate_minus_1000", [](BackwardCase& b) {
    b.c.gate = GateForm::kPrecomputed;
    b.c.gate_extreme = -1000;
  });
  add("softplus_linear", [](BackwardCase& b) { b.softplus_extreme = 25; });
  add("lower_bound_weak", [](BackwardCase& b) {
    b.c.gate = GateForm::kLowerBound;
    b.c.lower_bound = -0.5;
  });
  add("no_l2norm", [](BackwardCase& b) { b.c.l2norm = false; });
  add("no_l2norm_lb", [](BackwardCase& b) {
    b.c.l2norm = false;
    b.c.gate = GateForm::kLowerBound;
  });
  add("gva", [](BackwardCase& b) {
    b.c.H = 2;
    b.c.HV = 6;
    b.c.seqlens = {9};
  });
  add("varlen_empty", [](BackwardCase& b) {
    b.c.varlen = true;
    b.c.seqlens = {0, 13, 0, 6, 1};
  });
  add("varlen_strided", [](BackwardCase& b) {
    b.c.varlen = true;
    b.c.seqlens = {11, 0, 8};
    b.c.strided = true;
  });
  add("no_initial_state", [](BackwardCase& b) { b.c.init = InitState::kNone; });
  add("no_final_grad", [](BackwardCase& b) { b.c.final_state = false; });
  add("final_grad_only", [](BackwardCase& b) { b.d_out = false; });
  add("k_first", [](BackwardCase& b) {
    b.c.layout = StateLayout::kKFirst;
    b.c.K = 6;
    b.c.V = 10;
  });
  add("k_first_varlen", [](BackwardCase& b) {
    b.c.layout = StateLayout::kKFirst;
    b.c.varlen = true;
    b.c.seqlens = {7, 0, 12};
    b.c.gate = GateForm::kLowerBound;
  });
  add("v_first_K_ne_V", [](BackwardCase& b) {
    b.c.K = 10;
    b.c.V = 6;
    b.c.beta_logits = false;
  });
  // Longer than the backward's 64-token checkpoint interval: recomputation across chunks.
  add("checkpoints", [](BackwardCase& b) {
    b.c.seqlens = {150};
    b.c.H = b.c.HV = 1;
    b.c.K = b.c.V = 4;
  });
  add("checkpoint_edge", [](BackwardCase& b) {
    b.c.varlen = true;
    b.c.seqlens = {64, 65, 128};
    b.c.H = b.c.HV = 1;
    b.c.K = b.c.V = 4;
  });
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Cpu, BackwardSweep, ::testing::ValuesIn(backward_cases()),
                         [](const auto& info) { return info.param.name(); });

// d_initial_state without an initial state is the gradient at the zero state; an empty
// sequence passes d_final_state through to d_initial_state.
TEST(BackwardSmoke, InitialStateGradientWithoutState) {
  BackwardCase bc;
  bc.c.varlen = true;
  bc.c.seqlens = {10, 0, 5};
  bc.c.init = InitState::kZero;
  Problem with_zero = make_problem(bc);
  bc.c.init = InitState::kNone;
  Problem without = make_problem(bc);
  ASSERT_TRUE(without.d.h0.empty());
  ASSERT_TRUE(prefill_backward(with_zero.params()).ok());
  ASSERT_TRUE(prefill_backward(without.params()).ok());
  std::vector<HostTensor*> a = with_zero.grads(), b = without.grads();
  for (size_t t = 0; t < a.size(); ++t) EXPECT_TRUE(bitwise_equal(*a[t], *b[t])) << kNames[t];
  // Sequence 1 is empty: its rows of d_initial_state equal d_final_state's.
  const int64_t per_seq = with_zero.dh0.numel() / 3;
  for (int64_t i = per_seq; i < 2 * per_seq; ++i)
    EXPECT_EQ(with_zero.dh0.get(i), with_zero.d_ht.get(i));
}

// No upstream gradient at all: every gradient is zero (and written).
TEST(BackwardSmoke, NoUpstreamGradientGivesZeros) {
  BackwardCase bc;
  bc.d_out = false;
  bc.c.final_state = false;
  Problem P = make_problem(bc);
  ASSERT_TRUE(prefill_backward(P.params()).ok());
  for (HostTensor* g : P.grads())
    for (int64_t i = 0; i < g->numel(); ++i) ASSERT_EQ(g->get(i), 0.0);
}

// 16-bit inputs: gradients in the inputs' dtypes (g and beta may be fp32), equal to the
// gradients of the widened inputs rounded to those dtypes; kCpu runs the same reference.
TEST(BackwardSmoke, HalfInputsGiveGradientsInTheirDtypes) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    BackwardCase bc;
    bc.c.dtype = dt;
    bc.c.gate_beta_fp32 = dt == DType::kFloat16;
    bc.c.state_dtype = DType::kBFloat16;
    bc.c.seqlens = {30};
    Problem P = make_problem(bc);
    PrefillBackwardParams p = P.params();
    p.exec.backend = Backend::kCpu;
    ASSERT_TRUE(prefill_backward(p).ok());
    EXPECT_EQ(P.dq.dtype, dt);
    EXPECT_EQ(P.dg.dtype, bc.c.gate_beta_fp32 ? DType::kFloat32 : dt);
    // The same problem on fp32 storage of the same values.
    Problem W = P;
    W.d = widen(P.d);
    for (HostTensor* t : {&W.d_out, &W.d_ht, &W.dq, &W.dk, &W.dv, &W.dg, &W.dbeta, &W.dh0})
      *t = t->to(DType::kFloat32);
    ASSERT_TRUE(prefill_backward(W.params()).ok());
    std::vector<HostTensor*> a = P.grads(), b = W.grads();
    for (size_t t = 0; t < a.size(); ++t) {
      const Compare c = compare(*a[t], *b[t], tolerance_for(a[t]->dtype));
      EXPECT_TRUE(c.ok(tolerance_for(a[t]->dtype)))
          << kNames[t] << " " << c.rel_l2 << c.first_mismatches;
    }
  }
}

TEST(BackwardDeterminism, BitwiseAcrossRunsAndBackends) {
  BackwardCase bc;
  bc.c.varlen = true;
  bc.c.seqlens = {40, 0, 70};
  bc.c.H = 1;
  bc.c.HV = 3;
  Problem a = make_problem(bc), b = make_problem(bc);
  PrefillBackwardParams pb = b.params();
  pb.exec.backend = Backend::kCpu;
  ASSERT_TRUE(prefill_backward(a.params()).ok());
  ASSERT_TRUE(prefill_backward(pb).ok());
  std::vector<HostTensor*> ga = a.grads(), gb = b.grads();
  for (size_t t = 0; t < ga.size(); ++t) EXPECT_TRUE(bitwise_equal(*ga[t], *gb[t])) << kNames[t];
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: the error names the argument and no gradient is written.
// ---------------------------------------------------------------------------------------------

struct BadBackward {
  std::string name;
  std::function<void(PrefillBackwardParams&, Problem&)> mutate;
  std::string argument;
  StatusCode code = StatusCode::kInvalidArgument;
};

std::vector<BadBackward> bad_backward_inputs() {
  using P = PrefillBackwardParams;
  using D = Problem;
  std::vector<BadBackward> cases = {
      {"q_absent", [](P& p, D&) { p.forward.q = TensorView{}; }, "'q'"},
      {"k_dtype", [](P& p, D&) { p.forward.k.dtype = DType::kFloat16; }, "'k'"},
      {"g_shape", [](P& p, D&) { p.forward.g.shape[2] = 5; }, "'g'"},
      {"cu_values", [](P& p, D& d) { d.d.cu.set(1, 35); }, "'cu_seqlens'"},
      {"initial_state_shape", [](P& p, D&) { p.forward.initial_state.shape[1] = 1; },
       "'initial_state'"},
      {"pool",
       [](P& p, D&) {
         p.forward.state_pool = p.d_final_state;
         p.forward.initial_state = TensorView{};
       },
       "'forward.state_pool'"},
      {"indices", [](P& p, D& d) { p.forward.state_indices = d.d.cu.view(); },
       "'forward.state_indices'"},
      {"checkpoints", [](P& p, D&) { p.forward.checkpoints = p.d_final_state; },
       "'forward.checkpoints'"},
      {"checkpoint_every", [](P& p, D&) { p.forward.checkpoint_every = 64; },
       "'forward.checkpoint_every'"},
      {"d_out_shape", [](P& p, D&) { p.d_out.shape[1] = 1; }, "'d_out'"},
      {"d_out_dtype", [](P& p, D&) { p.d_out.dtype = DType::kFloat16; }, "'d_out'"},
      {"d_final_state_layout", [](P& p, D&) { p.d_final_state.shape[2] = 7; }, "'d_final_state'"},
      {"d_final_state_device", [](P& p, D&) { p.d_final_state.device = Device::kCUDA; },
       "'d_final_state'"},
      {"dq_shape", [](P& p, D&) { p.dq.shape[2] = 3; }, "'dq'"},
      {"dq_dtype", [](P& p, D&) { p.dq.dtype = DType::kBFloat16; }, "'dq'"},
      {"dk_last_stride", [](P& p, D&) { p.dk.strides[p.dk.ndim - 1] = 2; }, "'dk'"},
      {"dv_heads", [](P& p, D&) { p.dv.shape[1] = 1; }, "'dv'"},
      {"dg_dtype", [](P& p, D&) { p.dg.dtype = DType::kFloat16; }, "'dg'"},
      {"dbeta_shape", [](P& p, D&) { p.dbeta.shape[1] = 1; }, "'dbeta'"},
      {"dA_log_dtype", [](P& p, D&) { p.dA_log.dtype = DType::kBFloat16; }, "'dA_log'"},
      {"ddt_bias_shape", [](P& p, D&) { p.ddt_bias.shape[1] = 1; }, "'ddt_bias'"},
      {"d_initial_state_dtype", [](P& p, D&) { p.d_initial_state.dtype = DType::kBFloat16; },
       "'d_initial_state'"},
      {"d_initial_state_rows", [](P& p, D&) { p.d_initial_state.shape[0] = 1; },
       "'d_initial_state'"},
      {"backend_code", [](P& p, D&) { p.exec.backend = static_cast<Backend>(7); }, "'backend'"},
      {"cuda_backend_on_cpu_tensors", [](P& p, D&) { p.exec.backend = Backend::kCuda; },
       "'backend'"},
  };
  // CUDA tensors in a build without the CUDA backend: refused naming the backend. (With it, the
  // CUDA backward runs: tests/test_gpu_backward.cpp.)
  if (!cuda_compiled())
    cases.push_back({"cuda_tensors",
                     [](P& p, D&) {
                       for (TensorView* t : {&p.forward.q, &p.forward.k, &p.forward.v, &p.forward.g,
                                             &p.forward.beta, &p.forward.A_log, &p.forward.dt_bias,
                                             &p.forward.cu_seqlens, &p.forward.initial_state,
                                             &p.d_out, &p.d_final_state, &p.dq, &p.dk, &p.dv, &p.dg,
                                             &p.dbeta, &p.dA_log, &p.ddt_bias, &p.d_initial_state})
                         t->device = Device::kCUDA;
                       p.exec.backend = Backend::kAuto;
                     },
                     "'backend'", StatusCode::kUnsupported});
  return cases;
}

class BackwardBadInput : public ::testing::TestWithParam<BadBackward> {};

TEST_P(BackwardBadInput, ReturnsErrorNamingArgumentAndWritesNothing) {
  BackwardCase bc;
  bc.c.varlen = true;
  bc.c.seqlens = {10, 20};
  Problem P = make_problem(bc);
  PrefillBackwardParams p = P.params();
  GetParam().mutate(p, P);
  std::vector<HostTensor> before;
  for (HostTensor* g : P.grads()) before.push_back(*g);
  const Status s = prefill_backward(p);
  EXPECT_EQ(s.code(), GetParam().code) << s.to_string();
  EXPECT_NE(s.message().find(GetParam().argument), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("expected"), std::string::npos) << s.message();
  std::vector<HostTensor*> after = P.grads();
  for (size_t t = 0; t < after.size(); ++t)
    EXPECT_TRUE(bitwise_equal(*after[t], before[t])) << kNames[t];
  const bool exec_error = GetParam().argument == "'backend'";
  EXPECT_EQ(validate(p).code(), exec_error ? StatusCode::kOk : StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Cpu, BackwardBadInput, ::testing::ValuesIn(bad_backward_inputs()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kda::test
