// fusedloss: the communication hook between the local passes.
//
// A Communicator spans the ranks that share one vocabulary (the tensor-parallel group).
// Buffers live where device() says (host memory for MPI, device memory for NCCL).
// A null Communicator, or one of size 1, means TP=1: nothing is communicated.
#pragma once
#include <cstddef>
#include <cstdint>
#include "fusedloss/types.h"

namespace fusedloss {

enum class ReduceOp { Max, Sum };

// Collectives only: the library keeps no state in a Communicator, so one may be shared by
// any number of calls, ops and threads that the caller already orders.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  // recv[r * bytes_per_rank, (r + 1) * bytes_per_rank) receives rank r's send buffer.
  // Moves bytes verbatim, so float rows and integer headers travel alike.
  virtual void all_gather(const void* send, void* recv, size_t bytes_per_rank, Stream stream) = 0;
  // In-place element-wise reduction of `count` floats over all ranks.
  virtual void all_reduce(float* data, size_t count, ReduceOp op, Stream stream) = 0;

};

}  // namespace fusedloss
