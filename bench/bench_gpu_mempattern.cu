// bench_gpu_mempattern — ceilings of the decode state stream on this GPU (a development tool).
//
// Decode reads and writes, in place, one [V, K] fp32 state per (sequence, value head). This
// program times the bare memory pattern with no arithmetic, over the B = 256, HV = 32, K = V =
// 128 pool (537 MB), in several ways, so the decode kernel can be compared with what the
// pattern itself allows: registers vs cp.async vs bulk copies, tile sizes, a dependent index
// load, in place vs out of place, persistent grids. Prints TB/s counting bytes read + written.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "bench_cuda.h"

namespace {

constexpr int kTileBytes = 16384;  // 32 rows x 128 fp32
constexpr int kUnits = kTileBytes / 16;

__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ void st_cs(uint4* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 bump(uint4 v) {
  v.x += 1u;
  return v;
}

// First 16-byte unit of tile t (kTileUnits units) of the pool; with an index, the 64 KB head of
// the tile goes through it (a permutation of heads), as decode's slot lookup.
template <int kTileUnits = kUnits>
__device__ __forceinline__ int64_t tile_base(const int* idx, int64_t t) {
  if (idx == nullptr) return t * kTileUnits;
  constexpr int64_t kPerHead = 4096 / kTileUnits;
  return (static_cast<int64_t>(__ldg(idx + t / kPerHead)) * kPerHead + t % kPerHead) * kTileUnits;
}

// Registers: kThreads threads, each holds kPer 16-byte units of a tile of kThreads*kPer units.
template <int kThreads, int kPer>
__global__ void __launch_bounds__(kThreads)
    reg_kernel(uint4* dst, const uint4* src, const int* idx) {
  constexpr int kTileUnits = kThreads * kPer;
  const int64_t base = tile_base<kTileUnits>(idx, blockIdx.x);
  uint4 r[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) r[i] = ld_nc(src + base + i * kThreads + threadIdx.x);
#pragma unroll
  for (int i = 0; i < kPer; ++i) st_cs(dst + base + i * kThreads + threadIdx.x, bump(r[i]));
}

// cp.async 16 B into shared memory, then stores from shared memory (the staged decode kernel's
// pattern).
__global__ void __launch_bounds__(128)
    cpasync_kernel(uint4* dst, const uint4* src, const int* idx) {
  __shared__ uint4 sh[kUnits];
  const int64_t base = tile_base(idx, blockIdx.x);
#pragma unroll
  for (int i = 0; i < kUnits / 128; ++i) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(&sh[i * 128 + threadIdx.x]));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s),
                 "l"(src + base + i * 128 + threadIdx.x)
                 : "memory");
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kUnits / 128; ++i)
    st_cs(dst + base + i * 128 + threadIdx.x, bump(sh[i * 128 + threadIdx.x]));
}

// One bulk copy in, one bulk copy out (TMA, 1-D), kBytes per block. kHint: L2 evict-first cache
// policy on the load (bit 0) and on the store (bit 1).
template <int kBytes, int kHint = 0>
__global__ void __launch_bounds__(128) bulk_kernel(uint4* dst, const uint4* src, const int* idx) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bar;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kBytes / 16);
  (void)idx;
  const unsigned bar_s = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  const unsigned sm_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_s), "r"(kBytes)
                 : "memory");
    if constexpr (kHint & 1) {
      uint64_t pol;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
          "[%1], %2, [%3], %4;" ::"r"(sm_s),
          "l"(src + base), "r"(kBytes), "r"(bar_s), "l"(pol)
          : "memory");
    } else {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(sm_s),
          "l"(src + base), "r"(kBytes), "r"(bar_s)
          : "memory");
    }
  }
  __syncthreads();
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, "
        "p; }"
        : "=r"(done)
        : "r"(bar_s)
        : "memory");
  }
  uint4* sh = reinterpret_cast<uint4*>(smem);
  for (int i = threadIdx.x; i < kBytes / 16; i += 128) sh[i] = bump(sh[i]);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    if constexpr (kHint & 2) {
      uint64_t pol;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
      asm volatile(
          "cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(
              dst + base),
          "r"(sm_s), "r"(kBytes), "l"(pol)
          : "memory");
    } else {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + base),
                   "r"(sm_s), "r"(kBytes)
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

