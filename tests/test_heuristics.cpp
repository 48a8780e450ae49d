// test_heuristics.cpp — the CUDA launch heuristics (src/cuda/heuristics/) and the tuning struct
// (src/core/tuning.h): pure host functions, tested in the CPU build (no GPU, no CUDA headers).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/problem.h"
#include "core/tuning.h"
#include "cuda/heuristics/decode.h"
#include "cuda/heuristics/prefill.h"

namespace kda::test {
namespace {

// The tuning struct for an environment given as a map (unset names: absent).
detail::Tuning tuning(const std::map<std::string, const char*>& env) {
  return detail::parse_tuning([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second;
  });
}

// ---------------------------------------------------------------------------------------------
// The tuning struct
// ---------------------------------------------------------------------------------------------

TEST(Tuning, Defaults) {
  const detail::Tuning t = tuning({});
  EXPECT_TRUE(t.pdl);
  EXPECT_TRUE(t.driver_launch);
  EXPECT_EQ(t.decode_kernel, detail::DecodeKernelOverride::kAuto);
  EXPECT_EQ(t.decode_warp_rows, 0);
  EXPECT_EQ(t.decode_warp_cache, detail::DecodeStateCache::kAuto);
  EXPECT_EQ(t.prefill_vs, 0);
  EXPECT_TRUE(t.prefill_ksplit);
  EXPECT_TRUE(t.prefill_wgmma);
  EXPECT_EQ(t.prefill_chunk, 0);
  EXPECT_EQ(t.prefill_prefetch, 0);
  EXPECT_EQ(t.prefill_segment, 0);
  EXPECT_EQ(t.num_threads, 0);
  EXPECT_TRUE(t.backward_split);
  EXPECT_TRUE(t.backward_wgmma);
  EXPECT_TRUE(t.backward_wg_passes);
}

TEST(Tuning, ParsesEveryKnob) {
  const detail::Tuning t = tuning({{"KDA_CUDA_PDL", "0"},
                                   {"KDA_CUDA_DRIVER_LAUNCH", "0"},
                                   {"KDA_CUDA_DECODE_KERNEL", "bulklat"},
                                   {"KDA_CUDA_DECODE_WARP_ROWS", "16"},
                                   {"KDA_CUDA_DECODE_WARP_CACHE", "stream"},
                                   {"KDA_CUDA_PREFILL_VS", "64"},
                                   {"KDA_CUDA_PREFILL_KSPLIT", "0"},
                                   {"KDA_CUDA_PREFILL_WGMMA", "0"},
                                   {"KDA_CUDA_PREFILL_CHUNK", "16"},
                                   {"KDA_CUDA_PREFILL_PREFETCH", "auto"},
                                   {"KDA_CUDA_PREFILL_SEGMENT", "192"},
                                   {"KDA_CUDA_BACKWARD_SPLIT", "0"},
                                   {"KDA_CUDA_BACKWARD_WGMMA", "0"},
                                   {"KDA_CUDA_BACKWARD_WG_PASSES", "0"},
                                   {"KDA_NUM_THREADS", "3"}});
  EXPECT_FALSE(t.backward_split);
  EXPECT_FALSE(t.backward_wgmma);
  EXPECT_FALSE(t.backward_wg_passes);
  EXPECT_FALSE(t.pdl);
  EXPECT_FALSE(t.driver_launch);
  EXPECT_EQ(t.decode_kernel, detail::DecodeKernelOverride::kBulkLatency);
  EXPECT_EQ(t.decode_warp_rows, 16);
  EXPECT_EQ(t.decode_warp_cache, detail::DecodeStateCache::kStream);
  EXPECT_EQ(t.prefill_vs, 64);
  EXPECT_FALSE(t.prefill_ksplit);
  EXPECT_FALSE(t.prefill_wgmma);
  EXPECT_EQ(t.prefill_chunk, 16);
  EXPECT_EQ(t.prefill_prefetch, -1);
  EXPECT_EQ(t.prefill_segment, 192);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_SEGMENT", "off"}}).prefill_segment, -1);
  EXPECT_EQ(t.num_threads, 3);
  using O = detail::DecodeKernelOverride;
  const std::vector<std::pair<const char*, O>> kernels = {
      {"baseline", O::kBaseline},   {"tile", O::kTile}, {"staged", O::kStaged}, {"bulk", O::kBulk},
      {"bulklat", O::kBulkLatency}, {"warp", O::kWarp}, {"single", O::kSingle}};
  for (const auto& [name, want] : kernels)
    EXPECT_EQ(tuning({{"KDA_CUDA_DECODE_KERNEL", name}}).decode_kernel, want) << name;
  for (int rows : {4, 8, 16})
    EXPECT_EQ(
        tuning({{"KDA_CUDA_DECODE_WARP_ROWS", std::to_string(rows).c_str()}}).decode_warp_rows,
        rows);
  EXPECT_EQ(tuning({{"KDA_CUDA_DECODE_WARP_CACHE", "normal"}}).decode_warp_cache,
            detail::DecodeStateCache::kNormal);
}

TEST(Tuning, InvalidValuesAreIgnored) {
  EXPECT_TRUE(tuning({{"KDA_CUDA_PDL", "1"}}).pdl);  // only "0" turns PDL off
  EXPECT_TRUE(tuning({{"KDA_CUDA_PDL", "off"}}).pdl);
  for (const char* bad : {"", "Staged", "fast", "bulk "})
    EXPECT_EQ(tuning({{"KDA_CUDA_DECODE_KERNEL", bad}}).decode_kernel,
              detail::DecodeKernelOverride::kAuto)
        << bad;
  for (const char* bad : {"", "32x", "0", "17"})
    EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_CHUNK", bad}}).prefill_chunk, 0) << bad;
  for (const char* bad : {"", "0", "2", "04", "32", "16 ", "eight"})
    EXPECT_EQ(tuning({{"KDA_CUDA_DECODE_WARP_ROWS", bad}}).decode_warp_rows, 0) << bad;
  for (const char* bad : {"", "Stream", "last", "1"})
    EXPECT_EQ(tuning({{"KDA_CUDA_DECODE_WARP_CACHE", bad}}).decode_warp_cache,
              detail::DecodeStateCache::kAuto)
        << bad;
  for (const char* bad : {"", "0", "-2", "many"})
    EXPECT_EQ(tuning({{"KDA_NUM_THREADS", bad}}).num_threads, 0) << bad;
  for (const char* bad : {"", "0", "32", "100", "-64", "64x", "Off"})
    EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_SEGMENT", bad}}).prefill_segment, 0) << bad;
}

TEST(Tuning, ScopedOverrideNestsAndRestores) {
  const detail::Tuning before = detail::tuning();
  {
    detail::Tuning t = before;
    t.prefill_vs = 64;
    const detail::ScopedTuning outer(t);
    EXPECT_EQ(detail::tuning().prefill_vs, 64);
    {
      t.prefill_vs = 128;
      t.prefill_wgmma = false;
      const detail::ScopedTuning inner(t);
      EXPECT_EQ(detail::tuning().prefill_vs, 128);
      EXPECT_FALSE(detail::tuning().prefill_wgmma);
    }
    EXPECT_EQ(detail::tuning().prefill_vs, 64);
    EXPECT_EQ(detail::tuning().prefill_wgmma, before.prefill_wgmma);
  }
  EXPECT_EQ(detail::tuning().prefill_vs, before.prefill_vs);
}

// ---------------------------------------------------------------------------------------------
// Prefill launch heuristics
// ---------------------------------------------------------------------------------------------

// The plan on the reference cases (targets.md; 132 SMs): the configurations the H200 sweep
// measured fastest (bench_gpu_prefill --sweep; docs/design.md section 6.5).
TEST(PrefillHeuristics, PlanOnReferenceCases) {
  using cuda::pf::prefill_plan;
  struct Want {
    const char* name;
    bool varlen;
    int64_t T, N, HV, tokens;
    int vs;
    bool chunk16;
  };
  const Want want[] = {
      {"P1", false, 8192, 1, 96, 0, 128, true},      {"P2", false, 8192, 1, 64, 0, 64, false},
      {"P3", true, 10192, 6, 96, 0, 128, true},      {"P4", true, 8192, 8, 96, 0, 128, true},
      {"P5", false, 32768, 1, 32, 8192, 128, false}, {"P6", false, 4096, 16, 32, 0, 128, true},
      {"P7", false, 2048, 1, 32, 0, 64, false},      {"S1", false, 1024, 1, 4, 0, 64, false},
      {"S2", false, 2048, 1, 12, 512, 64, false},    {"S3", false, 4096, 1, 8, 512, 128, false},
      {"S4", false, 8192, 1, 12, 2048, 64, false},   {"S5", false, 16384, 1, 4, 1024, 128, false},
      {"S6", false, 8192, 2, 8, 1024, 128, false},   {"S7", false, 4096, 4, 16, 0, 64, false},
      {"S8", false, 2048, 8, 24, 0, 128, true},      {"S9", false, 16384, 1, 16, 2048, 128, false},
      {"S10", false, 1024, 8, 12, 0, 128, true},     {"S11", false, 65536, 1, 4, 2048, 128, false},
  };
  for (const Want& w : want) {
    const cuda::pf::PrefillPlan p = prefill_plan(w.varlen, w.T, w.N, w.HV, 132, tuning({}));
    EXPECT_EQ(p.segment_tokens, w.tokens) << w.name;
    EXPECT_EQ(p.rec.vs, w.vs) << w.name;
    EXPECT_EQ(p.rec.chunk16, w.chunk16) << w.name;
    EXPECT_GT(p.predicted_us, 0) << w.name;
  }
}

TEST(PrefillHeuristics, KSplit) {
  using cuda::pf::recurrence_k_split;
  EXPECT_TRUE(recurrence_k_split(32, tuning({})));  // default for vs <= 32
  EXPECT_TRUE(recurrence_k_split(16, tuning({})));
  EXPECT_TRUE(recurrence_k_split(32, tuning({{"KDA_CUDA_PREFILL_KSPLIT", "1"}})));
  EXPECT_TRUE(recurrence_k_split(
      32, tuning({{"KDA_CUDA_PREFILL_KSPLIT", "10"}})));  // only "0" turns it off
  EXPECT_FALSE(recurrence_k_split(64, tuning({})));       // would not fit one block per SM
  EXPECT_FALSE(recurrence_k_split(128, tuning({})));
  EXPECT_FALSE(recurrence_k_split(32, tuning({{"KDA_CUDA_PREFILL_KSPLIT", "0"}})));
  EXPECT_FALSE(recurrence_k_split(16, tuning({{"KDA_CUDA_PREFILL_KSPLIT", "0"}})));
}

TEST(PrefillHeuristics, Chunk16) {
  using cuda::pf::prefill_chunk16;
  EXPECT_TRUE(prefill_chunk16(true, 128, tuning({})));  // the default at vs = 128 (P1, P3, P4, P6)
  EXPECT_FALSE(prefill_chunk16(true, 64, tuning({})));  // chunk 64 at vs = 64 (P2)
  EXPECT_TRUE(prefill_chunk16(true, 64, tuning({{"KDA_CUDA_PREFILL_CHUNK", "16"}})));  // forced on
  EXPECT_FALSE(
      prefill_chunk16(true, 128, tuning({{"KDA_CUDA_PREFILL_CHUNK", "64"}})));  // forced off
  EXPECT_FALSE(prefill_chunk16(
      false, 32, tuning({{"KDA_CUDA_PREFILL_CHUNK", "16"}})));  // wgmma recurrences only
  EXPECT_FALSE(prefill_chunk16(false, 128, tuning({})));
  EXPECT_TRUE(prefill_chunk16(
      true, 128, tuning({{"KDA_CUDA_PREFILL_CHUNK", "016x"}})));  // not a setting: the default
  EXPECT_FALSE(prefill_chunk16(true, 64, tuning({{"KDA_CUDA_PREFILL_CHUNK", ""}})));
}

TEST(PrefillHeuristics, WgmmaAndForcedSplit) {
  using cuda::pf::recurrence_wgmma;
  EXPECT_TRUE(recurrence_wgmma(128, tuning({})));  // the default for vs >= 64
  EXPECT_TRUE(recurrence_wgmma(64, tuning({})));
  EXPECT_TRUE(recurrence_wgmma(64, tuning({{"KDA_CUDA_PREFILL_WGMMA", "1"}})));
  EXPECT_FALSE(recurrence_wgmma(32, tuning({})));  // a warpgroup needs 64 value rows
  EXPECT_FALSE(recurrence_wgmma(16, tuning({})));
  EXPECT_FALSE(recurrence_wgmma(128, tuning({{"KDA_CUDA_PREFILL_WGMMA", "0"}})));
  EXPECT_EQ(tuning({}).prefill_vs, 0);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_VS", "16"}}).prefill_vs, 16);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_VS", "32"}}).prefill_vs, 32);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_VS", "64"}}).prefill_vs, 64);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_VS", "128"}}).prefill_vs, 128);
  for (const char* bad : {"", "0", "8", "48", "1280", "12", "64x", "auto"})
    EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_VS", bad}}).prefill_vs, 0) << bad;
}

