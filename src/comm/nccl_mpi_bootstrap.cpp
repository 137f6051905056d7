#include "fusedloss/nccl_bootstrap.h"

#include "common/error.h"

namespace fusedloss {

ncclComm_t make_nccl_comm_from_mpi(MPI_Comm comm) {
  int rank = 0, size = 0;
  detail::require(MPI_Comm_rank(comm, &rank) == MPI_SUCCESS, "comm: MPI_Comm_rank failed");
  detail::require(MPI_Comm_size(comm, &size) == MPI_SUCCESS, "comm: MPI_Comm_size failed");
  // Rank 0's result travels with the id, so a failure there raises on every rank instead of
  // leaving the others waiting in the broadcast.
  struct {
    ncclResult_t status;
    ncclUniqueId id;
  } root{ncclSuccess, {}};
  if (rank == 0) root.status = ncclGetUniqueId(&root.id);
  detail::require(MPI_Bcast(&root, sizeof(root), MPI_BYTE, 0, comm) == MPI_SUCCESS,
                  "MPI_Bcast of the NCCL unique id failed");
  detail::require(root.status == ncclSuccess, "ncclGetUniqueId on rank 0 failed: ",
                  ncclGetErrorString(root.status));
  const ncclUniqueId& id = root.id;
  ncclComm_t nccl = nullptr;
  ncclResult_t r = ncclCommInitRank(&nccl, size, id, rank);
  detail::require(r == ncclSuccess, "ncclCommInitRank(rank ", rank, " of ", size,
                  ") failed: ", ncclGetErrorString(r));
  return nccl;
}

}  // namespace fusedloss
