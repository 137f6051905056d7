// fusedloss: a Communicator over an MPI communicator, for host (CPU) buffers.
// Available when the library was built with MPI (FUSEDLOSS_WITH_MPI).
#pragma once
#include <mpi.h>
#include <memory>
#include "fusedloss/communicator.h"

namespace fusedloss {

// The caller keeps `comm` alive and initialised for the communicator's lifetime.
// MPI errors are returned (MPI_ERRORS_RETURN is set on `comm`) and thrown as fusedloss::Error.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

}  // namespace fusedloss
