// nccl_communicator.cpp — kda::Communicator over an NCCL communicator (built with the CMake
// option KDA_ENABLE_NCCL; cmake/kda_nccl.cmake).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "kda/distributed.h"

namespace kda {
namespace {

Status nccl_status(ncclResult_t r, const char* call) {
  return {StatusCode::kInternal, std::string(call) + " failed: " + ncclGetErrorString(r)};
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status all_gather(const void* send, void* recv, size_t bytes, Device device,
                    void* stream) override {
    if (device != Device::kCUDA)
      return {StatusCode::kUnsupported, "device", "CUDA buffers (NCCL), got host buffers"};
    const ncclResult_t r =
        ncclAllGather(send, recv, bytes, ncclUint8, comm_, static_cast<cudaStream_t>(stream));
    return r == ncclSuccess ? Status::Ok() : nccl_status(r, "ncclAllGather");
  }

 private:
  ncclComm_t comm_;
  int rank_, size_;
};

}  // namespace

Status make_nccl_communicator(void* nccl_comm, std::unique_ptr<Communicator>* communicator) {
  if (communicator == nullptr)
    return {StatusCode::kInvalidArgument, "communicator", "a pointer, got nullptr"};
  if (nccl_comm == nullptr)
    return {StatusCode::kInvalidArgument, "nccl_comm", "an ncclComm_t, got nullptr"};
  ncclComm_t comm = static_cast<ncclComm_t>(nccl_comm);
  int rank = 0, size = 0;
  ncclResult_t r = ncclCommUserRank(comm, &rank);
  if (r != ncclSuccess) return nccl_status(r, "ncclCommUserRank");
  r = ncclCommCount(comm, &size);
  if (r != ncclSuccess) return nccl_status(r, "ncclCommCount");
  *communicator = std::make_unique<NcclCommunicator>(comm, rank, size);
  return Status::Ok();
}

}  // namespace kda
