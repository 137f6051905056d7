#include "fusedloss/comm_mpi.h"

#include <string>
#include "api/check.h"

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
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
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
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  detail::require(comm != MPI_COMM_NULL, "comm: got MPI_COMM_NULL, expected a communicator");
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace fusedloss
