// bench_host_cost.cpp — host cost of one kda::prefill / kda::decode call from the C++ API.
//
// Protocol (targets.md, "Host cost of one call"): warm up, then time --calls back-to-back calls
// without synchronizing and divide by the number of calls; the median of --repeats such runs. On
// CUDA (a CUDA build with a supported GPU, unless --cpu) the inputs default to S1 for prefill
// (1 x 1024 tokens, H = 4, K = V = 128, bf16, lower-bound gate, beta logits, fp32 initial and
// final state) and B = 1, H = 32, K = V = 128 for decode (fp32 V-first pool of 2B slots): the
// GPU queue never fills, so the figure is the host time per call. On the CPU the shapes are tiny
// (1 x 16 tokens, H = 1, K = V = 32, one thread) and the figure includes the kernels' own time.
// Only the public header is used (and, on CUDA, the empty kernels of host_cost_kernels.cu).
//
// The breakdown, one row each: kda::validate alone; on CUDA, a bare launch of an empty kernel
// with <<<>>>, with cudaLaunchKernelEx, with the PDL attribute (as the library launches), with
// an 848-byte parameter block (the size of the prefill's Params), and with the driver's
// cuLaunchKernelEx and the PDL attribute; the whole kda::prefill (two launches on S1, four when
// segmented; one with KDA_CUDA_PREFILL_SINGLE=1 on S1 and smaller calls) and kda::decode (one). The
// launches and calls run on a stream of the benchmark's own (non-blocking) and on the legacy
// default stream, which is torch's default current stream. The table comes last, after its JSON.
//
// Usage: bench_host_cost [--cpu] [--T n] [--H n] [--K n] [--decode-B n] [--decode-H n]
//                        [--calls n] [--repeats n] [--threads n] [--json path]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kda/kda.h"

#ifdef KDA_BENCH_CUDA
#include <cuda_runtime.h>

#include "host_cost_kernels.h"
#endif

using namespace kda;

