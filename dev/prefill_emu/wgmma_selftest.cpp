// wgmma_selftest.cpp — checks the emulated wgmma products of shim/cuda/common/ptx.cuh
// (wgmma_bf16 n64 / n128, wgmma_tf32 n64, wgmma_desc_sw128) against a naive fp64 product.
// Needs only the shim, not the kernels: CMake target kda_emu_wgmma_selftest (CTest emu_wgmma,
// -DKDA_BUILD_EMULATOR=ON).
// One warpgroup (128 fiber threads, 4 warps) runs a K loop of products over a B matrix stored in
// the 128-byte swizzle layout (common.cuh sw128_offset) at a 1024-aligned shared address; every
// output element is compared with the fp64 product (rounded to float after each K step, as the
// emulated accumulators are). Also: kScaleA = -1, accumulate = 0 over NaN accumulators, and
// accumulate = 1 from nonzero accumulators; and a few descriptor checks must abort.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "cuda/common/ptx.cuh"  // the shim's (the include path puts shim/ first)
#include "fibers.h"

using namespace kda::cuda::pf;

alignas(1024) static uint8_t g_smem[96 * 1024];
static constexpr uint32_t kBase = 3072;  // B's shared address: 1024-aligned, not 0

static int sw128(int rows, int row, int byte) {
  return (byte / 128) * rows * 128 + row * 128 + ((((byte / 16) & 7) ^ (row & 7)) << 4) +
         (byte & 15);
}
static uint16_t to_bf16(float x) {
  return (uint16_t)(__float_as_uint(x) >> 16);
}  // truncation: exact values below
static float bf16_val(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }
static float tf32_val(uint32_t u) { return __uint_as_float(u & 0xffffe000u); }

static int g_fail = 0;