TEST(PrefillHeuristics, PrefetchDistance) {
  using cuda::pf::prepare_prefetch_blocks;
  EXPECT_EQ(prepare_prefetch_blocks(132, tuning({})), 0);  // off by default (measured slower)
  EXPECT_EQ(prepare_prefetch_blocks(132, tuning({{"KDA_CUDA_PREFILL_PREFETCH", "0"}})), 0);
  EXPECT_EQ(prepare_prefetch_blocks(132, tuning({{"KDA_CUDA_PREFILL_PREFETCH", "1"}})),
            1);  // a distance
  EXPECT_EQ(prepare_prefetch_blocks(132, tuning({{"KDA_CUDA_PREFILL_PREFETCH", "264"}})), 264);
  EXPECT_EQ(prepare_prefetch_blocks(8, tuning({{"KDA_CUDA_PREFILL_PREFETCH", "auto"}})),
            16);  // two blocks per SM ahead
  for (const char* off : {"", "off", "false", "-1", "12x", "autox"})
    EXPECT_EQ(prepare_prefetch_blocks(132, tuning({{"KDA_CUDA_PREFILL_PREFETCH", off}})), 0) << off;
}

TEST(PrefillHeuristics, ChunkSlots) {
  using cuda::pf::prefill_chunk_slots;
  EXPECT_EQ(prefill_chunk_slots(false, 2, 130, 2), 6);
  EXPECT_EQ(prefill_chunk_slots(false, 1, 0, 1), 0);
  EXPECT_EQ(prefill_chunk_slots(true, 1, 1300 + 547 + 2048 + 963 + 271 + 3063, 6), 8192 / 64 + 6);
  EXPECT_EQ(prefill_chunk_slots(true, 1, 0, 0), 0);
  // Every sequence's chunks fit below the bound for any split of T tokens.
  const std::vector<int64_t> lens = {1, 63, 64, 65, 0, 127, 129, 5};
  int64_t T = 0;
  for (int64_t l : lens) T += l;
  const int64_t slots = prefill_chunk_slots(true, 1, T, static_cast<int64_t>(lens.size()));
  int64_t bos = 0, prev_end = 0;
  for (size_t n = 0; n < lens.size(); ++n) {
    const int64_t base = bos / 64 + static_cast<int64_t>(n), chunks = (lens[n] + 63) / 64;
    EXPECT_GE(base, prev_end);
    EXPECT_LE(base + chunks, slots);
    prev_end = base + chunks;
    bos += lens[n];
  }
}

