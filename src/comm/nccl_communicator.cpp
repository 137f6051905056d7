#include "fusedloss/comm_nccl.h"

#include <cuda_runtime.h>
#include "common/error.h"

namespace fusedloss {
namespace {

void check_nccl(ncclResult_t code, const char* what) {
  if (code == ncclSuccess) return;
  detail::fail(what, " failed: ", ncclGetErrorString(code), " (", ncclGetLastError(nullptr), ")");
}

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(ncclComm_t comm) : comm_(comm) {
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::CUDA; }
  void all_gather(const void* send, void* recv, size_t bytes, Stream stream) override {
    check_nccl(ncclAllGather(send, recv, bytes, ncclUint8, comm_, cudaStream_t(stream)),
               "ncclAllGather");
  }
  void all_reduce(float* data, size_t count, ReduceOp op, Stream stream) override {
    check_nccl(ncclAllReduce(data, data, count, ncclFloat32, op == ReduceOp::Max ? ncclMax : ncclSum,
                             comm_, cudaStream_t(stream)),
               "ncclAllReduce");
  }

 private:
  ncclComm_t comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm) {
  detail::require(comm != nullptr, "comm: got a null ncclComm_t, expected an initialised one");
  return std::make_unique<NcclCommunicator>(comm);
}

}  // namespace fusedloss
