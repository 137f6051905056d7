// fusedloss: a Communicator over an MPI communicator, for host (CPU) buffers.
// Available when the library was built with MPI (FUSEDLOSS_HAS_MPI in fusedloss/config.h).
#pragma once
#include <mpi.h>
#include <memory>
#include "fusedloss/communicator.h"

namespace fusedloss {

// Collective over `comm` (every rank calls it): the communicator works on a private duplicate
// of `comm`, freed when it is destroyed (destroy it before MPI_Finalize). MPI errors on that
// duplicate are returned, not fatal, and thrown as fusedloss::Error.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

}  // namespace fusedloss