// Forced dimensions, and what the plan never takes.
TEST(PrefillHeuristics, PlanUnderTuning) {
  using cuda::pf::prefill_plan;
  const detail::Tuning t = tuning({});
  // Nothing to split: one chunk, or no tokens.
  EXPECT_EQ(prefill_plan(false, 64, 1, 4, 132, t).segment_tokens, 0);
  EXPECT_EQ(prefill_plan(false, 0, 1, 4, 132, t).segment_tokens, 0);
  // A forced segment size, value split or record length fixes that dimension only.
  const auto forced =
      prefill_plan(false, 8192, 1, 96, 132, tuning({{"KDA_CUDA_PREFILL_SEGMENT", "256"}}));
  EXPECT_EQ(forced.segment_tokens, 256);
  EXPECT_FALSE(forced.rec.chunk16);  // segmented: 64-token records unless 16 are forced
  EXPECT_EQ(prefill_plan(false, 65536, 1, 4, 132, tuning({{"KDA_CUDA_PREFILL_SEGMENT", "off"}}))
                .segment_tokens,
            0);
  const auto vs32 = prefill_plan(false, 65536, 1, 4, 132, tuning({{"KDA_CUDA_PREFILL_VS", "32"}}));
  EXPECT_EQ(vs32.rec.vs, 32);
  EXPECT_TRUE(vs32.rec.ksplit);
  EXPECT_GT(vs32.segment_tokens, 0);
  const auto c16 =
      prefill_plan(false, 65536, 1, 4, 132,
                   tuning({{"KDA_CUDA_PREFILL_CHUNK", "16"}, {"KDA_CUDA_PREFILL_VS", "128"}}));
  EXPECT_TRUE(c16.rec.chunk16);
  EXPECT_FALSE(prefill_plan(false, 8192, 1, 96, 132, tuning({{"KDA_CUDA_PREFILL_CHUNK", "64"}}))
                   .rec.chunk16);
  EXPECT_FALSE(
      prefill_plan(false, 8192, 1, 96, 132, tuning({{"KDA_CUDA_PREFILL_WGMMA", "0"}})).rec.wgmma);
  // The plan is the least predicted time: no allowed configuration predicts less.
  const auto best = prefill_plan(false, 16384, 1, 4, 132, t);
  for (const char* seg : {"off", "128", "512", "4096"})
    for (const char* vs : {"16", "64", "128"})
      EXPECT_GE(
          prefill_plan(false, 16384, 1, 4, 132,
                       tuning({{"KDA_CUDA_PREFILL_SEGMENT", seg}, {"KDA_CUDA_PREFILL_VS", vs}}))
              .predicted_us,
          best.predicted_us)
          << seg << " " << vs;
}

