#include "api/vocab_parallel.h"

#include <algorithm>
#include <cstring>
#include "common/error.h"
#include "cpu/cross_entropy_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/cross_entropy_cuda.h"
#endif

namespace fusedloss::vocab_parallel {

Scratch::Scratch(Device device, size_t bytes, Stream stream) : device_(device), stream_(stream) {
  if (bytes == 0) return;
  if (device == Device::CPU) {
    host_.resize((bytes + sizeof(RowStats) - 1) / sizeof(RowStats));
    ptr_ = host_.data();
  } else {
    FL_CUDA_BRANCH("cross_entropy_forward", ptr_ = cuda::alloc_async(bytes, stream));
  }
}

Scratch::~Scratch() {
#ifdef FUSEDLOSS_WITH_CUDA
  if (device_ == Device::CUDA && ptr_) cuda::free_async(ptr_, stream_);
#endif
}

namespace {

// The fixed-size part every rank contributes. Sizes that differ here would make the
// size-dependent collectives that follow mismatch, so they are compared before any of them.
struct Header {
  int64_t rows, vocab_local, has_error, chunk_rows;
};

// all[r * bytes, (r + 1) * bytes) on the host receives rank r's `mine`, whatever memory the
// communicator works in (device communicators go through a device buffer and a host sync).
void gather_to_host(Communicator& comm, const void* mine, void* all, size_t bytes,
                    Stream stream) {
  const Device dev = comm.device();
  if (dev == Device::CPU) {
    comm.all_gather(mine, all, bytes, stream);
    return;
  }
  const size_t world = size_t(comm.size());
  Scratch buf(dev, bytes * (world + 1), stream);
  char* staged = buf.as<char>();
  FL_CUDA_BRANCH("cross_entropy_forward",
                 cuda::copy_async(staged + bytes * world, mine, bytes, true, stream));
  comm.all_gather(staged + bytes * world, staged, bytes, stream);
  FL_CUDA_BRANCH("cross_entropy_forward",
                 cuda::copy_async(all, staged, bytes * world, false, stream);
                 cuda::synchronize(stream));
}

}  // namespace

void check_shard_position(const core::CeParams& p, const Communicator& comm, Device device) {
  const int64_t world = comm.size(), rank = comm.rank();
  detail::require(comm.device() == device, "comm: a ", to_string(comm.device()),
                  " communicator was given for ", to_string(device),
                  " logits; expected the same device");
  detail::require(p.vocab_global == world * p.vocab_local, "options.vocab_global: got ",
                  p.vocab_global, ", expected communicator size (", world, ") x V_local (",
                  p.vocab_local, ") = ", world * p.vocab_local);
  detail::require(p.vocab_start == rank * p.vocab_local, "options.vocab_start: got ",
                  p.vocab_start, ", expected rank (", rank, ") x V_local (", p.vocab_local,
                  ") = ", rank * p.vocab_local);
}

void agree(Communicator& comm, const ShardClaim& mine, Stream stream) {
  const int world = comm.size();
  const Header header{mine.rows, mine.vocab_local, mine.error.empty() ? 0 : 1, mine.chunk_rows};
  std::vector<Header> all(world);
  gather_to_host(comm, &header, all.data(), sizeof(Header), stream);

  // The shapes first: a rank whose rows or shard differ is the likeliest cause of any error
  // that follows from them. Every rank reads the same headers, so every rank builds the
  // same message.
  const Header& h0 = all[0];
  for (int r = 0; r < world; ++r) {
    const Header& h = all[r];
    detail::require(h.rows == h0.rows, "vocab-parallel rows: rank ", r, " has ", h.rows,
                    " rows, rank 0 has ", h0.rows, "; expected the same rows on every rank");
    detail::require(h.vocab_local == h0.vocab_local, "vocab-parallel shard size: rank ", r,
                    " has V_local ", h.vocab_local, ", rank 0 has ", h0.vocab_local,
                    "; expected equal shards on every rank");
  }
  const bool any_error = std::any_of(all.begin(), all.end(), [](const Header& h) {
    return h.has_error != 0;
  });
  if (!any_error) {
    // Ranks whose arguments were valid: a chunked caller's collectives follow its chunking.
    for (int r = 0; r < world; ++r)
      detail::require(all[r].chunk_rows == h0.chunk_rows, "vocab-parallel chunking: rank ", r,
                      " computes ", all[r].chunk_rows, " tokens per chunk, rank 0 ",
                      h0.chunk_rows,
                      "; expected the same workspace_bytes / chunk_rows and dtype on every rank");
    return;
  }

  // Second round, only on the error path: each rank's text, truncated to a fixed size so the
  // collective matches on every rank.
  char text[kErrorBytes] = {};
  std::memcpy(text, mine.error.data(), std::min(mine.error.size(), kErrorBytes - 1));
  std::vector<char> texts(kErrorBytes * size_t(world));
  gather_to_host(comm, text, texts.data(), kErrorBytes, stream);
  for (int r = 0; r < world; ++r) {
    if (!all[r].has_error) continue;
    const char* t = texts.data() + kErrorBytes * size_t(r);
    detail::fail("vocab-parallel: rank ", r, ": ", std::string(t, strnlen(t, kErrorBytes)));
  }
}

void forward(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
             CollectiveForm form, const CrossEntropyOutputs& out, Communicator& comm,
             [[maybe_unused]] Stream stream) {
  const int world = comm.size(), rank = comm.rank();
  const Device dev = logits.device;
  const int64_t rows = logits.rows;
  const bool gather = form == CollectiveForm::AllGather;
  // gather: [local][rank 0 .. world-1]; reduce: [local][summable] + rows floats of maxima
  const size_t stat_rows = gather ? size_t(world + 1) * rows : size_t(2) * rows;
  Scratch buf(dev, sizeof(RowStats) * stat_rows + sizeof(float) * rows, stream);
  RowStats* local = buf.as<RowStats>();
  RowStats* combined = local + rows;
  float* maxima = reinterpret_cast<float*>(local + stat_rows);

  FL_DISPATCH(dev, "cross_entropy_forward", cpu::ce_local_stats(logits, target, p, local),
              cuda::ce_local_stats(logits, target, p, local, stream));
  if (gather) {
    comm.all_gather(local, combined, sizeof(RowStats) * rows, stream);
    FL_DISPATCH(dev, "cross_entropy_forward",
                cpu::ce_merge(combined, world, local, target, p, out),
                cuda::ce_merge(combined, world, local, target, p, out, stream));
    return;
  }
  FL_DISPATCH(dev, "cross_entropy_forward",
              for (int64_t r = 0; r < rows; ++r) maxima[r] = local[r].max,
              cuda::ce_extract_max(local, rows, maxima, stream));
  comm.all_reduce(maxima, rows, ReduceOp::Max, stream);
  FL_DISPATCH(dev, "cross_entropy_forward",
              cpu::ce_prepare_sum(local, maxima, target, p, rank, combined),
              cuda::ce_prepare_sum(local, maxima, target, p, rank, combined, stream));
  comm.all_reduce(reinterpret_cast<float*>(combined), 4 * size_t(rows), ReduceOp::Sum, stream);
  FL_DISPATCH(dev, "cross_entropy_forward", cpu::ce_merge(combined, 1, local, target, p, out),
              cuda::ce_merge(combined, 1, local, target, p, out, stream));
}

}  // namespace fusedloss::vocab_parallel
