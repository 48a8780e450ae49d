// distributed_support.h — the context-parallel tests' ranks as threads of one process: a group
// that all-gathers through shared memory, per-rank token slices of a whole-input view, and which
// checkpoint rows and pool slots a rank writes (spec section 9, as kda.distributed.prefill's
// tests state it).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "kda/distributed.h"
#include "support.h"

namespace kda::test {

// The ranks of one group: each all_gather publishes its send buffer, waits for every rank,
// copies every rank's buffer, and waits again before the buffers may change.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), sends_(size) {}
  int size() const { return size_; }

  // copy(dst, src, bytes) copies one rank's buffer (memcpy, or a device copy that has
  // completed on return).
  template <class Copy>
  void gather(int rank, const void* send, void* recv, size_t bytes, Copy copy) {
    sends_[rank] = send;
    barrier();
    for (int r = 0; r < size_; ++r) copy(static_cast<uint8_t*>(recv) + r * bytes, sends_[r], bytes);
    barrier();
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

  int size_;
  std::vector<const void*> sends_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

// A Communicator of one ThreadGroup rank, for buffers on `device`: sync(stream) completes the
// rank's work before its buffer is published (nullptr: nothing to wait for), copy(dst, src,
// bytes, stream) copies one rank's buffer and has completed on return.
class GroupCommunicator final : public Communicator {
 public:
  using Sync = void (*)(void* stream);
  using Copy = void (*)(void* dst, const void* src, size_t bytes, void* stream);
  GroupCommunicator(ThreadGroup* group, int rank, Device device, Sync sync, Copy copy)
      : group_(group), rank_(rank), device_(device), sync_(sync), copy_(copy) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Status all_gather(const void* send, void* recv, size_t bytes, Device device,
                    void* stream) override {
    if (device != device_)
      return {StatusCode::kUnsupported, "device",
              std::string("buffers on ") + (device_ == Device::kCPU ? "the host" : "CUDA")};
    ++calls;
    if (sync_ != nullptr) sync_(stream);
    group_->gather(rank_, send, recv, bytes,
                   [&](void* dst, const void* src, size_t n) { copy_(dst, src, n, stream); });
    return Status::Ok();
  }
  int calls = 0;  // all_gather calls

 private:
  ThreadGroup* group_;
  int rank_;
  Device device_;
  Sync sync_;
  Copy copy_;
};

// Tokens [begin, begin + count) of a per-token view (token axis 1 of [B, T, ...]).
inline TensorView tokens(TensorView t, int64_t begin, int64_t count) {
  if (!t.present()) return t;
  t.data = static_cast<uint8_t*>(t.data) +
           begin * t.strides[1] * static_cast<int64_t>(dtype_size(t.dtype));
  t.shape[1] = count;
  return t;
}

// Rank params: tokens [begin, begin + count) of the whole-input call `whole` (q, k, v, g, beta,
// out); varlen: the rank's cu_seqlens from the global layout `cu_host`, kept in `*cu`.
inline PrefillParams slice_of(const PrefillParams& whole, const std::vector<int64_t>& cu_host,
                              int64_t begin, int64_t count, HostTensor* cu) {
  PrefillParams p = whole;
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.out}) *t = tokens(*t, begin, count);
  if (whole.cu_seqlens.present()) {
    const std::vector<int64_t> local = local_cu_seqlens(cu_host, begin, begin + count);
    *cu = HostTensor(DType::kInt64, {static_cast<int64_t>(local.size())});
    for (size_t i = 0; i < local.size(); ++i) cu->set(static_cast<int64_t>(i), local[i]);
    p.cu_seqlens = cu->view();
  }
  return p;
}

// The problem of a split case: make_prefill, and in pool mode with N >= 4 sequences the last one
// given a slot >= P (no pooled state, as a negative slot: start from zero, write nothing).
inline PrefillData make_split_prefill(const PrefillCase& c) {
  PrefillData d = make_prefill(c);
  if (c.pool && d.N >= 4) d.idx.set(d.N - 1, static_cast<double>(d.pool.shape[0] + 1));
  return d;
}

// Rows `rows` of a state tensor [rows, ...], their bytes copied (a contiguous tensor).
inline HostTensor rows_of(const HostTensor& t, const std::vector<int64_t>& rows) {
  std::vector<int64_t> shape = t.shape;
  shape[0] = static_cast<int64_t>(rows.size());
  HostTensor r(t.dtype, shape);
  const int64_t per_row = t.shape[0] > 0 ? t.numel() / t.shape[0] : 0;
  const size_t es = dtype_size(t.dtype);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t e = 0; e < per_row; ++e)
      std::memcpy(r.storage.data() + r.offset(static_cast<int64_t>(i) * per_row + e) * es,
                  t.storage.data() + t.offset(rows[i] * per_row + e) * es, es);
  return r;
}

// Tokens [lo, hi) of the whole input: the checkpoint rows a rank holding them writes. Row
// offsets[n] + j is the state after (j + 1) * every tokens of sequence n; it is the rank's when
// that token lies in [lo, hi) (dense: every row one sequence of T tokens).
inline std::vector<int64_t> checkpoint_rows_of(const PrefillData& d, int64_t lo, int64_t hi) {
  std::vector<int64_t> rows;
  const int64_t every = d.c.checkpoint_every;
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t first = d.c.varlen ? d.cu_host[n] : 0;  // the sequence's first token
    for (int64_t row = d.ckpt_off.get(n); row < d.ckpt_off.get(n + 1); ++row) {
      const int64_t last = first + (row - static_cast<int64_t>(d.ckpt_off.get(n)) + 1) * every - 1;
      if (lo <= last && last < hi) rows.push_back(row);
    }
  }
  return rows;
}

// The pool slots a rank holding tokens [lo, hi) writes: those of the sequences whose last token
// it holds (not a sequence without tokens), when the slot is in [0, P).
inline std::vector<int64_t> pool_slots_of(const PrefillData& d, int64_t lo, int64_t hi) {
  std::vector<int64_t> slots;
  const int64_t P = d.pool.shape[0];
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t slot = static_cast<int64_t>(d.idx.get(n));
    const int64_t first = d.c.varlen ? d.cu_host[n] : 0;
    const int64_t last = d.c.varlen ? d.cu_host[n + 1] - 1 : d.T - 1;
    if (slot >= 0 && slot < P && last >= first && lo <= last && last < hi) slots.push_back(slot);
  }
  return slots;
}

// The rows [0, rows) not in `in`.
inline std::vector<int64_t> other_rows(int64_t rows, const std::vector<int64_t>& in) {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < rows; ++r)
    if (std::find(in.begin(), in.end(), r) == in.end()) out.push_back(r);
  return out;
}

}  // namespace kda::test
