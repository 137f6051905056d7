#include "fusedloss/comm_mpi.h"

#include <string>
#include "common/error.h"

namespace fusedloss {
namespace {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  detail::fail(what, " failed: ", std::string(text, len));
}

class MpiCommunicator final : public Communicator {
 public:
  // A private duplicate: our collectives never match the caller's messages, and the error
  // handler that turns MPI failures into fusedloss::Error is set on our copy, not theirs.
  explicit MpiCommunicator(MPI_Comm comm) {
    check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);  // after MPI_Finalize there is nothing to free
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::CPU; }
  void all_gather(const void* send, void* recv, size_t bytes, Stream) override {
    detail::require(bytes <= size_t(INT32_MAX), "all_gather bytes_per_rank: got ", bytes,
                    ", expected <= ", INT32_MAX, " (MPI int count)");
    check_mpi(MPI_Allgather(send, int(bytes), MPI_BYTE, recv, int(bytes), MPI_BYTE, comm_),
              "MPI_Allgather");
  }
  void all_reduce(float* data, size_t count, ReduceOp op, Stream) override {
    detail::require(count <= size_t(INT32_MAX), "all_reduce count: got ", count, ", expected <= ",
                    INT32_MAX);
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, data, int(count), MPI_FLOAT,
                            op == ReduceOp::Max ? MPI_MAX : MPI_SUM, comm_),
              "MPI_Allreduce");
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  detail::require(comm != MPI_COMM_NULL, "comm: got MPI_COMM_NULL, expected a communicator");
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace fusedloss