// One test: M = 64, N = 8 NJ, K = Kel elements per row (a multiple of the step's k); bf16 (k16)
// or tf32 (k8). init: 0 = first step accumulate = 0 over NaN accumulators; 1 = all steps accumulate
// onto random initial accumulators. B is stored with `rows` rows (default N); the product reads
// rows row0 .. row0 + N - 1 (row0 a multiple of 8).
template <int NJ, bool kTf32, int kScaleA>
static void test_case(int Kel, int init, unsigned seed, int rows = 8 * NJ, int row0 = 0) {
  constexpr int M = 64, N = 8 * NJ, KS = kTf32 ? 8 : 16, esize = kTf32 ? 4 : 2;
  const int steps = Kel / KS;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  // A [M][Kel], B [N][Kel] as raw bits (bf16 or fp32; tf32 inputs keep their full fp32 bits so that
  // the truncation to tf32 is exercised).
  std::vector<uint32_t> A(M * Kel), B(rows * Kel);
  for (auto& x : A) x = kTf32 ? __float_as_uint(U(rng)) : to_bf16(U(rng));
  for (auto& x : B) x = kTf32 ? __float_as_uint(U(rng)) : to_bf16(U(rng));
  auto val = [&](uint32_t bits) {
    return kTf32 ? (double)tf32_val(bits) : (double)bf16_val((uint16_t)bits);
  };
  std::vector<float> D0(M * N);
  for (auto& x : D0) x = init ? 4.f * U(rng) : __uint_as_float(0x7fc00000u);
  // B into shared memory (the rest poisoned with NaN bytes).
  std::memset(g_smem, 0xff, sizeof(g_smem));
  const int blocks = (Kel * esize + 127) / 128;
  if (kBase + blocks * rows * 128 > sizeof(g_smem)) {
    std::fprintf(stderr, "test smem too small\n");
    std::abort();
  }
  for (int n = 0; n < rows; ++n)
    for (int k = 0; k < Kel; ++k)
      std::memcpy(g_smem + kBase + sw128(rows, n, k * esize), &B[n * Kel + k], esize);
  // Reference: fp64 sum per K step, rounded to float after each step (the emulation's accumulator
  // rounding); also the pure fp64 product for information.
  std::vector<float> ref(M * N);
  double max_pure = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = D0[m * N + n];
      double pure = init ? D0[m * N + n] : 0.0;
      for (int s = 0; s < steps; ++s) {
        double t = (init || s > 0) ? (double)acc : 0.0;
        for (int k = s * KS; k < (s + 1) * KS; ++k) {
          const double p = val(A[m * Kel + k]) * val(B[(row0 + n) * Kel + k]);
          t += kScaleA * p;
          pure += kScaleA * p;
        }
        acc = (float)t;
      }
      ref[m * N + n] = acc;
      max_pure = std::max(max_pure, std::fabs(pure - acc));
    }
  // Run the warpgroup.
  std::vector<float> out(M * N, 0.f);
  emu::smem_base = g_smem;
  emu::smem_size = sizeof(g_smem);
  emu::run_block(128, 0, 1, [&] {
    const int tid = threadIdx.x, w = tid / 32, l = tid % 32, g = l / 4, c = l % 4, r0 = 16 * w + g,
              r1 = r0 + 8;
    float d[NJ][4];
    for (int j = 0; j < NJ; ++j)
      for (int e = 0; e < 4; ++e) d[j][e] = D0[(r0 + 8 * (e >> 1)) * N + 8 * j + 2 * c + (e & 1)];
    for (int s = 0; s < steps; ++s) {
      uint32_t a[4];
      if (kTf32) {
        const int k0 = 8 * s;
        a[0] = A[r0 * Kel + k0 + c];
        a[1] = A[r1 * Kel + k0 + c];
        a[2] = A[r0 * Kel + k0 + c + 4];
        a[3] = A[r1 * Kel + k0 + c + 4];
      } else {
        const int k0 = 16 * s;
        auto pk = [&](int r, int k) { return A[r * Kel + k] | (A[r * Kel + k + 1] << 16); };
        a[0] = pk(r0, k0 + 2 * c);
        a[1] = pk(r1, k0 + 2 * c);
        a[2] = pk(r0, k0 + 2 * c + 8);
        a[3] = pk(r1, k0 + 2 * c + 8);
      }
      const int kb = s * 32;  // byte offset of the K step in a row
      const uint64_t desc =
          wgmma_desc_sw128(kBase + (kb / 128) * rows * 128 + row0 * 128 + kb % 128);
      const int accumulate = (init || s > 0) ? 1 : 0;
      wgmma_fence();
      if constexpr (kTf32)
        wgmma_tf32<NJ, kScaleA>(d, a, desc, accumulate);
      else
        wgmma_bf16<NJ, kScaleA>(d, a, desc, accumulate);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_acc(d);
    }
    for (int j = 0; j < NJ; ++j)
      for (int e = 0; e < 4; ++e) out[(r0 + 8 * (e >> 1)) * N + 8 * j + 2 * c + (e & 1)] = d[j][e];
  });
  int bad = 0;
  double max_err = 0;
  for (int i = 0; i < M * N; ++i) {
    const double err = std::fabs((double)out[i] - ref[i]);
    if (!(err <= 1e-6 * (1.0 + std::fabs(ref[i])))) {
      if (bad < 5)
        std::printf("    mismatch m=%d n=%d: emu %.9g ref %.9g\n", i / N, i % N, out[i], ref[i]);
      ++bad;
    }
    if (err == err)
      max_err = std::max(max_err, err);
    else
      max_err = INFINITY;
  }
  std::printf(
      "%-12s n%-3d K=%-3d rows %3d..%-3d scaleA=%+d %-28s: %s (max |emu-ref| %.3g, max |ref-fp64 "
      "unrounded| %.3g)\n",
      kTf32 ? "tf32" : "bf16", N, Kel, row0, row0 + N - 1, kScaleA,
      init ? "accumulate onto random D" : "accumulate=0 first (D=NaN)", bad ? "FAIL" : "ok",
      max_err, max_pure);
  if (bad) ++g_fail;
}

