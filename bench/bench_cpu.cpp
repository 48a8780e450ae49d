// bench_cpu.cpp — CPU benchmark: fast backend vs the fp64 reference, prefill and decode.
//
// Protocol: correctness first (rel L2 vs the reference on the same inputs), then the median of
// several timed runs of the fast backend; the reference is timed once (it is slow and steady).
// Usage: bench_cpu [--quick] [--threads N] [--csv path]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "support.h"

using namespace kda;
using namespace kda::test;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename Fn>
double median_time(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    fn();
    t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Row {
  std::string op, shape;
  int64_t tokens;
  double t_fast, t_ref, err;
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int threads = 0;
  std::string csv;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--threads" && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (a == "--csv" && i + 1 < argc)
      csv = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_cpu [--quick] [--threads N] [--csv path]\n");
      return 2;
    }
  }
  std::vector<Row> rows;

  // Prefill: bf16 inputs, lower-bound gate, beta logits, fp32 initial + final state (targets.md).
  struct PShape {
    std::vector<int64_t> lens;
    bool varlen;
    int64_t H;
  };
  std::vector<PShape> pshapes = {{{4096}, false, 8},
                                 {{1300, 547, 2048, 963}, true, 16},
                                 {{2048, 2048, 2048, 2048}, false, 32}};
  if (quick) pshapes = {{{1024}, false, 4}};
  for (const auto& ps : pshapes) {
    PrefillCase c;
    c.seqlens = ps.lens;
    c.varlen = ps.varlen;
    c.H = c.HV = ps.H;
    c.K = c.V = 128;
    c.dtype = DType::kBFloat16;
    c.gate = GateForm::kLowerBound;
    PrefillData d = make_prefill(c);
    PrefillData ref = widen(d);
    PrefillParams p = d.params(), pr = ref.params();
    p.exec.backend = Backend::kCpu;
    p.exec.num_threads = threads;
    pr.exec.backend = Backend::kCpuReference;
    const double t_ref = median_time(1, [&] { prefill(pr); });
    if (!prefill(p).ok()) return 1;
    const double err = compare(d.out, ref.out, 1).rel_l2;
    const double t_fast = median_time(quick ? 3 : 5, [&] { prefill(p); });
    std::string shape = (ps.varlen ? "varlen " : "") + std::to_string(ps.lens.size()) + "x" +
                        (ps.varlen ? std::string("mixed") : std::to_string(ps.lens[0])) +
                        " H=" + std::to_string(ps.H);
    rows.push_back({"prefill", shape, d.T * d.B, t_fast, t_ref, err});
    std::fprintf(stderr, "prefill %s done\n", shape.c_str());
  }

  // Decode: one token per sequence, fp32 V-first pool through state_indices, H = 32, K = V = 128.
  for (int64_t B : quick ? std::vector<int64_t>{8} : std::vector<int64_t>{1, 32, 128}) {
    for (int64_t T : {1, 4}) {
      DecodeCase c;
      c.N = B;
      c.T = T;
      c.H = c.HV = 32;
      c.K = 128;
      c.gate = GateForm::kLowerBound;
      c.indices = T == 1 ? 1 : 2;
      c.num_accepted = T > 1;
      c.out_dtype = DType::kFloat32;
      DecodeData d = make_decode(c), ref = make_decode(c);
      DecodeParams p = d.params(), pr = ref.params();
      p.exec.backend = Backend::kCpu;
      p.exec.num_threads = threads;
      pr.exec.backend = Backend::kCpuReference;
      p.store_final_state = pr.store_final_state = false;  // repeatable: the pool stays as it is
      const double t_ref = median_time(1, [&] { decode(pr); });
      if (!decode(p).ok()) return 1;
      const double err = compare(d.out, ref.out, 1).rel_l2;
      const double t_fast = median_time(quick ? 3 : 7, [&] { decode(p); });
      rows.push_back({"decode", "B=" + std::to_string(B) + " T=" + std::to_string(T) + " H=32",
                      B * T, t_fast, t_ref, err});
    }
  }

  std::printf("\n%-8s %-28s %10s %12s %12s %9s %10s\n", "op", "shape", "fast ms", "tokens/s",
              "ref ms", "speed-up", "rel err");
  for (const auto& r : rows)
    std::printf("%-8s %-28s %10.2f %12.0f %12.1f %8.1fx %10.2e\n", r.op.c_str(), r.shape.c_str(),
                1e3 * r.t_fast, r.tokens / r.t_fast, 1e3 * r.t_ref, r.t_ref / r.t_fast, r.err);
  if (!csv.empty()) {
    FILE* f = std::fopen(csv.c_str(), "w");
    if (f) {
      std::fprintf(f, "op,shape,fast_ms,tokens_per_s,ref_ms,speedup,rel_err\n");
      for (const auto& r : rows)
        std::fprintf(f, "%s,%s,%.4f,%.1f,%.3f,%.2f,%.3e\n", r.op.c_str(), r.shape.c_str(),
                     1e3 * r.t_fast, r.tokens / r.t_fast, 1e3 * r.t_ref, r.t_ref / r.t_fast, r.err);
      std::fclose(f);
    }
  }
  return 0;
}
