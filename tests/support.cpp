// support.cpp — see support.h.
#include "support.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "core/kda_math.h"

namespace kda::test {

namespace {
const char* short_dtype(DType d) { return dtype_name(d); }
}  // namespace

HostTensor::HostTensor(DType dt, std::vector<int64_t> shp, bool padded)
    : dtype(dt), shape(std::move(shp)) {
  strides.assign(shape.size(), 1);
  int64_t inner = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = inner;
    int64_t extent = shape[i] * inner;
    if (padded && i < static_cast<int>(shape.size()) - 1) extent += 3 * inner + 5;
    if (padded && i == static_cast<int>(shape.size()) - 1) extent += 7;
    inner = std::max<int64_t>(extent, 1);
  }
  storage.assign(static_cast<size_t>(inner) * dtype_size(dt), 0);
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return shape.empty() ? 0 : n;
}

TensorView HostTensor::view() const {
  if (shape.empty()) return TensorView{};
  return make_strided_view(const_cast<uint8_t*>(storage.data()), dtype, shape, strides);
}

int64_t HostTensor::offset(int64_t flat) const {
  int64_t off = 0;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    const int64_t idx = flat % shape[i];
    flat /= shape[i];
    off += idx * strides[i];
  }
  return off;
}

double HostTensor::get(int64_t flat) const {
  const int64_t off = offset(flat);
  const uint8_t* p = storage.data();
  switch (dtype) {
    case DType::kFloat32: {
      float x;
      std::memcpy(&x, p + off * 4, 4);
      return x;
    }
    case DType::kFloat16: {
      uint16_t x;
      std::memcpy(&x, p + off * 2, 2);
      return detail::fp16_bits_to_float(x);
    }
    case DType::kBFloat16: {
      uint16_t x;
      std::memcpy(&x, p + off * 2, 2);
      return detail::bf16_bits_to_float(x);
    }
    case DType::kInt32: {
      int32_t x;
      std::memcpy(&x, p + off * 4, 4);
      return x;
    }
    case DType::kInt64: {
      int64_t x;
      std::memcpy(&x, p + off * 8, 8);
      return static_cast<double>(x);
    }
  }
  return 0;
}

void HostTensor::set(int64_t flat, double v) {
  const int64_t off = offset(flat);
  uint8_t* p = storage.data();
  switch (dtype) {
    case DType::kFloat32: {
      float x = static_cast<float>(v);
      std::memcpy(p + off * 4, &x, 4);
      break;
    }
    case DType::kFloat16: {
      uint16_t x = detail::float_to_fp16_bits(static_cast<float>(v));
      std::memcpy(p + off * 2, &x, 2);
      break;
    }
    case DType::kBFloat16: {
      uint16_t x = detail::float_to_bf16_bits(static_cast<float>(v));
      std::memcpy(p + off * 2, &x, 2);
      break;
    }
    case DType::kInt32: {
      int32_t x = static_cast<int32_t>(v);
      std::memcpy(p + off * 4, &x, 4);
      break;
    }
    case DType::kInt64: {
      int64_t x = static_cast<int64_t>(v);
      std::memcpy(p + off * 8, &x, 8);
      break;
    }
  }
}

void HostTensor::fill(double x) {
  for (int64_t i = 0; i < numel(); ++i) set(i, x);
}
void HostTensor::fill_normal(std::mt19937_64& rng, double sd, double mean) {
  std::normal_distribution<double> nd(mean, sd);
  for (int64_t i = 0; i < numel(); ++i) set(i, nd(rng));
}
void HostTensor::fill_uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> ud(lo, hi);
  for (int64_t i = 0; i < numel(); ++i) set(i, ud(rng));
}
void HostTensor::fill_bytes(uint8_t b) { std::fill(storage.begin(), storage.end(), b); }

HostTensor HostTensor::to(DType dt, bool padded) const {
  HostTensor r(dt, shape, padded);
  for (int64_t i = 0; i < numel(); ++i) r.set(i, get(i));
  return r;
}

std::vector<double> HostTensor::values() const {
  std::vector<double> v(numel());
  for (int64_t i = 0; i < numel(); ++i) v[i] = get(i);
  return v;
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  if (a.shape != b.shape || a.dtype != b.dtype) return false;
  const size_t es = dtype_size(a.dtype);
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(a.storage.data() + a.offset(i) * es, b.storage.data() + b.offset(i) * es, es) !=
        0)
      return false;
  return true;
}