// A call that may be of weak decay (the lower-bound gate with a bound above
// kChunk16MinDecayBound, any softplus or precomputed gate) keeps 64-token records on the cases
// whose default is the 16-token path, unless 16 are forced.
TEST(PrefillHeuristics, WeakDecayAvoidsChunk16) {
  using cuda::pf::kChunk16MinDecayBound;
  using cuda::pf::prefill_plan;
  using cuda::pf::weak_decay_gate;
  EXPECT_TRUE(weak_decay_gate(true, -0.05));
  EXPECT_TRUE(weak_decay_gate(true, kChunk16MinDecayBound + 0.01));
  EXPECT_FALSE(weak_decay_gate(true, kChunk16MinDecayBound));
  EXPECT_FALSE(weak_decay_gate(true, -5.0));
  EXPECT_TRUE(weak_decay_gate(false, -5.0));  // softplus / precomputed: decay from the data
  const detail::Tuning t = tuning({});
  struct Shape {
    bool varlen;
    int64_t T, N, HV;
  };
  for (const Shape& c : {Shape{false, 8192, 1, 96}, Shape{true, 8192, 8, 96},
                         Shape{false, 4096, 16, 32}, Shape{false, 1024, 8, 12}}) {
    ASSERT_TRUE(prefill_plan(c.varlen, c.T, c.N, c.HV, 132, t).rec.chunk16) << c.T;
    const auto weak = prefill_plan(c.varlen, c.T, c.N, c.HV, 132, t, true);
    EXPECT_FALSE(weak.rec.chunk16) << c.T;
    EXPECT_GT(weak.predicted_us, 0) << c.T;
    EXPECT_TRUE(prefill_plan(c.varlen, c.T, c.N, c.HV, 132,
                             tuning({{"KDA_CUDA_PREFILL_CHUNK", "16"}}), true)
                    .rec.chunk16)
        << c.T;
  }
}

// Warm-up segments (fused_choice with warm_applies; docs/design.md 6.10): taken where their model
// predicts less than the exact plans, the warm-up estimate fits Tuning::prefill_warm_chunks and
// the decay is not weak; forced by prefill_warm = 1 wherever they apply; never with one segment
// per sequence forced, nor when turned off.
TEST(PrefillHeuristics, Warm) {
  using cuda::pf::fused_choice;
  using cuda::pf::predicted_warm_us;
  using cuda::pf::warm_chunks_estimate;
  EXPECT_EQ(detail::Tuning{}.prefill_warm, 0);
  EXPECT_EQ(detail::Tuning{}.prefill_warm_chunks, 48);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM", "1"}}).prefill_warm, 1);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM", "0"}}).prefill_warm, -1);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM", "on"}}).prefill_warm, 0);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM_CHUNKS", "16"}}).prefill_warm_chunks, 16);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM_CHUNKS", "0"}}).prefill_warm_chunks, 48);
  EXPECT_EQ(detail::Tuning{}.prefill_warm_bits, 12);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM_BITS", "12"}}).prefill_warm_bits, 12);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM_BITS", "16"}}).prefill_warm_bits, 16);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM_BITS", "9"}}).prefill_warm_bits, 12);   // below 10
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM_BITS", "33"}}).prefill_warm_bits, 12);  // above 32
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_WARM_BITS", "-16"}}).prefill_warm_bits, 12);
  EXPECT_EQ(warm_chunks_estimate(-5.0), 16);
  EXPECT_EQ(warm_chunks_estimate(-2.5), 32);
  EXPECT_EQ(warm_chunks_estimate(-5.0, 12), 16);  // calibrated at the default bits
  EXPECT_EQ(warm_chunks_estimate(-5.0, 9), 12);
  EXPECT_EQ(warm_chunks_estimate(-2.5, 18), 48);
  EXPECT_GT(warm_chunks_estimate(-1.0), 48);
  // S1 (1 x 1024, HV = 4) in segments of 64 tokens: 64 CTAs, one wave of 4 + 16 chunks.
  EXPECT_NEAR(predicted_warm_us(1024, 1, 4, 64, 132, 16),
              20 * cuda::pf::kFusedStepUs + cuda::pf::kFusedPassUs + cuda::pf::kWarmExtraUs, 1e-9);
  const detail::Tuning def{};
  detail::Tuning forced{}, off{}, none{}, seg{};
  forced.prefill_warm = 1;
  off.prefill_warm = -1;
  none.prefill_segment = -1;
  seg.prefill_warm = 1;
  seg.prefill_segment = 128;
  struct Shape {
    int64_t T, N, HV;
    bool warm;  // taken by default at lower bound -5
  };
  // S2 (1 x 2048, HV = 12), S11 (1 x 65536, HV = 4), P2 (1 x 8192, HV = 64) and P5
  // (1 x 32768, HV = 32) take it; P4 (8 x 1024, HV = 96) and P6 (16 x 4096, HV = 32) fill the
  // SMs without segments; S8 (8 x 2048, HV = 24) would need three waves.
  for (const Shape& c :
       {Shape{2048, 8, 24, false}, Shape{2048, 1, 12, true}, Shape{65536, 1, 4, true},
        Shape{8192, 1, 64, true}, Shape{32768, 1, 32, true}, Shape{1024, 8, 96, false},
        Shape{4096, 16, 32, false}}) {
    SCOPED_TRACE(c.T);
    const auto plan = cuda::pf::prefill_plan(false, c.T, c.N, c.HV, 132, def);
    auto choose = [&](const detail::Tuning& t, bool applies, bool weak, double lb) {
      return fused_choice(plan, c.T, c.N, c.HV, 132, t, true, weak, applies, lb);
    };
    const auto d = choose(def, true, false, -5.0);
    EXPECT_EQ(d.warm, c.warm);
    if (d.warm) {
      EXPECT_TRUE(d.take);
      EXPECT_GT(d.segment_tokens, 0);
      EXPECT_LT(d.predicted_us, plan.predicted_us);
    }
    EXPECT_FALSE(choose(def, false, false, -5.0).warm);  // no l2norm or no beta logits
    EXPECT_FALSE(choose(def, true, true, -5.0).warm);    // weak decay
    EXPECT_FALSE(choose(def, true, false, -1.0).warm);   // the estimate exceeds the budget
    EXPECT_FALSE(choose(off, true, false, -5.0).warm);
    EXPECT_FALSE(choose(none, true, false, -5.0).warm);
    const auto f = choose(forced, true, false, -1.0);
    EXPECT_TRUE(f.take && f.warm);
    const auto s = choose(seg, true, false, -5.0);
    EXPECT_TRUE(s.take && s.warm);
    EXPECT_EQ(s.segment_tokens, 128);
  }
}

