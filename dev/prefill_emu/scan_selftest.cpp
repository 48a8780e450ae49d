// scan_selftest.cpp — segment_scan_kernel (prefill/segments.cuh) against fp64, on the emulator.
// One sequence of kSegs segments (kSegs - 2 scan steps), kHV value heads, each head's transitions
// of one kind: near the identity; a decay diagonal with small mixing; dense entries in [-1, 1].
// Start rows seg_start[1], local rows and transitions random. Two measures, each printed beside
// the same measure of an fp32 FMA product (16-term chains summed over 8 partials, the kernel's
// former order), at whose level the kernel must stay:
//   step: every output row x_{s+1} against the fp64 value of x_s Mt_s + l_s from the kernel's own
//     x_s (each step's rounding alone), the error of an element relative to
//     sum_k |x_k| |Mt_kn| + |l_n| (what bounds the rounding of any summation order);
//   chain: the last start state against the fp64 chain from seg_start[1] (rel L2): the rounding
//     compounded over the steps.
// Run twice: the emulated mma results rounded to nearest, then truncated (the shim's
// mma_tf32_toward_zero, a model of a hardware adder that drops bits: its bias toward zero adds up
// over the chain). Slots 0 and 1 (not written by the scan) must be left as they were. Built by
// CMake with -DKDA_BUILD_EMULATOR=ON (target kda_emu_scan_selftest, CTest emu_scan).
#include <cmath>
#include <random>

#include "engine.h"

using namespace kda::cuda::pf;

namespace {

constexpr int kHV = 3, kSegs = 34, kD = 128;
constexpr int64_t kMat = int64_t{kD} * kD;

struct Err {
  double max_abs = 0, max_rel = 0;
  void add(double got, double ref, double scale) {
    const double e = std::fabs(got - ref);
    max_abs = std::max(max_abs, e);
    max_rel = std::max(max_rel, scale > 0 ? e / scale : e);
  }
};

// out = x m + l (128 x 128, row-major) in fp64 (ref, and scale = sum |x_k m_kn| + |l_n|) and in
// fp32 FMA in the kernel's former order (f).
void step_ref(const float* x, const float* m, const float* l, std::vector<double>* ref,
              std::vector<double>* scale, std::vector<float>* f) {
  for (int row = 0; row < kD; ++row)
    for (int col = 0; col < kD; ++col) {
      double r = l[row * kD + col], sc = std::fabs(r);
      float sum = l[row * kD + col];
      for (int w = 0; w < 8; ++w) {
        float a = 0.f;
        for (int k = 16 * w; k < 16 * w + 16; ++k)
          a = std::fmaf(x[row * kD + k], m[k * kD + col], a);
        sum += a;
      }
      for (int k = 0; k < kD; ++k) {
        const double t = static_cast<double>(x[row * kD + k]) * m[k * kD + col];
        r += t;
        sc += std::fabs(t);
      }
      (*ref)[row * kD + col] = r;
      (*scale)[row * kD + col] = sc;
      (*f)[row * kD + col] = sum;
    }
}

// The fp64 chain's next state from fp64 x.
void step_fp64(const std::vector<double>& x, const float* m, const float* l,
               std::vector<double>* out) {
  for (int row = 0; row < kD; ++row)
    for (int col = 0; col < kD; ++col) {
      double r = l[row * kD + col];
      for (int k = 0; k < kD; ++k) r += x[row * kD + k] * m[k * kD + col];
      (*out)[row * kD + col] = r;
    }
}

template <typename T>
double rel_l2(const T* got, const std::vector<double>& ref) {
  double se = 0, sr = 0;
  for (int64_t i = 0; i < kMat; ++i) {
    se += (got[i] - ref[i]) * (got[i] - ref[i]);
    sr += ref[i] * ref[i];
  }
  return std::sqrt(se / sr);
}

}  // namespace