std::string test_name(std::string s) {
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

Compare compare(const HostTensor& got, const HostTensor& ref, double tol) {
  Compare r;
  double num = 0, den = 0;
  const int64_t n = std::min(got.numel(), ref.numel());
  for (int64_t i = 0; i < n; ++i) den += ref.get(i) * ref.get(i);
  const double rms = n > 0 ? std::sqrt(den / n) : 0.0;
  int shown = 0;
  std::ostringstream s;
  for (int64_t i = 0; i < n; ++i) {
    const double g = got.get(i), f = ref.get(i);
    if (!std::isfinite(g)) {
      ++r.nonfinite;
      if (shown++ < 5) s << " [" << i << "] got " << g << " vs " << f << ";";
      continue;
    }
    const double dlt = g - f;
    num += dlt * dlt;
    r.max_abs = std::max(r.max_abs, std::fabs(dlt));
    if (std::fabs(dlt) > 4 * tol * rms + 1e-30 && shown < 5) {
      ++shown;
      s << " [" << i << "] got " << g << " vs " << f << ";";
    }
  }
  r.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (got.numel() != ref.numel()) s << " size mismatch " << got.numel() << " vs " << ref.numel();
  r.first_mismatches = s.str();
  return r;
}

double tolerance_for(DType dtype) {
  // The fp32 backends add ~1e-6 relative error; what remains is the rounding of the stored
  // result: bf16 (8-bit significand) ~1.7e-3 rel L2 on these distributions, fp16 ~2.2e-4.
  switch (dtype) {
    case DType::kBFloat16:
      return 3.0e-3;
    case DType::kFloat16:
      return 5.0e-4;
    default:
      return 5.0e-5;
  }
}

// ---------------------------------------------------------------------------------------------

std::string PrefillCase::name() const {
  std::ostringstream s;
  s << (varlen ? "varlen" : "dense");
  for (int64_t l : seqlens) s << "_" << l;
  s << "_H" << H << "_HV" << HV << "_K" << K << "_V" << V << "_" << short_dtype(dtype);
  s << "_g" << static_cast<int>(gate) << (beta_logits ? "_blogit" : "_bact");
  if (allow_neg_eigval) s << "_neg";
  if (!l2norm) s << "_nol2";
  s << (init == InitState::kNone ? "_h0none" : init == InitState::kZero ? "_h0zero" : "_h0rand");
  if (!final_state) s << "_nofinal";
  if (layout == StateLayout::kKFirst) s << "_kfirst";
  s << "_st" << short_dtype(state_dtype);
  if (strided) s << "_strided";
  if (gate_beta_fp32) s << "_gbf32";
  if (pool) s << "_pool";
  if (checkpoint_every) s << "_ckpt" << checkpoint_every;
  if (gate_extreme != 0) s << "_extreme";
  if (weak_decay) s << "_weak";
  if (slow_channel_dt != 0) s << "_slow";
  if (lower_bound != -5.0) s << "_lb";
  return s.str();
}

static std::vector<int64_t> state_shape(int64_t rows, int64_t HV, int64_t K, int64_t V,
                                        StateLayout l) {
  return l == StateLayout::kVFirst ? std::vector<int64_t>{rows, HV, V, K}
                                   : std::vector<int64_t>{rows, HV, K, V};
}

PrefillData make_prefill(const PrefillCase& c) {
  PrefillData d;
  d.c = c;
  std::mt19937_64 rng(c.seed);
  d.cu_host = {0};
  if (c.varlen) {
    for (int64_t l : c.seqlens) d.cu_host.push_back(d.cu_host.back() + l);
    d.N = static_cast<int64_t>(c.seqlens.size());
    d.B = 1;
    d.T = d.cu_host.back();
  } else {
    d.N = d.B = static_cast<int64_t>(c.seqlens.size());
    d.T = c.seqlens.empty() ? 0 : c.seqlens[0];
    for (int64_t n = 0; n < d.N; ++n) d.cu_host.push_back(d.cu_host.back() + d.T);
  }
  const bool s = c.strided;
  d.q = HostTensor(c.dtype, {d.B, d.T, c.H, c.K}, s);
  d.k = HostTensor(c.dtype, {d.B, d.T, c.H, c.K}, s);
  d.v = HostTensor(c.dtype, {d.B, d.T, c.HV, c.V}, s);
  d.g = HostTensor(c.dtype, {d.B, d.T, c.HV, c.K}, s);
  d.beta = HostTensor(c.dtype, {d.B, d.T, c.HV}, s);
  d.q.fill_normal(rng, 1.0);
  d.k.fill_normal(rng, 1.0);
  d.v.fill_normal(rng, 1.0);
  if (c.gate == GateForm::kPrecomputed) {
    if (c.weak_decay) {
      d.g.fill_uniform(rng, -0.02, 0.0);
    } else {
      // log decays in about [-3, 0): -exp(N(-1.5, 1))
      std::normal_distribution<double> nd(-1.5, 1.0);
      for (int64_t i = 0; i < d.g.numel(); ++i) d.g.set(i, -std::exp(nd(rng)));
    }
    if (c.gate_extreme != 0)
      for (int64_t i = 0; i < d.g.numel(); i += 7) d.g.set(i, c.gate_extreme);
  } else {
    d.g.fill_normal(rng, 1.0);
    d.A_log = HostTensor(DType::kFloat32, {c.HV});
    d.A_log.fill_uniform(rng, 0.0, 1.0);
    d.dt_bias = HostTensor(DType::kFloat32, {c.HV, c.K});
    d.dt_bias.fill_uniform(rng, 0.0, 1.0);
    if (c.slow_channel_dt != 0) d.dt_bias.set((c.HV - 1) * c.K, c.slow_channel_dt);
  }
  if (c.beta_logits)
    d.beta.fill_normal(rng, 1.0);
  else
    d.beta.fill_uniform(rng, 0.0, 1.0);
  if (c.gate_beta_fp32) {  // the same values, widened
    d.g = d.g.to(DType::kFloat32, s);
    d.beta = d.beta.to(DType::kFloat32, s);
  }
  d.out = HostTensor(c.dtype, {d.B, d.T, c.HV, c.V});
  d.out.fill_bytes(0xff);  // poison: every element must be written
  auto init_state = [&](HostTensor& t) {
    if (c.init == InitState::kRandom)
      t.fill_normal(rng, 0.1);
    else
      t.fill(0.0);
  };
  if (c.pool) {
    const int64_t P = d.N + 3;
    d.pool = HostTensor(c.state_dtype, state_shape(P, c.HV, c.K, c.V, c.layout));
    init_state(d.pool);
    d.idx = HostTensor(DType::kInt32, {d.N});
    std::vector<int64_t> perm(P);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t n = 0; n < d.N; ++n) d.idx.set(n, perm[n]);
    if (d.N >= 3) d.idx.set(1, -1);  // a sequence without a pooled state
  } else {
    if (c.init != InitState::kNone) {
      d.h0 = HostTensor(c.state_dtype, state_shape(d.N, c.HV, c.K, c.V, c.layout));
      init_state(d.h0);
    }
    if (c.final_state) {
      d.ht = HostTensor(c.state_dtype, state_shape(d.N, c.HV, c.K, c.V, c.layout));
      d.ht.fill_bytes(0xff);
    }
  }
  if (c.varlen) {
    d.cu = HostTensor(DType::kInt32, {d.N + 1});
    for (int64_t i = 0; i <= d.N; ++i) d.cu.set(i, d.cu_host[i]);
  }
  if (c.checkpoint_every > 0) {
    const auto off = checkpoint_offsets(d.cu_host, c.checkpoint_every);
    d.ckpt_off = HostTensor(DType::kInt64, {d.N + 1});
    for (int64_t i = 0; i <= d.N; ++i) d.ckpt_off.set(i, off[i]);
    d.ckpt = HostTensor(c.state_dtype,
                        state_shape(std::max<int64_t>(off.back(), 1), c.HV, c.K, c.V, c.layout));
    d.ckpt.fill(0.0);
  }
  return d;
}