namespace {

struct Options {
  bool cpu = false;
  int64_t T = -1, H = -1, K = -1, decode_B = 1, decode_H = -1;
  int calls = 200, repeats = 7, threads = 1;
  std::string json;
};

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Memory for the inputs and outputs of one call, on the host or the device, zero-filled (the
// work of a call does not depend on the values).
class Buffers {
 public:
  explicit Buffers(bool device) : device_(device) {}
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (void* p : blocks_) {
#ifdef KDA_BENCH_CUDA
      if (device_) {
        cudaFree(p);
        continue;
      }
#endif
      std::free(p);
    }
  }
  void* bytes(size_t n) {
    void* p = nullptr;
#ifdef KDA_BENCH_CUDA
    if (device_) {
      if (cudaMalloc(&p, n) != cudaSuccess || cudaMemset(p, 0, n) != cudaSuccess) {
        std::fprintf(stderr, "bench_host_cost: cudaMalloc/cudaMemset of %zu bytes failed\n", n);
        std::exit(1);
      }
      blocks_.push_back(p);
      return p;
    }
#endif
    p = std::calloc(n > 0 ? n : 1, 1);
    if (p == nullptr) std::exit(1);
    blocks_.push_back(p);
    return p;
  }
  TensorView tensor(DType dtype, std::vector<int64_t> shape) {
    size_t n = dtype_size(dtype);
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    return make_view(bytes(n), dtype, std::move(shape), device_ ? Device::kCUDA : Device::kCPU, 0);
  }

 private:
  bool device_;
  std::vector<void*> blocks_;
};

double time_calls(const Options& o, const std::function<Status()>& call,
                  const std::function<void()>& sync) {
  for (int i = 0; i < std::max(10, o.calls / 10); ++i) {
    const Status s = call();
    if (!s.ok()) {
      std::fprintf(stderr, "bench_host_cost: %s\n", s.to_string().c_str());
      std::exit(1);
    }
  }
  sync();
  std::vector<double> runs;
  for (int r = 0; r < o.repeats; ++r) {
    const double t0 = now_us();
    for (int i = 0; i < o.calls; ++i) call();
    runs.push_back((now_us() - t0) / o.calls);
    sync();
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_host_cost [--cpu] [--T n] [--H n] [--K n] [--decode-B n] "
               "[--decode-H n] [--calls n] [--repeats n] [--threads n] [--json path]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    auto value = [&]() { return std::atoll(argv[++i]); };
    if (a == "--cpu")
      o.cpu = true;
    else if (a == "--T" && has_value)
      o.T = value();
    else if (a == "--H" && has_value)
      o.H = value();
    else if (a == "--K" && has_value)
      o.K = value();
    else if (a == "--decode-B" && has_value)
      o.decode_B = value();
    else if (a == "--decode-H" && has_value)
      o.decode_H = value();
    else if (a == "--calls" && has_value)
      o.calls = static_cast<int>(value());
    else if (a == "--repeats" && has_value)
      o.repeats = static_cast<int>(value());
    else if (a == "--threads" && has_value)
      o.threads = static_cast<int>(value());
    else if (a == "--json" && has_value)
      o.json = argv[++i];
    else
      return usage();
  }
  if (o.calls < 1 || o.repeats < 1) return usage();

  bool cuda = false;
#ifdef KDA_BENCH_CUDA
  if (!o.cpu)
    for (const DeviceInfo& d : cuda_devices()) cuda = cuda || (d.index == 0 && d.supported);
#endif
  if (o.T < 0) o.T = cuda ? 1024 : 16;
  if (o.H < 0) o.H = cuda ? 4 : 1;
  if (o.K < 0) o.K = cuda ? 128 : 32;
  if (o.decode_H < 0) o.decode_H = cuda ? 32 : 1;
  const DType dt = cuda ? DType::kBFloat16 : DType::kFloat32;
  const int64_t K = o.K, V = o.K;
  void* stream = nullptr;
  std::function<void()> sync = [] {};
#ifdef KDA_BENCH_CUDA
  cudaStream_t cs = nullptr;
  if (cuda) {
    if (cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess) return 1;
    stream = cs;
    sync = [cs] { cudaStreamSynchronize(cs); };
  }
#endif
  Buffers mem(cuda);

  // Prefill: one sequence of T tokens.
  PrefillParams p;
  p.q = mem.tensor(dt, {1, o.T, o.H, K});
  p.k = mem.tensor(dt, {1, o.T, o.H, K});
  p.v = mem.tensor(dt, {1, o.T, o.H, V});
  p.g = mem.tensor(dt, {1, o.T, o.H, K});
  p.beta = mem.tensor(dt, {1, o.T, o.H});
  p.A_log = mem.tensor(DType::kFloat32, {o.H});
  p.dt_bias = mem.tensor(DType::kFloat32, {o.H, K});
  p.out = mem.tensor(dt, {1, o.T, o.H, V});
  p.initial_state = mem.tensor(DType::kFloat32, {1, o.H, V, K});
  p.final_state = mem.tensor(DType::kFloat32, {1, o.H, V, K});
  p.math.gate = GateForm::kLowerBound;
  p.math.beta_logits = true;
  p.exec.stream = stream;
  p.exec.num_threads = o.threads;
  size_t ws = 0;
  Status s = prefill_workspace_size(p, &ws);
  if (!s.ok()) return std::fprintf(stderr, "bench_host_cost: %s\n", s.to_string().c_str()), 1;
  p.exec.workspace = ws > 0 ? mem.bytes(ws) : nullptr;
  p.exec.workspace_bytes = ws;

  // Decode: B sequences of one token, pool of 2B slots, slots 2n + 1.
  const int64_t B = o.decode_B, HD = o.decode_H;
  DecodeParams d;
  d.q = mem.tensor(dt, {B, 1, HD, K});
  d.k = mem.tensor(dt, {B, 1, HD, K});
  d.v = mem.tensor(dt, {B, 1, HD, K});
  d.g = mem.tensor(dt, {B, 1, HD, K});
  d.beta = mem.tensor(dt, {B, 1, HD});
  d.A_log = mem.tensor(DType::kFloat32, {HD});
  d.dt_bias = mem.tensor(DType::kFloat32, {HD, K});
  d.out = mem.tensor(dt, {B, 1, HD, K});
  d.state = mem.tensor(DType::kFloat32, {2 * B, HD, K, K});
  d.state_indices = mem.tensor(DType::kInt32, {B});
  {
    std::vector<int32_t> slots(static_cast<size_t>(B));
    for (int64_t n = 0; n < B; ++n) slots[static_cast<size_t>(n)] = static_cast<int32_t>(2 * n + 1);
#ifdef KDA_BENCH_CUDA
    if (cuda) {
      cudaMemcpy(d.state_indices.data, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice);
    } else
#endif
      std::memcpy(d.state_indices.data, slots.data(), slots.size() * 4);
  }
  d.math.gate = GateForm::kSoftplus;
  d.math.beta_logits = true;
  d.exec.stream = stream;
  d.exec.num_threads = o.threads;

  // Rows: the bare launches (CUDA), the validation alone, the whole calls; the launches and the
  // calls on the benchmark's own non-blocking stream and on the legacy default stream (what
  // torch's default current stream is).
  struct Row {
    std::string call, stream;
    double us;
  };
  std::vector<Row> rows;
  auto add = [&](const std::string& call, const char* where, const std::function<Status()>& fn,
                 const std::function<void()>& wait) {
    rows.push_back({call, where, time_calls(o, fn, wait)});
  };
  add(
      "kda::validate(PrefillParams)", "-", [&] { return validate(p); }, [] {});
  add(
      "kda::validate(DecodeParams)", "-", [&] { return validate(d); }, [] {});
  struct Where {
    const char* name;
    void* stream;
  };
  std::vector<Where> streams = {{cuda ? "own" : "-", stream}};
  if (cuda) streams.push_back({"legacy", nullptr});
  for (const Where& w : streams) {
    std::function<void()> wait = sync;
#ifdef KDA_BENCH_CUDA
    cudaStream_t here = static_cast<cudaStream_t>(w.stream);
    if (cuda) wait = [here] { cudaStreamSynchronize(here); };
    for (int l = 0; cuda && l < host_cost::kNumLaunches; ++l) {
      const auto how = static_cast<host_cost::Launch>(l);
      add(
          host_cost::launch_name(how), w.name,
          [how, here] {
            const cudaError_t e = host_cost::launch_empty(how, here);
            return e == cudaSuccess ? Status::Ok()
                                    : Status(StatusCode::kCudaError, cudaGetErrorString(e));
          },
          wait);
    }
#endif
    p.exec.stream = d.exec.stream = w.stream;
    add(
        "kda::prefill", w.name, [&] { return prefill(p); }, wait);
    add(
        "kda::decode", w.name, [&] { return decode(d); }, wait);
  }
#ifdef KDA_BENCH_CUDA
  if (cs != nullptr) cudaStreamDestroy(cs);
#endif

  std::string j = std::string("{\"device\": \"") + (cuda ? "cuda" : "cpu") +
                  "\", \"calls\": " + std::to_string(o.calls) +
                  ", \"repeats\": " + std::to_string(o.repeats) + ", \"results\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "%s{\"call\": \"%s\", \"stream\": \"%s\", \"us_per_call\": %.3f}", i ? ", " : "",
                  rows[i].call.c_str(), rows[i].stream.c_str(), rows[i].us);
    j += buf;
  }
  j += "]}";
  std::printf("%s\n", j.c_str());
  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr)
      return std::fprintf(stderr, "bench_host_cost: cannot write %s\n", o.json.c_str()), 1;
    std::fprintf(f, "%s\n", j.c_str());
    std::fclose(f);
  }
  std::printf(
      "host cost per call (%s, %s, %d calls, median of %d); prefill 1 x %lld, H = %lld, "
      "K = V = %lld (1-4 launches on CUDA); decode B = %lld, H = %lld, K = V = %lld\n",
      cuda ? "cuda" : "cpu", dtype_name(dt), o.calls, o.repeats, (long long)o.T, (long long)o.H,
      (long long)K, (long long)B, (long long)HD, (long long)K);
  std::printf("%-34s %-7s %10s\n", "call", "stream", "us/call");
  for (const Row& r : rows)
    std::printf("%-34s %-7s %10.2f\n", r.call.c_str(), r.stream.c_str(), r.us);
  return 0;
}
