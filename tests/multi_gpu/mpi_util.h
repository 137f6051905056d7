// mpirun test helpers: this rank and the world, and an error every rank must raise.
#pragma once
#include <mpi.h>

#include <string>
#include "common/test_util.h"

namespace fusedloss::test {

inline int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
inline int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

// Every rank throws an error holding `fragment`; none hangs.
template <class F>
void expect_error_everywhere(F&& f, const char* fragment) {
  int ok = 0;
  try {
    f();
  } catch (const Error& e) {
    ok = std::string(e.what()).find(fragment) != std::string::npos;
    if (!ok) ADD_FAILURE() << "message '" << e.what() << "' lacks '" << fragment << "'";
  }
  EXPECT_EQ(ok, 1) << "rank " << world_rank() << " did not raise";
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, world_size()) << "not every rank raised";
}

}  // namespace fusedloss::test
