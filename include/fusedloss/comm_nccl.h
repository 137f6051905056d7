// fusedloss: a Communicator over a trainer-owned ncclComm_t, for device (CUDA) buffers.
// Collectives are enqueued on the stream passed to each call. Available when the library
// was built with NCCL (FUSEDLOSS_HAS_NCCL in fusedloss/config.h).
#pragma once
#include <nccl.h>
#include <memory>
#include "fusedloss/communicator.h"

namespace fusedloss {

// Wraps `comm` without owning it.
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm);

}  // namespace fusedloss
