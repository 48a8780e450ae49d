// a16_selftest.cpp — the prepare kernel's 16-token records (prepare_kernel<fp16, kC16 = true>, the
// chunk-16 path) against an fp64 computation of the same quantities, on the
// emulator. Dense batches: block (slot = n * chunks_per_seq + j, hv) holds sub-chunks u = 0..3 of
// tokens 64 j + 16 u .. + 15 of sequence n, each a 16-token record (common.cuh, rec16_*).
// Built by CMake with -DKDA_BUILD_EMULATOR=ON (target kda_emu_a16_selftest, CTest emu_a16).
#include <cmath>

#include "engine.h"
#include "support.h"

using namespace kda;
using namespace kda::test;
using namespace kda::cuda::pf;

namespace {

struct Err {  // relative L2 error of one quantity over all sub-chunks
  double se = 0, sr = 0, max_abs = 0;
  int64_t nonfinite = 0;
  void add(double got, double ref) {
    if (!std::isfinite(got)) {
      ++nonfinite;
      return;
    }
    se += (got - ref) * (got - ref);
    sr += ref * ref;
    max_abs = std::max(max_abs, std::fabs(got - ref));
  }
  double rel() const { return sr > 0 ? std::sqrt(se / sr) : std::sqrt(se); }
};

float bf16_at(const uint8_t* base, int elem) {
  uint16_t b;
  std::memcpy(&b, base + 2 * elem, 2);
  return detail::bf16_bits_to_float(b);
}
float f32_at(const uint8_t* base, int elem) {
  float f;
  std::memcpy(&f, base + 4 * elem, 4);
  return f;
}

int failures = 0;

void run(const PrefillCase& c) {
  std::printf("%s\n", c.name().c_str());
  PrefillData d = make_prefill(c);
  const PrefillParams prm = d.params();
  detail::PrefillProblem pr;
  Status s = detail::validate_prefill(prm, &pr);
  if (s.ok()) s = check_supported(pr);
  if (!s.ok()) {
    std::printf("  setup failed: %s\n", s.to_string().c_str());
    ++failures;
    return;
  }
  const size_t need = workspace_bytes(pr, 132, detail::tuning());
  std::vector<uint8_t> ws(need + 256, 0xff);  // poisoned: a record part not written reads as NaN
  Params p;
  int64_t pb = 0, rb = 0;
  size_t need_p = 0;
  s = make_params(pr, ws.data(), 132, detail::tuning(), &p, &pb, &rb, &need_p);
  if (!s.ok()) {
    std::printf("  params failed: %s\n", s.to_string().c_str());
    ++failures;
    return;
  }
  if (c.dtype == DType::kFloat16)
    emu_run::launch(prepare_kernel<true, true>, pb, kPrepareThreads, kPrepareSmemBytes, p);
  else
    emu_run::launch(prepare_kernel<false, true>, pb, kPrepareThreads, kPrepareSmemBytes, p);

  const int64_t B = d.B, T = d.T, H = c.H, HV = c.HV, K = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  const int64_t cps = (T + kChunk - 1) / kChunk;
  Err eW, eQg, eKb, eAqk, eTm, eGl;
  int64_t zero_viol = 0;
  for (int64_t n = 0; n < B; ++n)
    for (int64_t j = 0; j < cps; ++j)
      for (int64_t hv = 0; hv < HV; ++hv) {
        const uint8_t* rec = p.ws + ((n * cps + j) * HV + hv) * static_cast<int64_t>(kRecordBytes);
        const int64_t h = hv / (HV / H);
        const double exp_a =
            d.A_log.empty() ? 1.0 : std::exp(d.A_log.get(hv));  // absent: exp(A_log) = 1
        for (int u = 0; u < 4; ++u) {
          const int64_t t0 = j * kChunk + 16 * u;
          if (t0 >= T) continue;  // a sub-chunk without tokens: never read
          const uint8_t* r16 = rec + u * kRecord16Bytes;
          // fp64 inputs of the 16 tokens (padded ones zero), as the kernel treats them.
          double q[16][128] = {}, k[16][128] = {}, G[16][128] = {}, b[16] = {};
          for (int r = 0; r < 16; ++r) {
            const int64_t t = t0 + r;
            if (t >= T) {
              for (int cc = 0; cc < K; ++cc) G[r][cc] = r ? G[r - 1][cc] : 0.0;
              continue;
            }
            double sq = 0, sk = 0;
            for (int cc = 0; cc < K; ++cc) {
              q[r][cc] = d.q.get(((n * T + t) * H + h) * K + cc);
              k[r][cc] = d.k.get(((n * T + t) * H + h) * K + cc);
              sq += q[r][cc] * q[r][cc];
              sk += k[r][cc] * k[r][cc];
            }
            const double iq = scale / std::sqrt(sq + detail::kL2NormEps),
                         ik = 1.0 / std::sqrt(sk + detail::kL2NormEps);
            for (int cc = 0; cc < K; ++cc) {
              q[r][cc] *= iq;
              k[r][cc] *= ik;
              const double a = detail::log_decay<double>(
                  static_cast<int>(c.gate), d.g.get(((n * T + t) * HV + hv) * K + cc), exp_a,
                  d.dt_bias.empty() ? 0.0 : d.dt_bias.get(hv * K + cc), c.lower_bound);
              G[r][cc] = (r ? G[r - 1][cc] : 0.0) + a;
            }
            b[r] = detail::activate_beta<double>(c.beta_logits, c.allow_neg_eigval,
                                                 d.beta.get((n * T + t) * HV + hv));
          }
          // Akk, Aqk, Tm = (I + diag(b) Akk)^-1 diag(b), W, qg, kbT, gL.
          double Aqk[16][16] = {}, M[16][16] = {}, X[16][16] = {}, Tm[16][16] = {};
          for (int r = 0; r < 16; ++r)
            for (int s2 = 0; s2 <= r; ++s2) {
              double akk = 0, aqk = 0;
              for (int cc = 0; cc < K; ++cc) {
                const double e = std::exp(G[r][cc] - G[s2][cc]);
                akk += k[r][cc] * k[s2][cc] * e;
                aqk += q[r][cc] * k[s2][cc] * e;
              }
              Aqk[r][s2] = aqk;
              M[r][s2] = s2 < r ? b[r] * akk : 1.0;
            }
          for (int col = 0; col < 16; ++col)  // forward substitution, unit lower triangular M
            for (int r = 0; r < 16; ++r) {
              double x = r == col ? 1.0 : 0.0;
              for (int s2 = 0; s2 < r; ++s2) x -= M[r][s2] * X[s2][col];
              X[r][col] = x;
            }
          for (int r = 0; r < 16; ++r)
            for (int s2 = 0; s2 < 16; ++s2) Tm[r][s2] = X[r][s2] * b[s2];
          for (int r = 0; r < 16; ++r) {
            for (int cc = 0; cc < K; ++cc) {
              double w = 0;
              for (int s2 = 0; s2 <= r; ++s2) w += Tm[r][s2] * std::exp(G[s2][cc]) * k[s2][cc];
              eW.add(bf16_at(r16 + kR16OffW, rec16_b16(r, cc)), w);
              eQg.add(bf16_at(r16 + kR16OffQg, rec16_b16(r, cc)), std::exp(G[r][cc]) * q[r][cc]);
              eKb.add(bf16_at(r16 + kR16OffKbT, rec16_kbt(cc, r)),
                      std::exp(G[15][cc] - G[r][cc]) * k[r][cc]);
            }
            for (int s2 = 0; s2 < 16; ++s2) {
              const float ga = f32_at(r16 + kR16OffAqk, rec16_f32(r, s2)),
                          gt = f32_at(r16 + kR16OffTm, rec16_f32(r, s2));
              if (s2 > r) {
                zero_viol += (ga != 0.f) + (gt != 0.f);
              } else {
                eAqk.add(ga, Aqk[r][s2]);
                eTm.add(gt, Tm[r][s2]);
              }
            }
          }
          for (int cc = 0; cc < K; ++cc) eGl.add(f32_at(r16 + kR16OffGL, cc), std::exp(G[15][cc]));
        }
      }
  // Tolerances: bf16 storage (2^-9 relative) of W, qg, kbT; tf32 rounding of Aqk, Tm (2^-11) with
  // the operands' f16 / tf32 roundings; gL: exp2f of a float cumulative sum.
  struct Row {
    const char* what;
    const Err& e;
    double tol;
  } rows[] = {{"W", eW, 4e-3},     {"qg", eQg, 3e-3}, {"kbT", eKb, 3e-3},
              {"Aqk", eAqk, 2e-3}, {"Tm", eTm, 2e-3}, {"gL", eGl, 1e-5}};
  for (const Row& r : rows) {
    const bool ok = r.e.nonfinite == 0 && r.e.rel() <= r.tol;
    failures += !ok;
    std::printf("  %-4s rel_l2 %.3e (tol %.0e) max_abs %.3e nonfinite %lld %s\n", r.what, r.e.rel(),
                r.tol, r.e.max_abs, static_cast<long long>(r.e.nonfinite), ok ? "ok" : "FAIL");
  }
  std::printf("  above-diagonal entries of Aqk / Tm not zero: %lld %s\n",
              static_cast<long long>(zero_viol), zero_viol ? "FAIL" : "ok");
  failures += zero_viol != 0;
}

}  // namespace