// The fused kernel: its knob, where it applies, its model and the choice against the two-kernel
// plan (forced: always, with the best or the forced segment size; by default: never under weak
// decay or with a forced value split or record length, else where its model predicts less).
TEST(PrefillHeuristics, Fused) {
  using cuda::pf::fused_choice;
  using cuda::pf::kFusedPassUs;
  using cuda::pf::kFusedStepUs;
  using cuda::pf::predicted_fused_us;
  EXPECT_EQ(detail::Tuning{}.prefill_fused, 0);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_FUSED", "1"}}).prefill_fused, 1);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_FUSED", "0"}}).prefill_fused, -1);
  EXPECT_EQ(tuning({{"KDA_CUDA_PREFILL_FUSED", "yes"}}).prefill_fused, 0);
  EXPECT_TRUE(cuda::pf::fused_applies(true, -5.0));
  EXPECT_FALSE(cuda::pf::fused_applies(false, -5.0));  // softplus / precomputed: unbounded decay
  EXPECT_FALSE(cuda::pf::fused_applies(true, -5.01));  // beyond the start-anchored factors' range
  // P4: 8 x 1024 tokens, 96 heads: 768 CTAs in 6 waves of 64 chunks.
  EXPECT_NEAR(predicted_fused_us(1024, 8, 96, 0, 132), 6 * 64 * kFusedStepUs + kFusedPassUs, 1e-9);
  // S1 in 4 segments of 256 tokens: pass 1 (first segment + 2 x 2 inner) and pass 2 (3), one wave
  // each of 16 chunks; 2 scan steps of one wave.
  EXPECT_NEAR(predicted_fused_us(1024, 1, 4, 256, 132),
              cuda::pf::kModelSegmentLaunchUs + 2 * (16 * kFusedStepUs + kFusedPassUs) +
                  2 * cuda::pf::kModelScanStepUs,
              1e-9);
  const detail::Tuning def{};
  detail::Tuning forced{}, off{}, vs{}, seg{};
  forced.prefill_fused = 1;
  off.prefill_fused = -1;
  vs.prefill_vs = 64;
  seg.prefill_fused = 1;
  seg.prefill_segment = 512;
  struct Shape {
    bool varlen;
    int64_t T, N, HV;
  };
  for (const Shape& c :
       {Shape{false, 8192, 1, 96}, Shape{true, 8192, 8, 96}, Shape{false, 4096, 16, 32},
        Shape{false, 1024, 1, 4}, Shape{false, 2048, 8, 24}}) {
    const cuda::pf::PrefillPlan plan = cuda::pf::prefill_plan(c.varlen, c.T, c.N, c.HV, 132, def);
    const int64_t len = c.varlen ? c.T / c.N : c.T;
    const auto d = fused_choice(plan, len, c.N, c.HV, 132, def, true, false);
    EXPECT_EQ(d.take, d.predicted_us < plan.predicted_us) << c.T;
    EXPECT_LE(d.predicted_us, predicted_fused_us(len, c.N, c.HV, 0, 132)) << c.T;
    EXPECT_FALSE(fused_choice(plan, len, c.N, c.HV, 132, def, true, true).take) << c.T;  // weak
    EXPECT_FALSE(fused_choice(plan, len, c.N, c.HV, 132, vs, true, false).take) << c.T;
    EXPECT_TRUE(fused_choice(plan, len, c.N, c.HV, 132, forced, true, true).take) << c.T;
    EXPECT_FALSE(fused_choice(plan, len, c.N, c.HV, 132, forced, false, false).take) << c.T;
    EXPECT_FALSE(fused_choice(plan, len, c.N, c.HV, 132, off, true, false).take) << c.T;
    const auto s = fused_choice(plan, len, c.N, c.HV, 132, seg, true, false);
    EXPECT_TRUE(s.take);
    EXPECT_EQ(s.segment_tokens, 512);
  }
  // At the measured step the model follows the measurements of targets.md's shapes: the
  // two-kernel plan on P1 (1 x 8192, HV = 96; fused 1.28 against 1.20 ms) and S1 (1 x 1024,
  // HV = 4), the fused kernel on P4 (8 x 1024, HV = 96; 1.01 against 1.16 ms) and P6 (16 x 4096,
  // HV = 32; 2.53 against 2.78 ms).
  auto takes = [&](const Shape& c) {
    const auto plan = cuda::pf::prefill_plan(c.varlen, c.T, c.N, c.HV, 132, def);
    return fused_choice(plan, c.varlen ? c.T / c.N : c.T, c.N, c.HV, 132, def, true, false).take;
  };
  EXPECT_FALSE(takes(Shape{false, 8192, 1, 96}));
  EXPECT_FALSE(takes(Shape{false, 1024, 1, 4}));
  EXPECT_TRUE(takes(Shape{true, 8192, 8, 96}));
  EXPECT_TRUE(takes(Shape{false, 4096, 16, 32}));
  // Few long chains split into segments: S11 (1 x 65536, H = 4).
  EXPECT_GT(fused_choice(cuda::pf::prefill_plan(false, 65536, 1, 4, 132, def), 65536, 1, 4, 132,
                         forced, true, false)
                .segment_tokens,
            0);
}

