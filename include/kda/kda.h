// kda.h — public C++ API of the KDA (Kimi Delta Attention) kernel library.
//
// Two entry points compute the function defined in docs/design.md (and the project's spec):
//   kda::prefill(PrefillParams)  — chunked forward over whole prompts (dense or varlen);
//   kda::decode(DecodeParams)    — one or a few tokens per sequence against a state pool.
// Tensors cross as non-owning views (pointer, dtype, device, shape, int64 strides in elements);
// only the last dimension must be contiguous. Optional tensors are views with ndim == 0. Inputs
// may be broadcast views; a tensor the call writes whose strides put two elements at one address
// is refused (kInvalidArgument naming it).
//
// This header has no CUDA or framework dependency: a stream crosses as an opaque pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kda {

// ---------------------------------------------------------------------------------------------
// Basic types
// ---------------------------------------------------------------------------------------------

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt32 = 3, kInt64 = 4 };
enum class Device : int32_t { kCPU = 0, kCUDA = 1 };

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

inline constexpr int kMaxDims = 6;

// A non-owning strided view. `strides` count elements, not bytes. An absent optional tensor is a
// default-constructed view (ndim == 0). A view of more than kMaxDims dimensions cannot be
// represented: make_view / make_strided_view then return a view whose ndim is the requested rank
// and whose shape and strides are left zero, and every entry point rejects it naming the
// argument ("expected rank 1..6, got rank 7"). So is a view whose element count does not fit in
// int64, or whose largest element offset does not.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int32_t device_index = 0;  // CUDA ordinal; ignored for kCPU
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  bool present() const { return ndim != 0; }
  // Product of the sizes; 0 when absent or when a size is 0; -1 when the view is invalid (ndim
  // outside [0, kMaxDims], a negative size, or a product that overflows int64).
  int64_t numel() const;
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t stride(int d) const { return strides[d < 0 ? d + ndim : d]; }
};

// Builds a view of contiguous (row-major) memory of the given shape.
TensorView make_view(void* data, DType dtype, std::vector<int64_t> shape,
                     Device device = Device::kCPU, int32_t device_index = 0);
// Builds a view with explicit element strides.
TensorView make_strided_view(void* data, DType dtype, std::vector<int64_t> shape,
                             std::vector<int64_t> strides, Device device = Device::kCPU,
                             int32_t device_index = 0);

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // a shape, dtype, stride, flag or value breaks the contract
  kUnsupported = 2,      // valid per the contract, but the chosen backend cannot run it
  kCudaError = 3,        // a CUDA runtime call or launch failed
  kInternal = 4,
};

// Result of every entry point. On error, `message` names the argument, what was expected and what
// was given, e.g. "argument 'k': expected dtype bf16 (as q), got dtype fp16". Arguments are named
// as the Python API names them, which are the field names of the params structs below (options
// by their own name: 'gate', 'backend', not 'math.gate' / 'exec.backend').
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  // An error about one argument: message "argument '<argument>': <what>".
  Status(StatusCode code, const std::string& argument, const std::string& what)
      : code_(code), argument_(argument), message_("argument '" + argument + "': " + what) {}
  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The argument the error is about ("" when none); the message then starts with
  // "argument '<argument>': " and what() is the rest, so that bindings can name the argument in
  // their caller's vocabulary.
  const std::string& argument() const { return argument_; }
  std::string what() const {
    return argument_.empty() ? message_ : message_.substr(argument_.size() + 13);
  }
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string argument_;
  std::string message_;
};

// ---------------------------------------------------------------------------------------------
// Options shared by both entry points
// ---------------------------------------------------------------------------------------------

// Every enum has its codes 0 .. kNum* - 1 and a name per value (the *_name() functions below),
// which is how the Python API and the CLI spell the value.

// How the gate input g becomes the per-channel log decay a_t (natural log, a_t <= 0).
enum class GateForm : int32_t {
  // "precomputed": a_t = g_t (log-space decay given by the caller)
  kPrecomputed = 0,
  // "softplus": a_t = -exp(A_log[hv]) * softplus(g_t + dt_bias[hv])  (Kimi-Linear)
  kSoftplus = 1,
  // "lower_bound": a_t = lower_bound * sigmoid(exp(A_log[hv]) * (g_t + dt_bias[hv]))  (FlashKDA)
  kLowerBound = 2,
};
inline constexpr int kNumGateForms = 3;

// Storage order of every state tensor of a call (initial/final state, pool, checkpoints).
enum class StateLayout : int32_t {
  kVFirst = 0,  // "v_first": [.., HV, V, K] (default; FlashKDA/MATE)
  kKFirst = 1,  // "k_first": [.., HV, K, V] (FLA)
};
inline constexpr int kNumStateLayouts = 2;