DecodeParams decode_inputs_of_token(const PrefillParams& p, int64_t t) {
  auto token = [t](const TensorView& v) {
    TensorView r = v;
    r.data =
        static_cast<char*>(v.data) + t * v.strides[1] * static_cast<int64_t>(dtype_size(v.dtype));
    r.shape[1] = 1;
    return r;
  };
  DecodeParams d;
  d.q = token(p.q);
  d.k = token(p.k);
  d.v = token(p.v);
  d.g = token(p.g);
  d.beta = token(p.beta);
  d.A_log = p.A_log;
  d.dt_bias = p.dt_bias;
  d.math = p.math;
  return d;
}

PrefillData widen(const PrefillData& src) {
  PrefillData d = src;
  auto w = [](HostTensor& t) {
    if (!t.empty() && t.dtype != DType::kInt32 && t.dtype != DType::kInt64)
      t = t.to(DType::kFloat32);
  };
  for (HostTensor* t : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.out, &d.h0, &d.ht, &d.pool, &d.ckpt})
    w(*t);
  d.c.dtype = DType::kFloat32;
  d.c.state_dtype = DType::kFloat32;
  return d;
}

// Fields PrefillParams and DecodeParams share: the per-token inputs, gate parameters, output.
template <typename Params, typename Data>
void set_token_fields(Params& p, const Data& d) {
  p.q = d.q.view();
  p.k = d.k.view();
  p.v = d.v.view();
  p.g = d.g.view();
  p.beta = d.beta.view();
  p.A_log = d.A_log.view();
  p.dt_bias = d.dt_bias.view();
  p.cu_seqlens = d.cu.view();
  p.out = d.out.view();
  p.state_layout = d.c.layout;
  p.math.gate = d.c.gate;
  p.math.beta_logits = d.c.beta_logits;
  p.math.allow_neg_eigval = d.c.allow_neg_eigval;
}