// The graph launch of a call's kernels: on by default, "0" turns it off, anything else keeps it
// on.
TEST(PrefillHeuristics, GraphLaunchKnob) {
  EXPECT_TRUE(detail::Tuning{}.prefill_graph);  // on by default
  EXPECT_TRUE(tuning({}).prefill_graph);
  EXPECT_FALSE(tuning({{"KDA_CUDA_PREFILL_GRAPH", "0"}}).prefill_graph);
  EXPECT_TRUE(tuning({{"KDA_CUDA_PREFILL_GRAPH", "yes"}}).prefill_graph);  // not "0": the default
  EXPECT_TRUE(tuning({{"KDA_CUDA_PREFILL_GRAPH", "1"}}).prefill_graph);
}

// The single launch: its knob, and where it is taken (unsegmented, unfused wgmma plans whose
// prepare and recurrence blocks both fit one per SM).
TEST(PrefillHeuristics, SingleLaunch) {
  using cuda::pf::single_launch;
  EXPECT_FALSE(detail::Tuning{}.prefill_single);  // off by default (slower on the GPU)
  EXPECT_FALSE(tuning({{"KDA_CUDA_PREFILL_SINGLE", "0"}}).prefill_single);
  EXPECT_FALSE(tuning({{"KDA_CUDA_PREFILL_SINGLE", "yes"}}).prefill_single);
  const detail::Tuning on = tuning({{"KDA_CUDA_PREFILL_SINGLE", "1"}});
  ASSERT_TRUE(on.prefill_single);
  // S1: 1 x 1024 tokens, 4 heads: 16 chunk slots x 4 = 64 prepare blocks, vs = 64 (8 recurrence
  // blocks), no segments.
  const cuda::pf::PrefillPlan s1 = cuda::pf::prefill_plan(false, 1024, 1, 4, 132, on);
  ASSERT_EQ(s1.segment_tokens, 0);
  ASSERT_TRUE(s1.rec.wgmma);
  EXPECT_TRUE(single_launch(s1, 64, 4 * (128 / s1.rec.vs), 132, on));
  EXPECT_TRUE(single_launch(s1, 132, 132, 132, on));
  EXPECT_FALSE(single_launch(s1, 133, 8, 132, on));  // prepare blocks beyond one per SM
  EXPECT_FALSE(single_launch(s1, 64, 133, 132, on));
  EXPECT_FALSE(single_launch(s1, 0, 8, 132, on));  // nothing to prepare (no sequence)
  EXPECT_FALSE(single_launch(s1, 64, 8, 132, detail::Tuning{}));  // the default
  cuda::pf::PrefillPlan p = s1;
  p.segment_tokens = 256;
  EXPECT_FALSE(single_launch(p, 64, 8, 132, on));
  p = s1;
  p.fused = true;
  EXPECT_FALSE(single_launch(p, 64, 8, 132, on));
  p = s1;
  p.rec = cuda::pf::recurrence_choice_for_split(32, on);  // the K split on mma.sync
  EXPECT_FALSE(single_launch(p, 64, 16, 132, on));
  p.rec = cuda::pf::recurrence_choice_for_split(128, on);  // 16-token records at vs = 128
  EXPECT_TRUE(p.rec.chunk16);
  EXPECT_TRUE(single_launch(p, 64, 4, 132, on));
  p.rec = cuda::pf::recurrence_choice_for_split(64, tuning({{"KDA_CUDA_PREFILL_WGMMA", "0"}}));
  EXPECT_FALSE(single_launch(p, 64, 8, 132, on));
  // P1 (1 x 8192, 96 heads): 12,288 prepare blocks, two launches.
  const cuda::pf::PrefillPlan p1 = cuda::pf::prefill_plan(false, 8192, 1, 96, 132, on);
  EXPECT_FALSE(single_launch(p1, 128 * 96, 96, 132, on));
}