enum class Backend : int32_t {
  kAuto = 0,          // "auto": CUDA when the tensors live on a CUDA device, else "cpu"
  kCpu = 1,           // "cpu": fast CPU backend (fp32, chunked prefill, multi-threaded)
  kCuda = 2,          // "cuda": CUDA backend (sm_90a)
  kCpuReference = 3,  // "reference": the fp64 token-by-token CPU reference (the spec in code)
};
inline constexpr int kNumBackends = 4;

// Names of the enum values ("unknown" for a code outside the enum).
const char* gate_name(GateForm gate);
const char* state_layout_name(StateLayout layout);
const char* backend_name(Backend backend);

// Prefill chunk size of every backend: checkpoint_every must be a multiple of it.
inline constexpr int kChunkSize = 64;

// The math of a call: preprocessing of q, k, the gate and beta (spec sections 2 and 3), shared by
// prefill and decode. Field names are the Python API's argument names.
struct MathOptions {
  bool use_qk_l2norm = true;               // q, k <- x / sqrt(sum(x^2) + 1e-6)
  std::optional<double> scale;             // q scale; default K^-0.5
  GateForm gate = GateForm::kPrecomputed;  // how g becomes the log decay (see GateForm)
  float lower_bound = -5.0f;               // GateForm::kLowerBound only; in [-5, 0)
  bool beta_logits = false;                // b = sigmoid(beta); false: b = beta (already activated)
  bool allow_neg_eigval = false;           // with beta_logits: b = 2 * sigmoid(beta)
};

// Allocates `bytes` of workspace on the tensors' device for one call (see ExecOptions). The memory
// must stay valid for the work the call enqueues on its stream (a stream-ordered allocator, such as
// a framework's caching allocator, satisfies this when the stream is the allocation's stream).
// Returns nullptr on failure.
using WorkspaceAllocator = void* (*)(size_t bytes, void* context);

// Where and how a call runs.
struct ExecOptions {
  Backend backend = Backend::kAuto;
  void* stream = nullptr;      // cudaStream_t for the CUDA backend (nullptr = legacy default)
  void* workspace = nullptr;   // caller memory on the tensors' device, >= *_workspace_size()
  size_t workspace_bytes = 0;  // CPU backends allocate their own when this is too small
  // Called once, after validation, when the chosen backend needs more workspace than
  // workspace_bytes (then workspace/workspace_bytes are ignored); nullptr = not used.
  WorkspaceAllocator allocate_workspace = nullptr;
  void* allocate_context = nullptr;  // passed to allocate_workspace
  int num_threads = 0;  // CPU backends: 0 = all hardware threads (or $KDA_NUM_THREADS);
                        // else 1..kMaxNumThreads (other values: kInvalidArgument)
};

// Largest ExecOptions::num_threads. A CPU call runs on at most this many threads; when the
// system cannot create the threads a call asks for, it returns kInternal naming the failure and
// writes nothing.
inline constexpr int kMaxNumThreads = 1024;

// ---------------------------------------------------------------------------------------------
// Prefill (spec section 4)
// ---------------------------------------------------------------------------------------------
//
// Dense mode: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
//             out [B, T, HV, V]; N = B.
// Varlen mode (cu_seqlens present): the same with B = 1, or without the leading dimension;
//             N = len(cu_seqlens) - 1; sequence n spans tokens [cu_seqlens[n], cu_seqlens[n+1]).
// State tensors are [rows, HV, V, K] (V-first) or [rows, HV, K, V] (K-first), fp32/bf16/fp16.
struct PrefillParams {
  TensorView q;           // [B, T, H, K]   bf16/fp16 (fp32 on CPU)
  TensorView k;           // [B, T, H, K]   same dtype as q
  TensorView v;           // [B, T, HV, V]  same dtype as q; HV % H == 0
  TensorView g;           // [B, T, HV, K]  q's dtype or fp32; gate input (see GateForm)
  TensorView beta;        // [B, T, HV]     q's dtype or fp32 (see MathOptions::beta_logits)
  TensorView A_log;       // [HV] fp32, optional (absent: exp(A_log) = 1)
  TensorView dt_bias;     // [HV, K] fp32, optional (absent: 0)
  TensorView cu_seqlens;  // [N + 1] int32/int64, optional: varlen mode
  TensorView out;         // [B, T, HV, V]  same dtype as q; written for every token

  // Initial/final state, one row per sequence. Both optional; absent initial state means zero.
  TensorView initial_state;  // [N, HV, V, K]
  TensorView final_state;    // [N, HV, V, K]