PrefillParams PrefillData::params() const {
  PrefillParams p;
  set_token_fields(p, *this);
  p.initial_state = h0.view();
  p.final_state = ht.view();
  p.state_pool = pool.view();
  p.state_indices = idx.view();
  p.checkpoint_every = c.checkpoint_every;
  p.checkpoints = ckpt.view();
  p.checkpoint_offsets = ckpt_off.view();
  p.math.use_qk_l2norm = c.l2norm;
  p.math.lower_bound = static_cast<float>(c.lower_bound);
  return p;
}

// ---------------------------------------------------------------------------------------------

std::string DecodeCase::name() const {
  std::ostringstream s;
  if (seqlens.empty())
    s << "dense_N" << N << "_T" << T;
  else {
    s << "varlen";
    for (int64_t l : seqlens) s << "_" << l;
  }
  s << "_H" << H << "_HV" << HV << "_K" << K << "_" << short_dtype(dtype) << "_out"
    << short_dtype(out_dtype) << "_st" << short_dtype(state_dtype)
    << (layout == StateLayout::kKFirst ? "_kfirst" : "") << "_g" << static_cast<int>(gate)
    << (beta_logits ? "_blogit" : "_bact") << (allow_neg_eigval ? "_neg" : "")
    << (beta_per_v ? "_betav" : "") << "_idx" << indices
    << (index_dtype == DType::kInt64 ? "i64" : "") << (num_accepted ? "_nat" : "")
    << (padding ? "_pad" : "") << (final_state_separate ? "_sepfinal" : "")
    << (intermediate ? "_inter" : "") << (use_initial_state ? "" : "_noinit")
    << (store_final_state ? "" : "_nostore");
  return s.str();
}