// Runs fn in a child process; true when it aborted (an EMU_CHECK fired).
static bool aborts(const std::function<void()>& fn) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    std::freopen("/dev/null", "w", stderr);
    fn();
    std::_Exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
}
static void run_one_desc(uint64_t desc) {
  emu::smem_base = g_smem;
  emu::smem_size = sizeof(g_smem);
  emu::run_block(32, 0, 1, [desc] {
    float d[8][4] = {};
    const uint32_t a[4] = {};
    wgmma_bf16<8>(d, a, desc, 0);
  });
}
static void run_one_desc_tf32(uint64_t desc) {
  emu::smem_base = g_smem;
  emu::smem_size = sizeof(g_smem);
  emu::run_block(32, 0, 1, [desc] {
    float d[8][4] = {};
    const uint32_t a[4] = {};
    wgmma_tf32<8>(d, a, desc, 0);
  });
}

int main() {
  // Descriptor bits.
  const uint64_t dsc = wgmma_desc_sw128(0x1020);
  const uint64_t want = 0x102ull | (1ull << 16) | (64ull << 32) | (1ull << 62);
  std::printf("wgmma_desc_sw128(0x1020) = 0x%016llx (want 0x%016llx): %s\n",
              (unsigned long long)dsc, (unsigned long long)want, dsc == want ? "ok" : "FAIL");
  if (dsc != want) ++g_fail;

  test_case<8, false, 1>(128, 0, 1);  // W / qg-like: [N][128] bf16, two column blocks
  test_case<8, false, -1>(128, 1, 2);
  test_case<8, false, 1>(64, 1, 3);  // kbT-like rows of 64 bf16: one block
  test_case<16, false, 1>(64, 0, 4);
  test_case<16, false, -1>(64, 1, 5);
  test_case<16, false, 1>(128, 1, 6);
  test_case<8, true, 1>(64, 0, 7);  // fp32 rows of 64: two blocks
  test_case<8, true, -1>(64, 1, 8);
  test_case<8, true, -1>(64, 0, 9);
  test_case<8, true, 1>(64, 1, 10, 64, 0);

  // Descriptor checks that must abort.
  std::memset(g_smem, 0, sizeof(g_smem));
  struct {
    const char* what;
    bool tf;
    uint64_t desc;
    bool must_abort;
  } dc[] = {
      {"valid descriptor (control)", false, wgmma_desc_sw128(kBase + 96), false},
      {"tf32 valid descriptor (control)", true, wgmma_desc_sw128(kBase + 96), false},
      {"start not 1024-aligned (+128)", false, wgmma_desc_sw128(kBase + 128), true},
      {"K slice crosses the row (+112)", false, wgmma_desc_sw128(kBase + 112), true},
      {"tf32 K slice crosses the row (+112)", true, wgmma_desc_sw128(kBase + 112), true},
      {"layout type 0", false, wgmma_desc_sw128(kBase) & ~(3ull << 62), true},
      {"stride byte offset 512", false,
       (wgmma_desc_sw128(kBase) & ~(0x3fffull << 32)) | (32ull << 32), true},
      {"base offset 1", false, wgmma_desc_sw128(kBase) | (1ull << 49), true},
      {"out of shared memory", false, wgmma_desc_sw128(sizeof(g_smem) - 1024), true},
  };
  for (auto& c : dc) {
    const bool ab = aborts([&] { c.tf ? run_one_desc_tf32(c.desc) : run_one_desc(c.desc); });
    const bool ok = ab == c.must_abort;
    std::printf("check: %-36s %s: %s\n", c.what, ab ? "aborts" : "runs", ok ? "ok" : "FAIL");
    if (!ok) ++g_fail;
  }
  std::printf(g_fail ? "FAILED (%d)\n" : "all passed\n", g_fail);
  return g_fail ? 1 : 0;
}