// Persistent grid, registers, next tile's loads issued before this tile's stores.
template <int kPer>
__global__ void __launch_bounds__(128) persist_kernel(uint4* dst, const uint4* src, int64_t tiles) {
  constexpr int kTileUnits = 128 * kPer;
  int64_t t = blockIdx.x;
  uint4 r[kPer];
  if (t < tiles) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) r[i] = ld_nc(src + t * kTileUnits + i * 128 + threadIdx.x);
  }
  for (; t < tiles; t += gridDim.x) {
    uint4 n[kPer];
    const int64_t tn = t + gridDim.x;
    if (tn < tiles) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) n[i] = ld_nc(src + tn * kTileUnits + i * 128 + threadIdx.x);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) st_cs(dst + t * kTileUnits + i * 128 + threadIdx.x, bump(r[i]));
#pragma unroll
    for (int i = 0; i < kPer; ++i) r[i] = n[i];
  }
}

// B = 1 latency floor: an empty kernel, and the bare decode chain (index load -> 16 KB state tile
// into registers -> store back), 128 blocks; PDL prologue as the library's kernels.
__global__ void empty_kernel() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__global__ void __launch_bounds__(128) chain_kernel(uint4* pool, const int* idx) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int64_t slot = __ldg(idx) & 255;  // one of the 256 sequence slots (128 tiles each)
  const int64_t base = (slot * 128 + blockIdx.x) * kUnits;
  uint4 r[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) r[i] = ld_nc(pool + base + i * 128 + threadIdx.x);
#pragma unroll
  for (int i = 0; i < 8; ++i) st_cs(pool + base + i * 128 + threadIdx.x, bump(r[i]));
}

// Per-launch time of a CUDA graph of `calls` launches (each with or without the PDL attribute).
template <class... A>
double graph_us(void (*k)(A...), int blocks, bool pdl, int calls, cudaStream_t s, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(128);
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaGraph_t g;
  cudaGraphExec_t e;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < calls; ++i) cudaLaunchKernelEx(&cfg, k, args...);
  cudaStreamEndCapture(s, &g);
  cudaGraphInstantiate(&e, g, 0);
  const double us = time_it([&] { cudaGraphLaunch(e, s); }, s);
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
  return us / calls;
}

