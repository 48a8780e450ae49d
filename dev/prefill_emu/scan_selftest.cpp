// scan_selftest.cpp — segment_scan_kernel (prefill/segments.cuh) against an fp64 product, on the
// emulator. A dense batch of N sequences of kSegs segments each, HV value heads: random start rows
// seg_start[first + 1], local rows seg_local and transitions seg_trans of three kinds (near the
// identity; a decay diagonal with small mixing; dense entries in [-1, 1]). Every step's output row
// x_{s+1} is compared with the fp64 value of x_s Mt_s + l_s computed from the kernel's own x_s, so
// that each step's rounding is measured alone; the error of an element is taken relative to
// sum_k |x_k| |Mt_kn| + |l_n| (what bounds the rounding of any summation order). The same
// measure for an fp32 FMA product (16-term chains summed over 8 partials, the kernel's former
// order) is printed alongside; the kernel's must stay at that level. Each sequence's slots 0 and 1
// (not written by the scan) must be left as they were.
// Built by CMake with -DKDA_BUILD_EMULATOR=ON (target kda_emu_scan_selftest, CTest emu_scan).
#include <cmath>
#include <random>

#include "engine.h"

using namespace kda::cuda::pf;

namespace {

constexpr int kN = 2, kHV = 2, kSegs = 6, kD = 128;
constexpr int64_t kMat = int64_t{kD} * kD;

struct Err {
  double max_abs = 0, max_rel = 0;
  void add(double got, double ref, double scale) {
    const double e = std::fabs(got - ref);
    max_abs = std::max(max_abs, e);
    max_rel = std::max(max_rel, scale > 0 ? e / scale : e);
  }
};

}  // namespace

int main() {
  const int64_t slots = int64_t{kN} * kSegs;
  std::vector<float> start(slots * kHV * kMat), local(slots * kHV * kMat),
      trans(slots * kHV * kMat);
  std::mt19937 rng(20);
  std::uniform_real_distribution<float> u(-1.f, 1.f), d(0.5f, 1.f), d1(0.95f, 1.f);
  for (float& x : start) x = u(rng);
  for (float& x : local) x = u(rng);
  for (int64_t s = 0; s < slots; ++s)
    for (int hv = 0; hv < kHV; ++hv) {
      float* m = trans.data() + (s * kHV + hv) * kMat;
      const int kind = static_cast<int>((s + hv) % 3);
      for (int k = 0; k < kD; ++k)
        for (int n = 0; n < kD; ++n) {
          float v = u(rng);
          if (kind == 0) v = 1e-3f * v + (k == n ? d1(rng) : 0.f);
          if (kind == 1) v = 0.05f * v + (k == n ? d(rng) : 0.f);
          m[k * kD + n] = v;
        }
    }
  const std::vector<float> start0 = start;

  Params p;
  p.N = kN;
  p.HV = kHV;
  p.H = kHV;
  p.B = kN;
  p.T = int64_t{kSegs} * 64;
  p.chunks_per_seq = kSegs;
  p.varlen = false;
  p.seg_tokens = 64;
  p.segs_per_seq = kSegs;
  p.seg_slots = slots;
  auto view = [&](std::vector<float>& v) {
    StateView sv;
    sv.data = v.data();
    sv.rows = slots;
    sv.s0 = kHV * kMat;
    sv.s1 = kMat;
    sv.s2 = kD;
    return sv;
  };
  p.seg_start = view(start);
  p.seg_local = view(local);
  p.seg_trans = view(trans);
  emu_run::launch(segment_scan_kernel, int64_t{kN} * kHV * kScanBlocksPerHead, kScanThreads,
                  kScanSmemBytes, p);

  Err tc[3], fma[3];
  int64_t untouched_bad = 0, nonfinite = 0;
  for (int n = 0; n < kN; ++n)
    for (int hv = 0; hv < kHV; ++hv)
      for (int j = 0; j < kSegs; ++j) {
        const int64_t s = int64_t{n} * kSegs + j;
        const float* out = start.data() + (s * kHV + hv) * kMat;
        if (j <= 1) {  // slot 0 unused by the scan, slot 1 its input
          for (int64_t i = 0; i < kMat; ++i)
            untouched_bad += out[i] != start0[(s * kHV + hv) * kMat + i];
          continue;
        }
        // out = x_{s} where x = start[s - 1], Mt = trans[s - 1], l = local[s - 1]
        const float* x = start.data() + ((s - 1) * kHV + hv) * kMat;
        const float* m = trans.data() + ((s - 1) * kHV + hv) * kMat;
        const float* l = local.data() + ((s - 1) * kHV + hv) * kMat;
        const int kind = static_cast<int>((s - 1 + hv) % 3);
        for (int row = 0; row < kD; ++row)
          for (int col = 0; col < kD; ++col) {
            double ref = l[row * kD + col], scale = std::fabs(ref);
            float part[8];
            for (int w = 0; w < 8; ++w) {
              float a = 0.f;
              for (int k = 16 * w; k < 16 * w + 16; ++k)
                a = std::fmaf(x[row * kD + k], m[k * kD + col], a);
              part[w] = a;
            }
            float f = l[row * kD + col];
            for (int w = 0; w < 8; ++w) f += part[w];
            for (int k = 0; k < kD; ++k) {
              const double t = static_cast<double>(x[row * kD + k]) * m[k * kD + col];
              ref += t;
              scale += std::fabs(t);
            }
            const float got = out[row * kD + col];
            if (!std::isfinite(got)) ++nonfinite;
            tc[kind].add(got, ref, scale);
            fma[kind].add(f, ref, scale);
          }
      }
  const char* names[3] = {"near identity", "decay + 0.05 mixing", "dense [-1, 1]"};
  int failures = 0;
  for (int kind = 0; kind < 3; ++kind) {
    std::printf(
        "%-20s tensor cores: max abs %.3g, max rel %.3g | fp32 FMA: max abs %.3g, "
        "max rel %.3g\n",
        names[kind], tc[kind].max_abs, tc[kind].max_rel, fma[kind].max_abs, fma[kind].max_rel);
    // fp32 level: within twice the FMA product's worst relative error, and below 2^-20.
    if (!(tc[kind].max_rel <= 2 * fma[kind].max_rel && tc[kind].max_rel < 0x1p-20)) ++failures;
  }
  if (untouched_bad || nonfinite) ++failures;
  std::printf("rows changed that the scan must not write: %lld, non-finite outputs: %lld\n",
              static_cast<long long>(untouched_bad), static_cast<long long>(nonfinite));
  std::printf(failures ? "FAILED\n" : "passed\n");
  return failures ? 1 : 0;
}