TEST(PrefillHeuristics, SegmentSlots) {
  using cuda::pf::prefill_segment_slots;
  EXPECT_EQ(prefill_segment_slots(false, 2, 1000, 2, 256), 8);
  EXPECT_EQ(prefill_segment_slots(false, 1, 0, 1, 256), 1);   // an empty sequence keeps one
  EXPECT_EQ(prefill_segment_slots(false, 1, 1000, 1, 0), 0);  // no segments
  // Varlen: sequence n owns max(1, ceil(len / L)) slots from bos / L + n on, disjoint and below
  // the bound for any split of T tokens.
  for (int64_t L : {64, 128, 192, 256}) {
    const std::vector<int64_t> lens = {1, 63, 64, 65, 0, 127, 129, 5, 700, 0};
    int64_t T = 0;
    for (int64_t l : lens) T += l;
    const int64_t slots = prefill_segment_slots(true, 1, T, static_cast<int64_t>(lens.size()), L);
    int64_t bos = 0, prev_end = 0;
    for (size_t n = 0; n < lens.size(); ++n) {
      const int64_t first = bos / L + static_cast<int64_t>(n);
      const int64_t count = lens[n] > 0 ? (lens[n] + L - 1) / L : 1;
      EXPECT_GE(first, prev_end) << "L " << L << " sequence " << n;
      EXPECT_LE(first + count, slots) << "L " << L << " sequence " << n;
      prev_end = first + count;
      bos += lens[n];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode kernel choice
// ---------------------------------------------------------------------------------------------

// The decode kernel choice (host-only: runs without a GPU). H = HV = 32, K = V = 128, 132 SMs.
detail::DecodeProblem heuristic_problem(int64_t N, int64_t T, DType state_dtype) {
  detail::DecodeProblem pr;
  pr.d.N = pr.d.B = N;
  pr.d.T = T;
  pr.d.H = pr.d.HV = 32;
  pr.d.K = pr.d.V = 128;
  void* aligned = reinterpret_cast<void*>(uintptr_t{1} << 20);  // never dereferenced
  pr.state = make_view(aligned, state_dtype, {N + 1, 32, 128, 128}, Device::kCUDA);
  for (TensorView* t : {&pr.q, &pr.k, &pr.v, &pr.g, &pr.out})
    *t = make_view(aligned, DType::kBFloat16, {N, T, 32, 128}, Device::kCUDA);
  pr.beta = make_view(aligned, DType::kBFloat16, {N, T, 32, 1}, Device::kCUDA);
  pr.dt_bias = make_view(aligned, DType::kFloat32, {32, 128}, Device::kCUDA);
  pr.state_indices = make_view(aligned, DType::kInt32, {N}, Device::kCUDA);
  return pr;
}

TEST(DecodeHeuristics, KernelChoice) {
  using cuda::choose_kernel;
  using K = cuda::DecodeKernel;
  using Override = detail::DecodeKernelOverride;
  const int sms = 132;
  auto pick = [&](const detail::DecodeProblem& pr, Override want = Override::kAuto) {
    detail::Tuning t;
    t.decode_kernel = want;
    return choose_kernel(pr, sms, t);
  };
  // Dense single-token calls (the benchmark's shapes).
  EXPECT_EQ(pick(heuristic_problem(1, 1, DType::kFloat32)), K::kSingle);  // 128 blocks
  EXPECT_EQ(pick(heuristic_problem(2, 1, DType::kFloat32)), K::kSingle);
  EXPECT_EQ(pick(heuristic_problem(8, 1, DType::kFloat32)), K::kSingle);   // 1024 blocks
  EXPECT_EQ(pick(heuristic_problem(32, 1, DType::kFloat32)), K::kSingle);  // 4096 blocks
  EXPECT_EQ(pick(heuristic_problem(256, 1, DType::kFloat32)), K::kBulk);   // >= 64 blocks per SM
  EXPECT_EQ(pick(heuristic_problem(1024, 1, DType::kFloat32)), K::kBulk);
  EXPECT_EQ(pick(heuristic_problem(1, 1, DType::kBFloat16)), K::kBulkLatency);    // no bf16 warp
  EXPECT_EQ(pick(heuristic_problem(256, 1, DType::kBFloat16)), K::kBulkLatency);  // every bf16 pool
  EXPECT_EQ(pick(heuristic_problem(32, 1, DType::kBFloat16)), K::kBulkLatency);
  // What the single-token kernel does not take: the previous choice.
  {
    detail::DecodeProblem f = heuristic_problem(1, 1, DType::kFloat32);
    f.q.dtype = f.k.dtype = f.v.dtype = DType::kFloat32;  // fp32 inputs (the CPU backends' dtype)
    EXPECT_EQ(pick(f), K::kBulkLatency);
    f = heuristic_problem(8, 1, DType::kFloat32);
    f.state_indices = make_view(f.state.data, DType::kInt32, {8, 1}, Device::kCUDA);
    f.indices_2d = true;  // [N, Tmax] indices
    EXPECT_EQ(pick(f), K::kStaged);
    f = heuristic_problem(1, 1, DType::kFloat32);
    f.q.data = static_cast<char*>(f.q.data) + 8;  // q rows not 16-byte aligned
    EXPECT_EQ(pick(f), K::kBulkLatency);
    f = heuristic_problem(1, 1, DType::kFloat32);
    f.g.dtype = DType::kFloat32;  // fp32 g, beta, out and a separate aligned final state: taken
    f.beta.dtype = f.out.dtype = DType::kFloat32;
    f.final_state = make_view(f.state.data, DType::kFloat32, {1, 32, 128, 128}, Device::kCUDA);
    EXPECT_EQ(pick(f), K::kSingle);
    f.intermediate_states = f.final_state;  // per-token states
    f.final_state = TensorView{};
    EXPECT_EQ(pick(f), K::kBulkLatency);
  }
  // Several tokens, varlen: not the bulk kernel's latency variant.
  EXPECT_EQ(pick(heuristic_problem(1, 2, DType::kFloat32)), K::kStagedLatency);
  EXPECT_EQ(pick(heuristic_problem(256, 4, DType::kFloat32)), K::kBulk);
  EXPECT_EQ(pick(heuristic_problem(256, 4, DType::kBFloat16)), K::kStaged);
  detail::DecodeProblem v = heuristic_problem(1, 1, DType::kFloat32);
  v.d.varlen = true;
  EXPECT_EQ(pick(v), K::kStagedLatency);
  // Shapes the fast kernels do not take: the tile kernel.
  detail::DecodeProblem kf = heuristic_problem(1, 1, DType::kFloat32);
  kf.layout = StateLayout::kKFirst;
  EXPECT_EQ(pick(kf), K::kTile);
  detail::DecodeProblem un = heuristic_problem(1, 1, DType::kFloat32);
  un.state.data = static_cast<char*>(un.state.data) + 4;  // rows not 16-byte aligned
  EXPECT_EQ(pick(un), K::kTile);
  detail::DecodeProblem k64 = heuristic_problem(1, 1, DType::kFloat32);
  k64.d.K = k64.d.V = 64;
  EXPECT_EQ(pick(k64), K::kTile);
  // A written state tensor with unaligned rows: no bulk kernel.
  for (int64_t n : {int64_t{1}, int64_t{256}}) {
    detail::DecodeProblem fs = heuristic_problem(n, 1, DType::kFloat32);
    fs.final_state = make_view(static_cast<char*>(fs.state.data) + 4, DType::kFloat32,
                               {n, 32, 128, 128}, Device::kCUDA);
    EXPECT_EQ(pick(fs), n == 1 ? K::kStagedLatency : K::kStaged) << n;
    EXPECT_EQ(pick(fs, Override::kBulkLatency), n == 1 ? K::kStagedLatency : K::kStaged) << n;
  }
  // Overrides, where eligible.
  const detail::DecodeProblem b1 = heuristic_problem(1, 1, DType::kFloat32),
                              b1t2 = heuristic_problem(1, 2, DType::kFloat32);
  EXPECT_EQ(pick(b1, Override::kBaseline), K::kBaseline);
  EXPECT_EQ(pick(b1, Override::kTile), K::kTile);
  EXPECT_EQ(pick(b1, Override::kStaged), K::kStaged);
  EXPECT_EQ(pick(b1, Override::kBulk), K::kBulk);
  EXPECT_EQ(pick(b1, Override::kBulkLatency), K::kBulkLatency);
  EXPECT_EQ(pick(heuristic_problem(256, 1, DType::kFloat32), Override::kBulkLatency),
            K::kBulkLatency);
  EXPECT_EQ(pick(b1t2, Override::kBulkLatency),
            K::kStagedLatency);  // not eligible: the default choice
  EXPECT_EQ(pick(kf, Override::kBulk), K::kTile);
  // The warp kernel (forced only): any T, dense or varlen, any batch; fp32 V-first aligned pools.
  EXPECT_EQ(pick(b1t2, Override::kWarp), K::kWarp);
  EXPECT_EQ(pick(v, Override::kWarp), K::kWarp);
  EXPECT_EQ(pick(heuristic_problem(1024, 1, DType::kFloat32), Override::kWarp), K::kWarp);
  EXPECT_EQ(pick(heuristic_problem(1, 1, DType::kBFloat16), Override::kWarp), K::kBulkLatency);
  EXPECT_EQ(pick(kf, Override::kWarp), K::kTile);
  EXPECT_EQ(pick(un, Override::kWarp), K::kTile);
  // The single-token kernel forced: any batch it takes; else the default choice.
  EXPECT_EQ(pick(heuristic_problem(1024, 1, DType::kFloat32), Override::kSingle), K::kSingle);
  EXPECT_EQ(pick(b1, Override::kSingle), K::kSingle);
  EXPECT_EQ(pick(b1t2, Override::kSingle), K::kStagedLatency);
  EXPECT_EQ(pick(v, Override::kSingle), K::kStagedLatency);
  EXPECT_EQ(pick(heuristic_problem(1, 1, DType::kBFloat16), Override::kSingle), K::kBulkLatency);
  EXPECT_EQ(pick(kf, Override::kSingle), K::kTile);
}

TEST(DecodeHeuristics, WarpConfig) {
  using cuda::choose_warp_config;
  const int sms = 132;
  auto config = [&](int64_t N, int rows = 0,
                    detail::DecodeStateCache cache = detail::DecodeStateCache::kAuto) {
    detail::Tuning t;
    t.decode_warp_rows = rows;
    t.decode_warp_cache = cache;
    return choose_warp_config(heuristic_problem(N, 1, DType::kFloat32), sms, t);
  };
  // Rows per warp: 8 up to 64 value rows per SM (B = 2: 8192 <= 8448), then 16.
  EXPECT_EQ(config(1).rows, 8);
  EXPECT_EQ(config(2).rows, 8);
  EXPECT_EQ(config(3).rows, 16);
  EXPECT_EQ(config(8).rows, 16);
  // The normal L2 policy while the touched state fits 24 MiB (B = 12 at 2 MiB per row), else
  // streaming.
  EXPECT_FALSE(config(1).stream);
  EXPECT_FALSE(config(8).stream);
  EXPECT_FALSE(config(12).stream);
  EXPECT_TRUE(config(13).stream);
  EXPECT_TRUE(config(256).stream);
  // Overrides.
  for (int rows : {4, 8, 16}) {
    EXPECT_EQ(config(1, rows).rows, rows);
    EXPECT_EQ(config(256, rows).rows, rows);
  }
  EXPECT_EQ(config(1, 5).rows, 8);  // not a valid row count: the heuristic's
  EXPECT_TRUE(config(1, 0, detail::DecodeStateCache::kStream).stream);
  EXPECT_FALSE(config(256, 0, detail::DecodeStateCache::kNormal).stream);
}

}  // namespace
}  // namespace kda::test
