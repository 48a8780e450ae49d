// test_cpu_validation.cpp — every bad-input path returns its documented error, names the
// argument, and leaves every output untouched. Also the host conversion helpers.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "core/kda_math.h"
#include "support.h"

namespace kda::test {
namespace {

struct BadPrefill {
  std::string name;
  std::function<void(PrefillParams&, PrefillData&)> mutate;
  std::string argument;  // must appear in the message
  StatusCode code = StatusCode::kInvalidArgument;
};

PrefillCase base_prefill() {
  PrefillCase c;
  c.varlen = true;
  c.seqlens = {10, 20};
  c.checkpoint_every = 64;
  c.dtype = DType::kBFloat16;
  return c;
}

std::vector<BadPrefill> bad_prefill_inputs() {
  using P = PrefillParams;
  using D = PrefillData;
  return {
      {"q_absent", [](P& p, D&) { p.q = TensorView{}; }, "'q'"},
      {"q_rank", [](P& p, D&) { p.q.ndim = 2; }, "'q'"},
      {"q_dtype_int", [](P& p, D&) { p.q.dtype = DType::kInt32; }, "'q'"},
      {"q_last_stride", [](P& p, D&) { p.q.strides[p.q.ndim - 1] = 2; }, "'q'"},
      {"q_negative_stride", [](P& p, D&) { p.q.strides[0] = -1; }, "'q'"},
      {"q_null_data", [](P& p, D&) { p.q.data = nullptr; }, "'q'"},
      {"q_K_too_big", [](P& p, D&) { p.q.shape[p.q.ndim - 1] = 300; }, "'q'"},
      {"k_shape", [](P& p, D&) { p.k.shape[1] = 1; }, "'k'"},
      {"k_dtype", [](P& p, D&) { p.k.dtype = DType::kFloat16; }, "'k'"},
      {"k_device", [](P& p, D&) { p.k.device = Device::kCUDA; }, "'k'"},
      {"v_heads_not_multiple", [](P& p, D&) { p.v.shape[1] = 3; }, "'v'"},
      {"v_dtype", [](P& p, D&) { p.v.dtype = DType::kFloat32; }, "'v'"},
      {"g_absent", [](P& p, D&) { p.g = TensorView{}; }, "'g'"},
      {"g_shape", [](P& p, D&) { p.g.shape[2] = 7; }, "'g'"},
      {"g_dtype", [](P& p, D&) { p.g.dtype = DType::kFloat16; }, "'g'"},
      {"beta_shape", [](P& p, D&) { p.beta.shape[1] = 5; }, "'beta'"},
      {"A_log_dtype", [](P& p, D&) { p.A_log.dtype = DType::kBFloat16; }, "'A_log'"},
      {"A_log_shape", [](P& p, D&) { p.A_log.shape[0] = 1; }, "'A_log'"},
      {"dt_bias_shape", [](P& p, D&) { p.dt_bias.shape[1] = 3; }, "'dt_bias'"},
      {"out_absent", [](P& p, D&) { p.out = TensorView{}; }, "'out'"},
      {"out_dtype", [](P& p, D&) { p.out.dtype = DType::kFloat32; }, "'out'"},
      {"cu_dtype", [](P& p, D&) { p.cu_seqlens.dtype = DType::kFloat32; }, "'cu_seqlens'"},
      {"cu_first_nonzero", [](P& p, D& d) { d.cu.set(0, 1); }, "'cu_seqlens'"},
      {"cu_decreasing", [](P& p, D& d) { d.cu.set(1, 35); }, "'cu_seqlens'"},
      {"cu_last_not_T", [](P& p, D& d) { d.cu.set(2, 29); }, "'cu_seqlens'"},
      {"varlen_batch_not_1", [](P& p, D&) { p.q.shape[0] = 2; }, "'q'"},
      {"initial_state_rows", [](P& p, D&) { p.initial_state.shape[0] = 3; }, "'initial_state'"},
      {"initial_state_layout",
       [](P& p, D&) {
         p.state_layout = StateLayout::kKFirst;
         p.initial_state.shape[2] = 7;
       },
       "'initial_state'"},
      {"initial_state_dtype", [](P& p, D&) { p.initial_state.dtype = DType::kInt64; },
       "'initial_state'"},
      {"final_state_shape", [](P& p, D&) { p.final_state.shape[1] = 1; }, "'final_state'"},
      {"pool_without_indices",
       [](P& p, D&) {
         p.state_pool = p.final_state;
         p.initial_state = p.final_state = TensorView{};
       },
       "'state_indices'"},
      {"indices_without_pool", [](P& p, D& d) { p.state_indices = d.cu.view(); }, "'state_pool'"},
      {"pool_with_initial_state",
       [](P& p, D& d) {
         p.state_pool = p.final_state;
         p.state_indices = d.cu.view();
         p.state_indices.shape[0] = 2;
         p.final_state = TensorView{};
       },
       "'initial_state'"},
      {"checkpoint_every_not_multiple", [](P& p, D&) { p.checkpoint_every = 65; },
       "'checkpoint_every'"},
      {"checkpoints_without_every", [](P& p, D&) { p.checkpoint_every = 0; }, "'checkpoint_every'"},
      {"checkpoint_offsets_absent", [](P& p, D&) { p.checkpoint_offsets = TensorView{}; },
       "'checkpoint_offsets'"},
      {"checkpoint_offsets_values", [](P& p, D& d) { d.ckpt_off.set(1, 5); },
       "'checkpoint_offsets'"},
      {"lower_bound_range",
       [](P& p, D&) {
         p.math.gate = GateForm::kLowerBound;
         p.math.lower_bound = -6;
       },
       "'lower_bound'"},
      {"lower_bound_zero",
       [](P& p, D&) {
         p.math.gate = GateForm::kLowerBound;
         p.math.lower_bound = 0;
       },
       "'lower_bound'"},
      {"gate_code", [](P& p, D&) { p.math.gate = static_cast<GateForm>(9); }, "'gate'"},
      {"neg_eigval_needs_logits",
       [](P& p, D&) {
         p.math.beta_logits = false;
         p.math.allow_neg_eigval = true;
       },
       "'allow_neg_eigval'"},
      {"scale_nan", [](P& p, D&) { p.math.scale = std::nan(""); }, "'scale'"},
      {"layout_code", [](P& p, D&) { p.state_layout = static_cast<StateLayout>(5); },
       "'state_layout'"},
      {"backend_cuda_on_cpu_tensors", [](P& p, D&) { p.exec.backend = Backend::kCuda; },
       "'backend'", StatusCode::kInvalidArgument},
      {"num_threads_negative", [](P& p, D&) { p.exec.num_threads = -2; }, "'num_threads'"},
  };
}

class PrefillBadInput : public ::testing::TestWithParam<BadPrefill> {};

TEST_P(PrefillBadInput, ReturnsErrorNamingArgumentAndWritesNothing) {
  PrefillData d = make_prefill(base_prefill());
  PrefillParams p = d.params();
  p.exec.backend = Backend::kCpu;
  GetParam().mutate(p, d);
  const HostTensor out = d.out, ht = d.ht, ck = d.ckpt;
  const Status s = prefill(p);
  EXPECT_EQ(s.code(), GetParam().code) << s.to_string();
  EXPECT_NE(s.message().find(GetParam().argument), std::string::npos) << s.message();
  EXPECT_EQ("'" + s.argument() + "'", GetParam().argument) << s.message();
  EXPECT_NE(s.message().find("expected"), std::string::npos) << s.message();
  EXPECT_TRUE(bitwise_equal(d.out, out));
  EXPECT_TRUE(bitwise_equal(d.ht, ht));
  EXPECT_TRUE(bitwise_equal(d.ckpt, ck));
  EXPECT_EQ(validate(p).code(), s.code() == StatusCode::kInvalidArgument &&
                                        GetParam().argument != "'backend'" &&
                                        GetParam().argument != "'num_threads'"
                                    ? StatusCode::kInvalidArgument
                                    : StatusCode::kOk);
}

INSTANTIATE_TEST_SUITE_P(Cpu, PrefillBadInput, ::testing::ValuesIn(bad_prefill_inputs()),
                         [](const auto& info) { return info.param.name; });

struct BadDecode {
  std::string name;
  std::function<void(DecodeParams&, DecodeData&)> mutate;
  std::string argument;
};

std::vector<BadDecode> bad_decode_inputs() {
  using P = DecodeParams;
  using D = DecodeData;
  return {
      {"K_not_multiple_of_32", [](P& p, D&) { p.q.shape[3] = p.k.shape[3] = p.g.shape[3] = 16; },
       "'v'"},
      {"beta_shape", [](P& p, D&) { p.beta.shape[2] = 1; }, "'beta'"},
      {"out_dtype", [](P& p, D&) { p.out.dtype = DType::kFloat16; }, "'out'"},
      {"dt_bias_dtype", [](P& p, D&) { p.dt_bias.dtype = DType::kFloat16; }, "'dt_bias'"},
      {"state_absent", [](P& p, D&) { p.state = TensorView{}; }, "'state'"},
      {"state_fp16", [](P& p, D&) { p.state.dtype = DType::kFloat16; }, "'state'"},
      {"state_heads", [](P& p, D&) { p.state.shape[1] = 1; }, "'state'"},
      {"indices_dtype", [](P& p, D&) { p.state_indices.dtype = DType::kFloat32; },
       "'state_indices'"},
      {"indices_shape", [](P& p, D&) { p.state_indices.shape[0] = 1; }, "'state_indices'"},
      {"nat_without_2d_indices", [](P& p, D& d) { p.num_accepted_tokens = d.idx.view(); },
       "'num_accepted_tokens'"},
      {"final_state_dtype",
       [](P& p, D& d) {
         d.final_state = HostTensor(DType::kBFloat16, {d.N, d.c.HV, d.c.K, d.c.K});
         p.final_state = d.final_state.view();
       },
       "'final_state'"},
      {"intermediate_rows",
       [](P& p, D& d) {
         d.inter = HostTensor(DType::kFloat32, {1, d.c.HV, d.c.K, d.c.K});
         p.intermediate_states = d.inter.view();
       },
       "'intermediate_states'"},
  };
}

class DecodeBadInput : public ::testing::TestWithParam<BadDecode> {};

TEST_P(DecodeBadInput, ReturnsErrorNamingArgumentAndWritesNothing) {
  DecodeCase c;
  c.T = 1;
  DecodeData d = make_decode(c);
  DecodeParams p = d.params();
  p.exec.backend = Backend::kCpu;
  GetParam().mutate(p, d);
  const HostTensor out = d.out, st = d.state;
  const Status s = decode(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(GetParam().argument), std::string::npos) << s.message();
  EXPECT_EQ("'" + s.argument() + "'", GetParam().argument) << s.message();
  EXPECT_TRUE(bitwise_equal(d.out, out));
  EXPECT_TRUE(bitwise_equal(d.state, st));
}

INSTANTIATE_TEST_SUITE_P(Cpu, DecodeBadInput, ::testing::ValuesIn(bad_decode_inputs()),
                         [](const auto& info) { return info.param.name; });

// The Python test that crashed on the device (test_compat.py, test_decode_errors_use_mate_names):
// beta passed as the strided view b[..., :2] of a [N, 1, HV] array. Validation must reject it
// with a message that spells both shapes, and nothing may be written.
TEST(DecodeBadInputExact, NarrowedStridedBetaViewIsRejectedWithBothShapes) {
  DecodeCase c;
  c.N = 3;
  c.T = 1;
  c.dtype = c.out_dtype = DType::kFloat32;
  DecodeData d = make_decode(c);
  DecodeParams p = d.params();
  ASSERT_EQ(p.beta.ndim, 3);
  p.beta.shape[2] = 2;  // same data and strides [HV, HV, 1]: a non-contiguous [3, 1, 2] view
  ASSERT_EQ(p.beta.strides[1], c.HV);
  const HostTensor out = d.out, st = d.state;
  for (Backend be : {Backend::kAuto, Backend::kCpu, Backend::kCpuReference}) {
    p.exec.backend = be;
    const Status s = decode(p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_EQ(s.message(),
              "argument 'beta': expected shape [B, T, HV] or [B, T, HV, V] = "
              "[3, 1, 4, 32], got shape [3, 1, 2]");
    EXPECT_EQ(validate(p).message(), s.message());
  }
  EXPECT_TRUE(bitwise_equal(d.out, out));
  EXPECT_TRUE(bitwise_equal(d.state, st));
}

// Some messages describe a view before its structural check (num_accepted_tokens without [N, T]
// indices, states in pool mode): a rank beyond kMaxDims must be reported, never read past the
// view's shape array.
TEST(DecodeBadInputExact, OutOfRangeRankIsReportedWithoutReadingPastTheShape) {
  DecodeData d = make_decode(DecodeCase{});
  DecodeParams p = d.params();
  p.exec.backend = Backend::kCpu;
  p.num_accepted_tokens = d.idx.view();
  p.num_accepted_tokens.ndim = 64;
  Status s = decode(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("argument 'num_accepted_tokens'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("got rank 64"), std::string::npos) << s.message();

  PrefillData pd = make_prefill(base_prefill());
  PrefillParams pp = pd.params();
  pp.state_pool = pp.final_state;
  pp.state_indices = pd.cu.view();
  pp.final_state = TensorView{};
  pp.initial_state = pp.state_pool;
  pp.initial_state.ndim = 1000;
  s = validate(pp);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("argument 'initial_state'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("got rank 1000"), std::string::npos) << s.message();
}

// Every shape in a message is formatted the same way (no stream state involved).
TEST(DecodeBadInputExact, ShapeMessagesFormatAllRanks) {
  DecodeData d = make_decode(DecodeCase{});
  DecodeParams p = d.params();
  p.exec.backend = Backend::kCpu;
  p.state.shape[1] = 1;
  const Status s = decode(p);
  EXPECT_NE(s.message().find("got shape [" + std::to_string(d.P) + ", 1, 32, 32]"),
            std::string::npos)
      << s.message();
  p = d.params();
  p.q.ndim = 1;
  p.q.shape[0] = -3;
  EXPECT_NE(decode(p).message().find("got shape [-3]"), std::string::npos) << decode(p).message();
}

TEST(ValidationSmoke, ValidInputsPass) {
  PrefillData d = make_prefill(base_prefill());
  EXPECT_TRUE(validate(d.params()).ok()) << validate(d.params()).to_string();
  DecodeData dd = make_decode(DecodeCase{});
  EXPECT_TRUE(validate(dd.params()).ok()) << validate(dd.params()).to_string();
  size_t bytes = 1;
  EXPECT_TRUE(prefill_workspace_size(d.params(), &bytes).ok());
  EXPECT_EQ(bytes, 0u);  // the CPU backends need no caller workspace
}

TEST(Conversions, HalfRoundTripsAndRounding) {
  using namespace kda::detail;
  for (float x : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 1e-3f, 3.14159f}) {
    EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(x)),
              x == 3.14159f ? 3.140625f : (x == 1e-3f ? 0.0010004044f : x))
        << x;
  }
  EXPECT_TRUE(std::isinf(fp16_bits_to_float(float_to_fp16_bits(70000.0f))));
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(2.9802322e-08f)), 0.0f);     // ties to even: 0
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 1.0f / 256)), 1.0f);  // tie to even
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::nanf("")))));
}

TEST(Helpers, CheckpointOffsets) {
  EXPECT_EQ(checkpoint_offsets({0, 64, 64, 200, 263}, 64), (std::vector<int64_t>{0, 1, 1, 3, 3}));
  EXPECT_EQ(checkpoint_offsets({0, 10}, 128), (std::vector<int64_t>{0, 0}));
}

}  // namespace
}  // namespace kda::test
