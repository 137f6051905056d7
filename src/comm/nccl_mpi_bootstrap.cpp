#include "fusedloss/nccl_bootstrap.h"

#include "api/check.h"

namespace fusedloss {

ncclComm_t make_nccl_comm_from_mpi(MPI_Comm comm) {
  int rank = 0, size = 0;
  detail::require(MPI_Comm_rank(comm, &rank) == MPI_SUCCESS, "comm: MPI_Comm_rank failed");
  detail::require(MPI_Comm_size(comm, &size) == MPI_SUCCESS, "comm: MPI_Comm_size failed");
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    detail::require(r == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(r));
  }
  detail::require(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm) == MPI_SUCCESS,
                  "MPI_Bcast of the NCCL unique id failed");
  ncclComm_t nccl = nullptr;
  ncclResult_t r = ncclCommInitRank(&nccl, size, id, rank);
  detail::require(r == ncclSuccess, "ncclCommInitRank(rank ", rank, " of ", size,
                  ") failed: ", ncclGetErrorString(r));
  return nccl;
}

}  // namespace fusedloss
