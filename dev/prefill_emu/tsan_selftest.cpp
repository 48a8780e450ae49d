// tsan_selftest.cpp — checks the emulator's ThreadSanitizer model (tsan.h) on small blocks whose
// verdict is known: each case runs in a child process (this program with the case's index) and
// must end with a TSan report (exit status 66) exactly when it has a race under the CUDA memory
// model. Built only with -DKDA_EMU_TSAN=ON (CTest emu_tsan); dev/emu_race.sh runs it first.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda/common/ptx.cuh"  // the shim's (the include path puts shim/ first)
#include "fibers.h"

using namespace kda::cuda::pf;

namespace {
alignas(1024) uint8_t g_smem[16 * 1024];
alignas(16) uint8_t g_src[64];
constexpr uint32_t kBar = 8192, kBuf = 1024, kCnt = 2048;

void read_buf() {
  volatile uint8_t x = g_smem[kBuf];
  (void)x;
}
void write_buf() { g_smem[kBuf] = 1; }
void lag() {  // let the other fibers run first
  for (int i = 0; i < 4; ++i) emu::yield_fiber();
}
void refill() {
  mbar_arrive_expect_tx(kBar, 16);
  bulk_copy_g2s(kBuf, g_src, 16, kBar);
}
unsigned* counter() { return reinterpret_cast<unsigned*>(g_smem + kCnt); }

struct Case {
  const char* name;
  bool race;
  void (*body)(int t);
};
// 64 threads (two warps); thread 0 has initialized the mbarrier and the counter, then a block
// barrier.
const Case kCases[] = {
    {"plain write / read", true,
     [](int t) {
       if (t == 0) write_buf();
       if (t == 32) read_buf();
     }},
    {"block barrier", false,
     [](int t) {
       if (t == 0) write_buf();
       __syncthreads();
       if (t == 32) read_buf();
     }},
    {"named barrier", false,
     [](int t) {
       if (t == 0) write_buf();
       named_barrier_sync(1, 64);
       if (t == 32) read_buf();
     }},
    {"__syncwarp", false,
     [](int t) {
       if (t == 0) write_buf();
       __syncwarp();
       if (t == 1) read_buf();
     }},
    {"a shuffle orders nothing", true,
     [](int t) {
       if (t == 0) write_buf();
       (void)__shfl_sync(0xffffffffu, t, 0);
       if (t == 1) read_buf();
     }},
    {"bulk copy over unordered reads", true,
     [](int t) {
       if (t == 32) read_buf();
       if (t == 0) {
         lag();
         refill();
       }
     }},
    {"counter protocol (fence, atomic; last: fence, copy)", false,
     [](int t) {
       if (t % 32 != 0) return;
       if (t == 32) read_buf();
       if (t == 0) lag();
       __threadfence_block();
       if (atomicAdd(counter(), 1u) == 1u) {
         *counter() = 0u;  // the reset: ordered by observation order
         __threadfence_block();
         refill();
       }
     }},
    {"counter without fences", true,
     [](int t) {
       if (t % 32 != 0) return;
       if (t == 32) read_buf();
       if (t == 0) lag();
       if (atomicAdd(counter(), 1u) == 1u) refill();
     }},
    {"mbarrier wait before the read", false,
     [](int t) {
       if (t == 0) refill();
       if (t == 32) {
         mbar_wait(kBar, 0);
         read_buf();
       }
     }},
    {"read without the mbarrier wait", true,
     [](int t) {
       if (t == 0) refill();
       if (t == 32) {
         lag();
         read_buf();
       }
     }},
    {"cp.async waited after the barrier", true,
     [](int t) {
       if (t == 0) {
         cp_async_16(kBuf, g_src);
         cp_async_commit();
       }
       __syncthreads();
       if (t == 32) read_buf();
       if (t == 0) cp_async_wait<0>();
     }},
    {"cp.async waited before the barrier", false,
     [](int t) {
       if (t == 0) {
         cp_async_16(kBuf, g_src);
         cp_async_commit();
         cp_async_wait<0>();
       }
       __syncthreads();
       if (t == 32) read_buf();
     }},
    {"wgmma operand overwritten before the wait", true,
     [](int t) {
       if (t == 0) {
         emu::tsan::wgmma_read(&g_smem[kBuf], 1);
         wgmma_commit();
       }
       __syncthreads();
       if (t == 32) write_buf();
       if (t == 0) wgmma_wait<0>();
     }},
    {"wgmma operand overwritten after the wait", false,
     [](int t) {
       if (t == 0) {
         emu::tsan::wgmma_read(&g_smem[kBuf], 1);
         wgmma_commit();
         wgmma_wait<0>();
       }
       __syncthreads();
       if (t == 32) write_buf();
     }},
};
constexpr int kNumCases = sizeof(kCases) / sizeof(kCases[0]);

void run_case(int c) {
  emu::smem_base = g_smem;
  emu::smem_size = sizeof(g_smem);
  emu::run_block(64, 0, 1, [c] {
    const int t = static_cast<int>(threadIdx.x);
    if (t == 0) {
      mbar_init(kBar, 1);
      *counter() = 0u;
    }
    __syncthreads();
    kCases[c].body(t);
  });
}
}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    run_case(std::atoi(argv[1]));
    return 0;
  }
  int failures = 0;
  for (int c = 0; c < kNumCases; ++c) {
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("TSAN_OPTIONS", "halt_on_error=0 exitcode=66 report_signal_unsafe=0", 1);
      const std::string arg = std::to_string(c);
      execl("/proc/self/exe", argv[0], arg.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    const bool exited = WIFEXITED(status);
    const int code = exited ? WEXITSTATUS(status) : -1;
    const bool ok = exited && code == (kCases[c].race ? 66 : 0);
    std::printf("%-55s expect %-8s exit %3d  %s\n", kCases[c].name,
                kCases[c].race ? "race" : "no race", code, ok ? "ok" : "FAILED");
    failures += ok ? 0 : 1;
  }
  std::printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