  // State pool (serving engines): read the initial state of sequence n from
  // state_pool[state_indices[n]] and write its final state back to the same slot, in place.
  // Excludes initial_state/final_state. A slot outside [0, P) means "no pooled state": the
  // sequence starts from zero and its final state is not written (no out-of-bounds access).
  TensorView state_pool;     // [P, HV, V, K]
  TensorView state_indices;  // [N] int32/int64

  // Checkpoints for prefix caching: the state after every `checkpoint_every` tokens of each
  // sequence (j-th checkpoint of sequence n = state after (j+1)*checkpoint_every tokens), written
  // to row checkpoint_offsets[n] + j while that row is < checkpoint_offsets[n+1] and < rows.
  // checkpoint_offsets can be built with kda::checkpoint_offsets().
  int64_t checkpoint_every = 0;   // 0 = off; else a positive multiple of kChunkSize
  TensorView checkpoints;         // [num_checkpoints, HV, V, K]
  TensorView checkpoint_offsets;  // [N + 1] int32/int64

  // Host-side check of the pool slots: a slot >= P, or two sequences with the same slot in
  // [0, P), is kInvalidArgument naming both sequences (negative slots stay "no pooled state").
  // Without it such sequences' results are unspecified; every other sequence and slot is exact.
  // It reads state_indices on the host: for CUDA tensors it copies them and synchronizes the
  // stream.
  bool check_indices = false;

  StateLayout state_layout = StateLayout::kVFirst;
  MathOptions math;
  ExecOptions exec;
};

// ---------------------------------------------------------------------------------------------
// Prefill backward (spec section 8)
// ---------------------------------------------------------------------------------------------
//
// Gradients of a prefill. `forward` holds the forward call's inputs exactly as given to
// prefill(): q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, state_layout, gate.
// The forward's outputs are not needed: forward.out and forward.final_state are neither read nor
// written (they may be absent), and forward.exec is ignored (this struct's `exec` is used).
// Pool mode (forward.state_pool / state_indices) and checkpoints are refused.
//
// Upstream gradients (optional; absent = zero):
//   d_out          [B, T, HV, V]   q's dtype or fp32
//   d_final_state  [N, HV, V, K] (V-first) or [N, HV, K, V] (K-first), fp32/bf16/fp16
// Gradients (each optional; absent = not computed; every present one is overwritten):
//   dq, dk           [B, T, H, K]   q's dtype (summed over the HV / H value heads of each group)
//   dv               [B, T, HV, V]  q's dtype
//   dg               [B, T, HV, K]  g's dtype (through the gate form that ran)
//   dbeta            [B, T, HV]     beta's dtype (through the beta form that ran)
//   dA_log           [HV]           fp32   zero for the precomputed gate; an absent A_log or
//   ddt_bias         [HV, K]        fp32   dt_bias gets the gradient at 0
//   d_initial_state  [N, HV, ...]   layout as d_final_state, initial_state's dtype; also allowed
//                                   without initial_state (any state dtype): the gradient at
//                                   the zero initial state
// Varlen tensors may drop the leading 1, as in the forward. dA_log and ddt_bias are sums over
// every token of every sequence in a fixed order, so results are bitwise deterministic.
//
// Backends: kCpuReference runs the analytic fp64 backward (reference_backward.cpp); kCpu runs
// the same reference for now; kCuda (and kAuto on CUDA tensors) runs the chunked CUDA backward
// (sm_90a; bf16/fp16 q/k/v, K = V = 128) on exec.stream: no allocation (exec.workspace of at
// least prefill_backward_workspace_size() bytes, or exec.allocate_workspace), no
// synchronization.
struct PrefillBackwardParams {
  PrefillParams forward;  // the forward's inputs (see above)

  TensorView d_out;          // [B, T, HV, V], optional
  TensorView d_final_state;  // [N, HV, V, K] / [N, HV, K, V], optional

  TensorView dq, dk;           // [B, T, H, K]
  TensorView dv;               // [B, T, HV, V]
  TensorView dg;               // [B, T, HV, K]
  TensorView dbeta;            // [B, T, HV]
  TensorView dA_log;           // [HV] fp32
  TensorView ddt_bias;         // [HV, K] fp32
  TensorView d_initial_state;  // [N, HV, V, K] / [N, HV, K, V]

  ExecOptions exec;
};

// Computes the gradients; on any error nothing is written. validate() checks alone.
Status prefill_backward(const PrefillBackwardParams& params);
Status validate(const PrefillBackwardParams& params);
// Bytes of device workspace prefill_backward(params) needs (0 for CPU tensors): ~514 KB per
// (64-token chunk, value head) plus ~192 KB per SM (4.3 GB for 1 x 8192 tokens, 64 heads).
Status prefill_backward_workspace_size(const PrefillBackwardParams& params, size_t* bytes);

