// prefill_decode.cpp — the library from an installed package: prefill three prompts of different
// lengths (varlen) into slots of a state pool on the fast CPU backend, decode a few tokens per
// sequence from the pool, and check every output and the pool against the fp64 reference backend.
// Exits non-zero if a call fails or the relative error exceeds fp32's bar.
#include <kda/kda.h>
#include <kda/version.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

constexpr int64_t kH = 2, kHV = 4, kK = 64, kV = 64;  // q/k heads, value heads, head dims
constexpr int64_t kSteps = 4;                         // decode tokens per sequence
constexpr int64_t kPoolSlots = 6;
const std::vector<int64_t> kPromptLengths = {37, 100, 64};
const std::vector<int32_t> kSlots = {4, 0, 2};  // pool slot of each sequence

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = nd(rng);
  return x;
}

// The inputs of one call: q, k, v, g, beta for `tokens` tokens ([1, tokens, heads, dim] or
// [tokens, 1, heads, dim]).
struct Tokens {
  std::vector<float> q, k, v, g, beta;
  Tokens(int64_t tokens, std::mt19937& rng)
      : q(random_values(tokens * kH * kK, rng)),
        k(random_values(tokens * kH * kK, rng)),
        v(random_values(tokens * kHV * kV, rng)),
        g(random_values(tokens * kHV * kK, rng)),
        beta(random_values(tokens * kHV, rng)) {}
};

struct Results {
  std::vector<float> prefill_out, decode_out, pool;
};

kda::TensorView view(std::vector<float>& x, std::vector<int64_t> shape) {
  return kda::make_view(x.data(), kda::DType::kFloat32, std::move(shape));
}

// Prefill of `prompt` into the pool, then kSteps decode calls of one token per sequence.
bool run(kda::Backend backend, Tokens& prompt, std::vector<Tokens>& steps, std::vector<float> A_log,
         std::vector<float> dt_bias, Results* r) {
  const int64_t N = static_cast<int64_t>(kPromptLengths.size());
  std::vector<int32_t> cu = {0}, slots = kSlots;
  for (int64_t len : kPromptLengths) cu.push_back(cu.back() + static_cast<int32_t>(len));
  const int64_t T = cu.back();
  r->pool.assign(kPoolSlots * kHV * kV * kK, 0.0f);
  r->prefill_out.assign(T * kHV * kV, 0.0f);
  r->decode_out.assign(kSteps * N * kHV * kV, 0.0f);

  kda::MathOptions math;
  math.gate = kda::GateForm::kSoftplus;  // Kimi-Linear: a = -exp(A_log) softplus(g + dt_bias)
  math.beta_logits = true;               // b = sigmoid(beta)
  kda::ExecOptions exec;
  exec.backend = backend;

  kda::PrefillParams p;
  p.q = view(prompt.q, {1, T, kH, kK});
  p.k = view(prompt.k, {1, T, kH, kK});
  p.v = view(prompt.v, {1, T, kHV, kV});
  p.g = view(prompt.g, {1, T, kHV, kK});
  p.beta = view(prompt.beta, {1, T, kHV});
  p.A_log = view(A_log, {kHV});
  p.dt_bias = view(dt_bias, {kHV, kK});
  p.cu_seqlens = kda::make_view(cu.data(), kda::DType::kInt32, {N + 1});
  p.out = view(r->prefill_out, {1, T, kHV, kV});
  p.state_pool = view(r->pool, {kPoolSlots, kHV, kV, kK});
  p.state_indices = kda::make_view(slots.data(), kda::DType::kInt32, {N});
  p.math = math;
  p.exec = exec;
  kda::Status s = kda::prefill(p);
  if (!s.ok()) {
    std::fprintf(stderr, "prefill (%s): %s\n", kda::backend_name(backend), s.to_string().c_str());
    return false;
  }

  for (int64_t t = 0; t < kSteps; ++t) {
    kda::DecodeParams d;
    d.q = view(steps[t].q, {N, 1, kH, kK});
    d.k = view(steps[t].k, {N, 1, kH, kK});
    d.v = view(steps[t].v, {N, 1, kHV, kV});
    d.g = view(steps[t].g, {N, 1, kHV, kK});
    d.beta = view(steps[t].beta, {N, 1, kHV});
    d.A_log = p.A_log;
    d.dt_bias = p.dt_bias;
    d.out = kda::make_view(r->decode_out.data() + t * N * kHV * kV, kda::DType::kFloat32,
                           {N, 1, kHV, kV});
    d.state = p.state_pool;  // read and written in place at state_indices
    d.state_indices = p.state_indices;
    d.math = math;
    d.exec = exec;
    s = kda::decode(d);
    if (!s.ok()) {
      std::fprintf(stderr, "decode (%s): %s\n", kda::backend_name(backend), s.to_string().c_str());
      return false;
    }
  }
  return true;
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main() {
  std::printf("kda %s (header %s), CUDA backend %s\n", kda::version(), KDA_VERSION_STRING,
              kda::cuda_compiled() ? "compiled" : "not compiled");
  std::mt19937 rng(7);
  int64_t T = 0;
  for (int64_t len : kPromptLengths) T += len;
  Tokens prompt(T, rng);
  std::vector<Tokens> steps;
  for (int64_t t = 0; t < kSteps; ++t)
    steps.emplace_back(static_cast<int64_t>(kPromptLengths.size()), rng);
  std::vector<float> A_log = random_values(kHV, rng), dt_bias = random_values(kHV * kK, rng);

  Results fast, ref;
  if (!run(kda::Backend::kCpu, prompt, steps, A_log, dt_bias, &fast)) return 1;
  if (!run(kda::Backend::kCpuReference, prompt, steps, A_log, dt_bias, &ref)) return 1;

  // The fast backend computes in fp32 (the reference in fp64): ~1e-6 relative error.
  const double bar = 1e-4;
  const double e_prefill = rel_l2(fast.prefill_out, ref.prefill_out);
  const double e_decode = rel_l2(fast.decode_out, ref.decode_out);
  const double e_pool = rel_l2(fast.pool, ref.pool);
  std::printf("prefill %zu prompts (%lld tokens) into a pool of %lld slots, decode %lld steps\n",
              kPromptLengths.size(), static_cast<long long>(T), static_cast<long long>(kPoolSlots),
              static_cast<long long>(kSteps));
  std::printf("rel L2 error vs the fp64 reference: prefill out %.3g, decode out %.3g, pool %.3g\n",
              e_prefill, e_decode, e_pool);
  const bool ok = e_prefill <= bar && e_decode <= bar && e_pool <= bar;
  std::printf("%s (bar %.0e)\n", ok ? "OK" : "FAILED", bar);
  return ok ? 0 : 1;
}