int main() {
  std::vector<float> start(kSegs * kHV * kMat), local(kSegs * kHV * kMat),
      trans(kSegs * kHV * kMat);
  std::mt19937 rng(20);
  std::uniform_real_distribution<float> u(-1.f, 1.f), d(0.5f, 1.f), d1(0.95f, 1.f);
  for (float& x : start) x = u(rng);
  for (float& x : local) x = u(rng);
  for (int64_t s = 0; s < kSegs; ++s)
    for (int hv = 0; hv < kHV; ++hv) {
      float* m = trans.data() + (s * kHV + hv) * kMat;
      for (int k = 0; k < kD; ++k)
        for (int n = 0; n < kD; ++n) {
          float v = u(rng);
          if (hv == 0) v = 1e-3f * v + (k == n ? d1(rng) : 0.f);
          if (hv == 1) v = 0.05f * v + (k == n ? d(rng) : 0.f);
          m[k * kD + n] = v;
        }
    }
  const std::vector<float> start0 = start;
  auto at = [](const std::vector<float>& v, int64_t s, int hv) {
    return v.data() + (s * kHV + hv) * kMat;
  };

  Params p;
  p.N = 1;
  p.B = 1;
  p.HV = kHV;
  p.H = kHV;
  p.T = int64_t{kSegs} * 64;
  p.chunks_per_seq = kSegs;
  p.varlen = false;
  p.seg_tokens = 64;
  p.segs_per_seq = kSegs;
  p.seg_slots = kSegs;
  auto view = [&](std::vector<float>& v) {
    StateView sv;
    sv.data = v.data();
    sv.rows = kSegs;
    sv.s0 = kHV * kMat;
    sv.s1 = kMat;
    sv.s2 = kD;
    return sv;
  };
  p.seg_start = view(start);
  p.seg_local = view(local);
  p.seg_trans = view(trans);

  const char* names[kHV] = {"near identity", "decay + 0.05 mixing", "dense [-1, 1]"};
  int failures = 0;
  for (const bool toward_zero : {false, true}) {
    std::printf("mma results %s:\n", toward_zero ? "truncated (model)" : "rounded");
    start = start0;
    mma_tf32_toward_zero = toward_zero;
    emu_run::launch(segment_scan_kernel, kHV * kScanBlocksPerHead, kScanThreads, kScanSmemBytes, p);
    int64_t untouched_bad = 0, nonfinite = 0;
    for (int s = 0; s <= 1; ++s)
      for (int hv = 0; hv < kHV; ++hv)
        for (int64_t i = 0; i < kMat; ++i)
          untouched_bad += at(start, s, hv)[i] != at(start0, s, hv)[i];
    for (int hv = 0; hv < kHV; ++hv) {
      Err tc, fma;
      std::vector<double> ref(kMat), scale(kMat), chain(at(start, 1, hv), at(start, 1, hv) + kMat),
          next(kMat);
      std::vector<float> f(kMat), fchain(at(start, 1, hv), at(start, 1, hv) + kMat), fnext(kMat);
      for (int s = 2; s < kSegs; ++s) {
        const float* x = at(start, s - 1, hv);
        const float* m = at(trans, s - 1, hv);
        const float* l = at(local, s - 1, hv);
        const float* out = at(start, s, hv);
        step_ref(x, m, l, &ref, &scale, &f);
        for (int64_t i = 0; i < kMat; ++i) {
          if (!std::isfinite(out[i])) ++nonfinite;
          tc.add(out[i], ref[i], scale[i]);
          fma.add(f[i], ref[i], scale[i]);
        }
        step_fp64(chain, m, l, &next);
        chain.swap(next);
        std::vector<double> unused(kMat);
        step_ref(fchain.data(), m, l, &unused, &next, &fnext);
        fchain.swap(fnext);
      }
      const double chain_tc = rel_l2(at(start, kSegs - 1, hv), chain),
                   chain_fma = rel_l2(fchain.data(), chain);
      std::printf("  %-20s step: tensor cores max abs %.3g, max rel %.3g | fp32 FMA %.3g, %.3g\n",
                  names[hv], tc.max_abs, tc.max_rel, fma.max_abs, fma.max_rel);
      std::printf("  %-20s chain of %d steps, rel L2: tensor cores %.3g | fp32 FMA %.3g\n", "",
                  kSegs - 2, chain_tc, chain_fma);
      // fp32 level: within twice the FMA product's errors with rounded mma results, three times
      // with truncated ones.
      const double bar = toward_zero ? 3 : 2;
      if (!(tc.max_rel <= bar * fma.max_rel && chain_tc <= bar * chain_fma)) ++failures;
    }
    std::printf("  rows changed that the scan must not write: %lld, non-finite outputs: %lld\n",
                static_cast<long long>(untouched_bad), static_cast<long long>(nonfinite));
    if (untouched_bad || nonfinite) ++failures;
  }
  std::printf(failures ? "FAILED\n" : "passed\n");
  return failures ? 1 : 0;
}