// ---------------------------------------------------------------------------------------------
// Decode (spec section 5)
// ---------------------------------------------------------------------------------------------
//
// Dense: q, k [B, T, H, K] ... out [B, T, HV, V]; N = B, every sequence has T tokens.
// Varlen: cu_seqlens [N + 1], tensors [1, total, ...] or [total, ...]; T_n tokens each.
// The state pool is [P, HV, V, K] or [P, HV, K, V], fp32 or bf16 (bf16 is widened for the
// arithmetic and rounded back to bf16 after every token).
//
// Read slot of sequence n: state_indices[n, num_accepted_tokens[n] - 1] in speculative mode
// (num_accepted_tokens present, indices [N, Tmax]), else state_indices[n] / state_indices[n, 0],
// or n without indices. A negative read slot, a slot >= P, or num_accepted_tokens outside
// [1, T_n] makes the row a padding row: zero output, no state read or written.
// check_indices = true reports the last two as kInvalidArgument instead, and so are two live rows
// that share a slot which one of them writes (naming both rows; rows may share a slot they only
// read). Without it such rows' results are unspecified; every other row and slot is exact. It
// reads the indices on the host, so for CUDA tensors it copies them and synchronizes the stream.
//
// Writes (when store_final_state):
//   * intermediate_states present: the state after every token goes to its token row;
//   * else indices [N, Tmax]: the state after token t goes to state_indices[n, t] when that slot
//     is valid (in [0, P)), in place;
//   * else final_state present: the state after the last token goes to final_state[n];
//   * else in place: to the read slot (state_indices[n], or slot n without indices).
// Slots that no row reads or writes are never touched.
struct DecodeParams {
  TensorView q;           // [B, T, H, K]      bf16/fp16 (fp32 on CPU)
  TensorView k;           // [B, T, H, K]
  TensorView v;           // [B, T, HV, V]
  TensorView g;           // [B, T, HV, K]     q's dtype or fp32
  TensorView beta;        // [B, T, HV] or [B, T, HV, V] (one beta per value row)
  TensorView A_log;       // [HV] fp32, optional
  TensorView dt_bias;     // [HV, K] fp32 or bf16, optional
  TensorView cu_seqlens;  // [N + 1] int32/int64, optional: varlen mode
  TensorView out;         // [B, T, HV, V]     q's dtype or fp32

  TensorView state;                // [P, HV, V, K] or [P, HV, K, V], fp32/bf16: the pool
  TensorView state_indices;        // [N] or [N, Tmax] int32/int64, optional
  TensorView num_accepted_tokens;  // [N] int32/int64, optional: speculative mode (needs [N, Tmax])
  TensorView final_state;          // [N, HV, ...] optional separate output (same dtype as state)
  TensorView intermediate_states;  // [total_tokens, HV, ...] optional per-token output

  bool use_initial_state = true;  // false: every row starts from zero (the read slot is not read)
  bool store_final_state = true;  // false: output only, no state written anywhere
  bool check_indices = false;     // host-side check of index values (see above)

  StateLayout state_layout = StateLayout::kVFirst;
  MathOptions math;
  ExecOptions exec;
};

// ---------------------------------------------------------------------------------------------
// Entry points. None throws; none calls exit(). On any error nothing is written.
// ---------------------------------------------------------------------------------------------

Status prefill(const PrefillParams& params);
Status decode(const DecodeParams& params);

// Validation alone (shared by every backend; run by prefill()/decode() first).
Status validate(const PrefillParams& params);
Status validate(const DecodeParams& params);

// Bytes of workspace the call needs on the backend it would run on (0 when none).
Status prefill_workspace_size(const PrefillParams& params, size_t* bytes);
Status decode_workspace_size(const DecodeParams& params, size_t* bytes);

// Host helper: checkpoint offsets [N + 1] for host cu_seqlens (or N sequences of length T).
std::vector<int64_t> checkpoint_offsets(const std::vector<int64_t>& cu_seqlens, int64_t every);

// ---------------------------------------------------------------------------------------------
// Discovery
// ---------------------------------------------------------------------------------------------

struct DeviceInfo {
  int index = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  size_t global_memory_bytes = 0;
  bool supported = false;  // the CUDA kernels of this build run on it (sm_90)
};

bool cuda_compiled();                    // this build contains the CUDA backend
std::vector<DeviceInfo> cuda_devices();  // empty without a driver or devices
Backend resolve_backend(Backend requested, Device tensors_device);
const char* version();

}  // namespace kda
