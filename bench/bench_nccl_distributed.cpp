// bench_nccl_distributed — the context-parallel prefill over NCCL against the one-GPU prefill
// (issue 22's scale-out bars: 1 x 1,048,576 tokens, H = 32, within 1.2x of half the one-GPU time
// on 2 GPUs, 1.3x of a quarter on 4). Built with KDA_ENABLE_NCCL.
//
//   bench_nccl_distributed [--tokens T] [--heads H] [--world 2,4] [--iters N]
//
// Inputs: bf16, K = V = 128, lower-bound gate, beta logits, l2norm, an fp32 initial state; the
// tokens repeat a random block of 8192 (the timing does not depend on the values). Each rank
// holds an equal slice on its own GPU (one thread and one NCCL communicator per GPU). Reported:
// CUDA-event medians (the distributed time of an iteration is its slowest rank's, the ranks
// starting together), the ratio to 1/W of the one-GPU time against the bar, and the rel L2 of
// the final state and of the outputs around every rank boundary against the one-GPU results.
#include <nccl.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_cuda.h"
#include "kda/distributed.h"

using namespace kda;

namespace {

constexpr int64_t kBlock = 8192;  // tokens of random data, repeated
constexpr int64_t kDim = 128;
constexpr int64_t kWindow = 2048;  // output tokens compared on each side of a rank boundary

struct Problem {
  int64_t T = 1 << 20, H = 32;
  std::vector<uint16_t> q, k, v, g, beta;  // [kBlock, H, kDim] bf16 bits (beta [kBlock, H])
  std::vector<float> A_log, dt_bias, h0;
};

uint16_t bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<uint16_t> randn(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(n);
  for (auto& e : x) e = bf16(nd(rng));
  return x;
}

Problem make_problem(int64_t T, int64_t H) {
  Problem p;
  p.T = T;
  p.H = H;
  std::mt19937_64 rng(1);
  const size_t n = static_cast<size_t>(kBlock * H * kDim);
  p.q = randn(n, rng);
  p.k = randn(n, rng);
  p.v = randn(n, rng);
  p.g = randn(n, rng);
  p.beta = randn(static_cast<size_t>(kBlock * H), rng);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  p.A_log.resize(H);
  p.dt_bias.resize(H * kDim);
  p.h0.resize(H * kDim * kDim);
  for (auto& e : p.A_log) e = ud(rng);
  for (auto& e : p.dt_bias) e = ud(rng);
  std::normal_distribution<float> nd(0.f, 0.1f);
  for (auto& e : p.h0) e = nd(rng);
  return p;
}

// Device buffers of tokens [begin, begin + count) on the current device.
struct Slice {
  void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr, *out = nullptr;
  void *A_log = nullptr, *dt_bias = nullptr, *h0 = nullptr, *ht = nullptr, *ws = nullptr;
  PrefillParams p;
  ~Slice() {
    for (void* x : {q, k, v, g, beta, out, A_log, dt_bias, h0, ht, ws}) cudaFree(x);
  }
};

void* upload_tokens(const std::vector<uint16_t>& block, int64_t row, int64_t begin, int64_t count) {
  void* d = nullptr;
  BENCH_CUDA(cudaMalloc(&d, std::max<int64_t>(1, count * row) * 2));
  for (int64_t t = 0; t < count;) {
    const int64_t src = (begin + t) % kBlock, n = std::min(count - t, kBlock - src);
    BENCH_CUDA(cudaMemcpy(static_cast<uint16_t*>(d) + t * row, block.data() + src * row,
                          n * row * 2, cudaMemcpyHostToDevice));
    t += n;
  }
  return d;
}

template <class T>
void* upload(const std::vector<T>& x) {
  void* d = nullptr;
  BENCH_CUDA(cudaMalloc(&d, x.size() * sizeof(T)));
  BENCH_CUDA(cudaMemcpy(d, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

void make_slice(const Problem& pr, int device, int64_t begin, int64_t count, Slice* s) {
  BENCH_CUDA(cudaSetDevice(device));
  const int64_t H = pr.H, row = H * kDim;
  s->q = upload_tokens(pr.q, row, begin, count);
  s->k = upload_tokens(pr.k, row, begin, count);
  s->v = upload_tokens(pr.v, row, begin, count);
  s->g = upload_tokens(pr.g, row, begin, count);
  s->beta = upload_tokens(pr.beta, H, begin, count);
  BENCH_CUDA(cudaMalloc(&s->out, std::max<int64_t>(1, count * row) * 2));
  s->A_log = upload(pr.A_log);
  s->dt_bias = upload(pr.dt_bias);
  s->h0 = upload(pr.h0);
  BENCH_CUDA(cudaMalloc(&s->ht, pr.h0.size() * 4));
  const Device dev = Device::kCUDA;
  PrefillParams& p = s->p;
  p.q = make_view(s->q, DType::kBFloat16, {1, count, H, kDim}, dev, device);
  p.k = make_view(s->k, DType::kBFloat16, {1, count, H, kDim}, dev, device);
  p.v = make_view(s->v, DType::kBFloat16, {1, count, H, kDim}, dev, device);
  p.g = make_view(s->g, DType::kBFloat16, {1, count, H, kDim}, dev, device);
  p.beta = make_view(s->beta, DType::kBFloat16, {1, count, H}, dev, device);
  p.out = make_view(s->out, DType::kBFloat16, {1, count, H, kDim}, dev, device);
  p.A_log = make_view(s->A_log, DType::kFloat32, {H}, dev, device);
  p.dt_bias = make_view(s->dt_bias, DType::kFloat32, {H, kDim}, dev, device);
  p.initial_state = make_view(s->h0, DType::kFloat32, {1, H, kDim, kDim}, dev, device);
  p.final_state = make_view(s->ht, DType::kFloat32, {1, H, kDim, kDim}, dev, device);
  p.math.gate = GateForm::kLowerBound;
  p.math.beta_logits = true;
}

std::vector<uint16_t> download_bits(const void* d, int64_t offset, int64_t n) {
  std::vector<uint16_t> b(n);
  BENCH_CUDA(cudaMemcpy(b.data(), static_cast<const uint16_t*>(d) + offset, n * 2,
                        cudaMemcpyDeviceToHost));
  return b;
}

std::vector<float> widen(const uint16_t* b, int64_t n) {
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(b[i]) << 16;
    std::memcpy(&f[i], &u, 4);
  }
  return f;
}

// The outputs on each side of the boundaries of a slice [begin, end) of `bits` (the slice's
// own output from token `first`): tokens [begin, begin + w) and [end - w, end).
std::vector<float> windows(const uint16_t* bits, int64_t first, int64_t begin, int64_t end,
                           int64_t row) {
  const int64_t w = std::min(kWindow, end - begin);
  std::vector<float> x = widen(bits + (begin - first) * row, w * row);
  const std::vector<float> tail = widen(bits + (end - w - first) * row, w * row);
  x.insert(x.end(), tail.begin(), tail.end());
  return x;
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * double(got[i] - ref[i]);
    den += ref[i] * double(ref[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
    std::exit(2);
  }
}

// CUDA-event times of `iters` calls on `stream` after two warm-up calls; `start` (if given) lines
// the ranks up before each call.
template <class Call>
std::vector<double> time_calls(int iters, cudaStream_t stream, std::barrier<>* start, Call call) {
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  std::vector<double> ms;
  for (int i = 0; i < iters + 2; ++i) {
    if (start != nullptr) start->arrive_and_wait();
    BENCH_CUDA(cudaEventRecord(e0, stream));
    call();
    BENCH_CUDA(cudaEventRecord(e1, stream));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

// Device workspace of `bytes` for the slice's calls.
void give_workspace(Slice* s, size_t bytes) {
  BENCH_CUDA(cudaMalloc(&s->ws, std::max<size_t>(bytes, 1)));
  s->p.exec.workspace = s->ws;
  s->p.exec.workspace_bytes = bytes;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 1 << 20, H = 32;
  int iters = 5;
  std::vector<int> worlds = {2, 4};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--tokens") T = std::stoll(v);
    if (a == "--heads") H = std::stoll(v);
    if (a == "--iters") iters = std::stoi(v);
    if (a == "--world") {
      worlds.clear();
      for (size_t at = 0; at < v.size();) {
        const size_t comma = std::min(v.find(',', at), v.size());
        worlds.push_back(std::stoi(v.substr(at, comma - at)));
        at = comma + 1;
      }
    }
  }
  int devices = 0;
  BENCH_CUDA(cudaGetDeviceCount(&devices));
  const Problem pr = make_problem(T, H);

  // One GPU: the whole input on device 0.
  std::vector<double> one_ms;
  std::vector<float> one_ht;
  std::vector<uint16_t> one_out;  // the whole output, bf16 bits
  {
    Slice s;
    make_slice(pr, 0, 0, T, &s);
    size_t bytes = 0;
    check(prefill_workspace_size(s.p, &bytes), "prefill_workspace_size");
    give_workspace(&s, bytes);
    one_ms = time_calls(iters, nullptr, nullptr, [&] { check(prefill(s.p), "prefill"); });
    one_out = download_bits(s.out, 0, T * H * kDim);
    one_ht.resize(pr.h0.size());
    BENCH_CUDA(cudaMemcpy(one_ht.data(), s.ht, one_ht.size() * 4, cudaMemcpyDeviceToHost));
  }
  std::printf("1 x %lld tokens, H = %lld, K = V = 128, bf16: one GPU %.3f ms\n",
              static_cast<long long>(T), static_cast<long long>(H), median(one_ms));
  std::printf("| GPUs | ms | ratio to 1/W of one GPU | bar | final state rel L2 | out rel L2 |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");

  for (int world : worlds) {
    if (world > devices) {
      std::printf("| %d | (only %d GPUs) | | | | |\n", world, devices);
      continue;
    }
    std::vector<ncclComm_t> comms(world);
    std::vector<int> list(world);
    for (int r = 0; r < world; ++r) list[r] = r;
    if (ncclCommInitAll(comms.data(), world, list.data()) != ncclSuccess) {
      std::fprintf(stderr, "ncclCommInitAll failed\n");
      return 2;
    }
    std::vector<std::vector<double>> ms(world);
    std::vector<std::vector<float>> hts(world), outs(world);
    std::barrier sync(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        const int64_t begin = T * r / world, end = T * (r + 1) / world;
        Slice s;
        make_slice(pr, r, begin, end - begin, &s);
        cudaStream_t stream;
        BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        s.p.exec.stream = stream;
        std::unique_ptr<Communicator> comm;
        check(make_nccl_communicator(comms[r], &comm), "make_nccl_communicator");
        size_t bytes = 0;
        check(distributed_prefill_workspace_size(s.p, world, &bytes), "workspace size");
        give_workspace(&s, bytes);
        ms[r] = time_calls(iters, stream, &sync,
                           [&] { check(distributed_prefill(s.p, *comm), "distributed_prefill"); });
        hts[r].resize(pr.h0.size());
        BENCH_CUDA(cudaMemcpy(hts[r].data(), s.ht, hts[r].size() * 4, cudaMemcpyDeviceToHost));
        const std::vector<uint16_t> bits = download_bits(s.out, 0, (end - begin) * H * kDim);
        outs[r] = windows(bits.data(), begin, begin, end, H * kDim);
        cudaStreamDestroy(stream);
      });
    for (std::thread& t : threads) t.join();
    for (ncclComm_t c : comms) ncclCommDestroy(c);
    std::vector<double> slowest(ms[0].size(), 0);
    for (int r = 0; r < world; ++r)
      for (size_t i = 0; i < ms[r].size(); ++i) slowest[i] = std::max(slowest[i], ms[r][i]);
    double ht_err = 0, out_err = 0;
    for (int r = 0; r < world; ++r) {
      ht_err = std::max(ht_err, rel_l2(hts[r], one_ht));
      const int64_t begin = T * r / world, end = T * (r + 1) / world;
      const std::vector<float> ref = windows(one_out.data(), 0, begin, end, H * kDim);
      out_err = std::max(out_err, rel_l2(outs[r], ref));
    }
    const double t = median(slowest), ratio = t / (median(one_ms) / world);
    std::printf("| %d | %.3f | %.3f | %.1f | %.2e | %.2e |\n", world, t, ratio,
                world == 2 ? 1.2 : 1.3, ht_err, out_err);
  }
  return 0;
}