DecodeData make_decode(const DecodeCase& c) {
  DecodeData d;
  d.c = c;
  std::mt19937_64 rng(c.seed);
  const bool varlen = !c.seqlens.empty();
  std::vector<int64_t> lens;
  if (varlen) {
    lens = c.seqlens;
    d.N = static_cast<int64_t>(lens.size());
    d.B = 1;
    d.T = std::accumulate(lens.begin(), lens.end(), int64_t{0});
  } else {
    d.N = d.B = c.N;
    d.T = c.T;
    lens.assign(d.N, c.T);
  }
  d.total = d.B * d.T;
  const int64_t Tmax =
      varlen ? std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end())) : c.T;
  const int64_t K = c.K, V = c.K;
  d.q = HostTensor(c.dtype, {d.B, d.T, c.H, K});
  d.k = HostTensor(c.dtype, {d.B, d.T, c.H, K});
  d.v = HostTensor(c.dtype, {d.B, d.T, c.HV, V});
  d.g = HostTensor(c.dtype, {d.B, d.T, c.HV, K});
  d.beta = c.beta_per_v ? HostTensor(c.dtype, {d.B, d.T, c.HV, V})
                        : HostTensor(c.dtype, {d.B, d.T, c.HV});
  d.q.fill_normal(rng, 1.0);
  d.k.fill_normal(rng, 1.0);
  d.v.fill_normal(rng, 1.0);
  if (c.gate == GateForm::kPrecomputed) {
    std::normal_distribution<double> nd(-1.5, 1.0);
    for (int64_t i = 0; i < d.g.numel(); ++i) d.g.set(i, -std::exp(nd(rng)));
  } else {
    d.g.fill_normal(rng, 1.0);
    d.A_log = HostTensor(DType::kFloat32, {c.HV});
    d.A_log.fill_uniform(rng, 0.0, 1.0);
    d.dt_bias = HostTensor(DType::kFloat32, {c.HV, K});
    d.dt_bias.fill_uniform(rng, 0.0, 1.0);
  }
  if (c.beta_logits)
    d.beta.fill_normal(rng, 1.0);
  else
    d.beta.fill_uniform(rng, 0.0, 1.0);
  d.out = HostTensor(c.out_dtype, {d.B, d.T, c.HV, V});
  d.out.fill_bytes(0xff);
  // Pool: slots used by the rows are a shuffled subset; extra slots stay untouched.
  const int64_t cols = c.indices == 2 ? Tmax : 1;
  const int64_t used = d.N * cols;
  d.P = used + c.pool_extra;
  const auto shp = c.layout == StateLayout::kVFirst ? std::vector<int64_t>{d.P, c.HV, V, K}
                                                    : std::vector<int64_t>{d.P, c.HV, K, V};
  d.state = HostTensor(c.state_dtype, shp);
  d.state.fill_normal(rng, 0.1);
  std::vector<int64_t> perm(d.P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  if (c.indices == 1) {
    d.idx = HostTensor(c.index_dtype, {d.N});
    for (int64_t n = 0; n < d.N; ++n) d.idx.set(n, perm[n]);
  } else if (c.indices == 2) {
    d.idx = HostTensor(c.index_dtype, {d.N, Tmax});
    for (int64_t i = 0; i < used; ++i) d.idx.set(i, perm[i]);
  }
  if (c.num_accepted) {
    d.nat = HostTensor(c.index_dtype, {d.N});
    for (int64_t n = 0; n < d.N; ++n)
      d.nat.set(n, lens[n] > 0 ? 1 + static_cast<int64_t>(rng() % lens[n]) : 1);
  }
  if (c.padding && d.N >= 2) {
    // row 0: negative slot; last row: slot >= P (or, with num_accepted, an out-of-range count)
    if (c.indices == 1) {
      d.idx.set(0, -1);
      d.idx.set(d.N - 1, d.P + 3);
    } else if (c.indices == 2) {
      for (int64_t t = 0; t < Tmax; ++t) d.idx.set(t, -1);
      if (c.num_accepted)
        d.nat.set(d.N - 1, lens[d.N - 1] + 1);
      else
        d.idx.set((d.N - 1) * Tmax, d.P + 3);
    }
  }
  if (varlen) {
    d.cu = HostTensor(DType::kInt32, {d.N + 1});
    int64_t acc = 0;
    d.cu.set(0, 0);
    for (int64_t n = 0; n < d.N; ++n) d.cu.set(n + 1, acc += lens[n]);
  }
  if (c.final_state_separate) {
    auto fs = shp;
    fs[0] = d.N;
    d.final_state = HostTensor(c.state_dtype, fs);
    d.final_state.fill_bytes(0x7f);
  }
  if (c.intermediate) {
    auto is = shp;
    is[0] = d.total;
    d.inter = HostTensor(c.state_dtype, is);
    d.inter.fill_bytes(0x7f);
  }
  return d;
}

DecodeParams DecodeData::params() const {
  DecodeParams p;
  set_token_fields(p, *this);
  p.state = state.view();
  p.state_indices = idx.view();
  p.num_accepted_tokens = nat.view();
  p.final_state = final_state.view();
  p.intermediate_states = inter.view();
  p.use_initial_state = c.use_initial_state;
  p.store_final_state = c.store_final_state;
  return p;
}

}  // namespace kda::test