template <class F>
double time_it(F launch, cudaStream_t s) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> us;
  for (int i = 0; i < 23; ++i) {
    cudaEventRecord(a, s);
    launch();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (i >= 3) us.push_back(1e3 * ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main() {
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::printf("bench_gpu_mempattern: no CUDA device; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 9) {
    std::printf("bench_gpu_mempattern: needs sm_90 (%s)\n", prop.name);
    return 0;
  }
  const int64_t heads = 256 * 32;
  const int64_t bytes = heads * 65536;
  const int64_t tiles = bytes / kTileBytes;
  uint4 *a = nullptr, *b = nullptr;
  int* idx = nullptr;
  BENCH_CUDA(cudaMalloc(&a, bytes));
  BENCH_CUDA(cudaMalloc(&b, bytes));
  BENCH_CUDA(cudaMalloc(&idx, heads * sizeof(int)));
  std::vector<int> perm(heads);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  BENCH_CUDA(cudaMemcpy(idx, perm.data(), heads * sizeof(int), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemset(a, 0, bytes));
  BENCH_CUDA(cudaMemset(b, 0, bytes));
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreate(&s));
  const int sms = prop.multiProcessorCount;
  auto report = [&](const char* name, double us) {
    std::printf("  %-44s %9.2f us  %.3f TB/s\n", name, us, 2.0 * bytes / (us * 1e-6) / 1e12);
  };
  std::printf("pool %.0f MB, %lld tiles of 16 KB, %d SMs\n", bytes / 1e6,
              static_cast<long long>(tiles), sms);
  report("cudaMemcpy D2D (out of place)",
         time_it([&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s); }, s));
  report("reg 128 thr x 8 units (16 KB), in place",
         time_it([&] { reg_kernel<128, 8><<<tiles, 128, 0, s>>>(a, a, nullptr); }, s));
  report("reg 128 thr x 8 units, out of place",
         time_it([&] { reg_kernel<128, 8><<<tiles, 128, 0, s>>>(b, a, nullptr); }, s));
  report("reg 128 thr x 8 units, in place, index load",
         time_it([&] { reg_kernel<128, 8><<<tiles, 128, 0, s>>>(a, a, idx); }, s));
  report("reg 256 thr x 8 units (32 KB), in place, index",
         time_it([&] { reg_kernel<256, 8><<<tiles / 2, 256, 0, s>>>(a, a, idx); }, s));
  report("reg 128 thr x 4 units (8 KB), in place, index",
         time_it([&] { reg_kernel<128, 4><<<tiles * 2, 128, 0, s>>>(a, a, idx); }, s));
  report("reg 64 thr x 8 units (8 KB), in place, index",
         time_it([&] { reg_kernel<64, 8><<<tiles * 2, 64, 0, s>>>(a, a, idx); }, s));
  report("reg 128 thr x 16 units (32 KB), in place, index",
         time_it([&] { reg_kernel<128, 16><<<tiles / 2, 128, 0, s>>>(a, a, idx); }, s));
  report("cp.async 16 KB -> smem -> st, in place",
         time_it([&] { cpasync_kernel<<<tiles, 128, 0, s>>>(a, a, nullptr); }, s));
  report("cp.async 16 KB -> smem -> st, in place, index",
         time_it([&] { cpasync_kernel<<<tiles, 128, 0, s>>>(a, a, idx); }, s));
  // A bulk kernel over the pool, one tile of `tile` bytes per block (its dynamic shared memory).
  auto bulk = [&](auto kernel, int tile, uint4* dst) {
    BENCH_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, tile));
    const auto blocks = static_cast<unsigned>(bytes / tile);
    return time_it([&] { kernel<<<blocks, 128, tile, s>>>(dst, a, nullptr); }, s);
  };
  report("bulk 16 KB in, bulk out, in place", bulk(bulk_kernel<16384>, 16384, a));
  report("bulk 32 KB in, bulk out, in place", bulk(bulk_kernel<32768>, 32768, a));
  report("bulk 16 KB in, bulk out, out of place", bulk(bulk_kernel<16384>, 16384, b));
  report("bulk 16 KB, in place, load evict-first", bulk(bulk_kernel<16384, 1>, 16384, a));
  report("bulk 16 KB, in place, store evict-first", bulk(bulk_kernel<16384, 2>, 16384, a));
  report("bulk 16 KB, in place, both evict-first", bulk(bulk_kernel<16384, 3>, 16384, a));
  for (int per_sm : {4, 8, 12}) {
    char name[64];
    std::snprintf(name, sizeof name, "persistent reg x 8, %d blocks/SM, in place", per_sm);
    report(name, time_it([&] { persist_kernel<8><<<sms * per_sm, 128, 0, s>>>(a, a, tiles); }, s));
  }
  for (bool pdl : {false, true}) {
    std::printf(
        "  graph of 20, %s: empty kernel %.2f us per launch; B = 1 chain (index -> 16 KB tile -> "
        "store, 128 blocks) %.2f us\n",
        pdl ? "PDL" : "no PDL", graph_us(empty_kernel, 128, pdl, 20, s),
        graph_us(chain_kernel, 128, pdl, 20, s, a, static_cast<const int*>(idx)));
  }
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaStreamSynchronize(s));
  cudaFree(a);
  cudaFree(b);
  cudaFree(idx);
  return 0;
}