int main() {
  // The two-kernel plan on 16-token records whatever the shape (a small call may otherwise take
  // the fused kernel, which has no workspace records to check).
  detail::Tuning t = detail::tuning();
  t.prefill_fused = -1;
  t.prefill_chunk = 16;
  const detail::ScopedTuning scope(t);
  auto base = [] {
    PrefillCase c;
    c.K = 128;
    c.V = 128;
    c.H = 1;
    c.HV = 2;
    c.dtype = DType::kBFloat16;
    c.gate = GateForm::kLowerBound;
    c.seqlens = {100, 100};
    c.seed = 7;
    return c;
  };
  {
    PrefillCase c = base();
    run(c);
  }  // lower bound -5
  {
    PrefillCase c = base();
    c.gate = GateForm::kSoftplus;
    c.seqlens = {70};
    c.H = 2;
    c.HV = 4;
    run(c);
  }  // GVA
  {
    PrefillCase c = base();
    c.allow_neg_eigval = true;
    c.lower_bound = -0.05;
    c.seqlens = {64};
    run(c);
  }  // weak decay
  {
    PrefillCase c = base();
    c.gate = GateForm::kPrecomputed;
    c.gate_extreme = -1000;
    c.seqlens = {80};
    run(c);
  }  // pairwise
  {
    PrefillCase c = base();
    c.dtype = DType::kFloat16;
    c.seqlens = {33};
    run(c);
  }  // fp16 inputs
  std::printf("%d failures\n", failures);
  return failures != 0;
}
