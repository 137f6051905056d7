// fusedloss: build an NCCL communicator over the ranks of an MPI communicator (rank 0 makes
// the unique id, MPI broadcasts it). For mpirun-launched jobs, tests and examples.
// Available when the library was built with both MPI and NCCL.
#pragma once
#include <mpi.h>
#include <nccl.h>

namespace fusedloss {

// The caller owns the result: ncclCommDestroy() it. The current CUDA device must be set.
ncclComm_t make_nccl_comm_from_mpi(MPI_Comm comm);

}  // namespace fusedloss
