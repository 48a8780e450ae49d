// distributed.h — context-parallel prefill (spec section 9): the tokens of one prefill split
// across the ranks of a communicator, each rank holding a contiguous slice.
//
// The state map over a token range is affine, S_end = M S_start + S_local. Each rank computes
// its pieces' (M, S_local) with two kda::prefill passes, the ranks all-gather them, every rank
// scans them in rank order (fp64) to get its pieces' true start states and the final states,
// and a third pass gives the outputs (and the checkpoints in the rank's slice). Like kda.h, this
// header has no CUDA, NCCL or framework dependency.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kda/kda.h"

namespace kda {

// The one collective the context-parallel prefill needs, implemented over the caller's
// communication library: make_nccl_communicator() for NCCL, or the caller's own.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // in [0, size())
  virtual int size() const = 0;
  // Every rank's `bytes` bytes at `send` land at `recv + r * bytes` for rank r, on every rank.
  // The buffers are on `device`: host memory for kCPU (the gather has completed on return), or
  // device memory for kCUDA (the gather is ordered on `stream`, a cudaStream_t).
  virtual Status all_gather(const void* send, void* recv, size_t bytes, Device device,
                            void* stream) = 0;
};

// The context-parallel prefill. `local` is this rank's kda::prefill call over its own slice:
//   q, k, v, g, beta, out: the slice's tokens, dense [B, T_r, ...] (every batch row one sequence,
//     split at the same tokens on every rank) or varlen [1, T_r, ...] / [T_r, ...];
//     T_r may differ between ranks and may be 0; the slices in rank order form the whole input.
//   cu_seqlens (varlen): [N + 1], this rank's piece of each of the N global sequences
//     (local_cu_seqlens() builds it from the global layout); N is the same on every rank.
//   initial_state (optional): the global [N, HV, ...], the same on every rank.
//   final_state (optional): the global [N, HV, ...], written with every row on every rank: the
//     fp64 composition of all ranks' maps, rounded to its dtype (equal to the one-process
//     prefill within the accuracy bar).
//   state_pool, state_indices (pool mode, instead of initial_state / final_state): the same
//     indices and pool contents on every rank. Sequence n starts from
//     state_pool[state_indices[n]], or from zero when that slot is outside [0, P) (kda::prefill's
//     rule). Only the rank holding a sequence's last token writes its final state (the
//     composition above, rounded to the pool's dtype) to its slot, when the slot is in [0, P);
//     every other rank leaves its pool untouched, bit for bit, and so does every rank for a
//     sequence without tokens. check_indices checks the slots on every rank before any gather
//     (on CUDA it copies state_indices to the host and synchronizes the stream, as in
//     kda::prefill).
//   checkpoint_every, checkpoints, checkpoint_offsets: the one-process call's GLOBAL layout,
//     the same on every rank: checkpoints [num_checkpoints, HV, ...] and checkpoint_offsets
//     [N + 1] (kda::checkpoint_offsets() of the global cu_seqlens). Checkpoint j of sequence n,
//     the state after (j + 1) * checkpoint_every of its tokens, goes to row
//     checkpoint_offsets[n] + j (while below checkpoint_offsets[n + 1]) on the rank that holds
//     that token; the rows other ranks hold are left untouched (gather them with the caller's
//     collective where every rank needs all of them). A piece that starts off a checkpoint
//     boundary runs as two parts, its tokens up to the boundary and the rest, so that the rest's
//     checkpoints are the prefill's own (in dense mode one prefill call per batch row).
//   state_layout, math, exec: as for kda::prefill; exec.stream orders everything on CUDA, the
//     gathers included.
// The collectives: one all_gather of the [M | S_local] records; with a pool or checkpoints, one
// before it of the ranks' piece lengths (N int64 per rank), which places each piece in its
// sequence on the device, so no rank reads the layout on the host.
//
// Workspace (exec.workspace, on the tensors' device): at least
// distributed_prefill_workspace_size() bytes, which include the prefill passes' own workspace;
// when it is smaller, exec.allocate_workspace (if set) is called once for it, else the call
// fails (kInvalidArgument naming 'workspace'). So a CUDA call allocates nothing; CPU prefill
// backends keep their own scratch memory as kda::prefill does.
//
// Every rank validates the same things before its first gather (kda::prefill's rules on its
// slice); an argument that is wrong on some ranks only returns there and leaves the others
// waiting in the collective. Nothing is written when validation fails. On CUDA nothing
// synchronizes the host (but check_indices).
Status distributed_prefill(const PrefillParams& local, Communicator& communicator);

// Bytes of workspace distributed_prefill(local, communicator of `world_size` ranks) needs.
Status distributed_prefill_workspace_size(const PrefillParams& local, int world_size,
                                          size_t* bytes);

// Host helper: this rank's cu_seqlens [N + 1] for tokens [begin, end) of a global varlen layout
// `cu_seqlens` [N + 1]: piece n is sequence n's part of the range (empty when it has none).
std::vector<int64_t> local_cu_seqlens(const std::vector<int64_t>& cu_seqlens, int64_t begin,
                                      int64_t end);

// A Communicator over an NCCL communicator (`nccl_comm` is an ncclComm_t, not owned; it must
// outlive the Communicator), gathering CUDA buffers with ncclAllGather. kUnsupported when this
// build has no NCCL (CMake option KDA_ENABLE_NCCL) or for host buffers.
Status make_nccl_communicator(void* nccl_comm, std::unique_ptr<Communicator>* communicator);

}  // namespace kda
