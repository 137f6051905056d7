// Public cross-entropy entry points: validate, resolve, dispatch to a backend, run the hook.
#include "fusedloss/cross_entropy.h"

#include <cmath>
#include <string>
#include <vector>
#include "api/check.h"
#include "cpu/cross_entropy_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/cross_entropy_cuda.h"
#endif

namespace fusedloss {
namespace {

using detail::fail;
using detail::require;

// Scratch memory on the logits' device, released at scope exit (stream-ordered on CUDA).
class Scratch {
 public:
  Scratch(Device device, size_t bytes, Stream stream) : device_(device), stream_(stream) {
    if (bytes == 0) return;
    if (device == Device::CPU) {
      host_.resize((bytes + 15) / 16);
      ptr_ = host_.data();
    } else {
#ifdef FUSEDLOSS_WITH_CUDA
      ptr_ = cuda::alloc_async(bytes, stream);
#endif
    }
  }
  ~Scratch() {
#ifdef FUSEDLOSS_WITH_CUDA
    if (device_ == Device::CUDA && ptr_) cuda::free_async(ptr_, stream_);
#endif
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* as(size_t offset_elems = 0) const {
    return static_cast<T*>(ptr_) + offset_elems;
  }

 private:
  Device device_;
  Stream stream_;
  std::vector<RowStats> host_;
  void* ptr_ = nullptr;
};

void check_forward_args(const MatrixView& logits, const IndexView& target,
                        const CrossEntropyOutputs& out, const core::CeParams& p) {
  detail::check_matrix(logits, "logits");
  detail::check_index(target, "target", logits.rows, logits.device);
  const int64_t nloss = p.reduction == Reduction::None ? logits.rows : 1;
  require(out.loss != nullptr || nloss == 0, "out.loss: got null, expected a float buffer of ",
          nloss, " elements");
  require(out.lse != nullptr || logits.rows == 0,
          "out.lse: got null, expected a float buffer of ", logits.rows, " elements");
}

// CPU targets are checked before anything is written; CUDA kernels check them in flight.
void check_targets_on_host(const IndexView& target, const core::CeParams& p) {
  if (target.device != Device::CPU) return;
  int64_t value = 0;
  int64_t row = cpu::first_bad_target(target, p, &value);
  require(row < 0, "target[", row, "]: got ", value, ", expected in [0, ", p.vocab_global,
          ") or ignore_index (", p.ignore_index, ")");
}

// ---- vocab-parallel shard agreement ----
// Every rank contributes a fixed-size header before any size-dependent collective, so a
// disagreement (even in the row count) or a rank whose own arguments were rejected is seen by
// all ranks, and each throws instead of leaving the others waiting in a collective.
struct ShardHeader {
  int64_t rows, vocab_local, vocab_start, vocab_global, bad_row, bad_value, local_error;
};

void exchange_and_check_headers(Communicator& comm, const ShardHeader& mine,
                                const std::string& my_error, Device device, Stream stream) {
  const int world = comm.size();
  std::vector<ShardHeader> all(world);
  if (device == Device::CPU) {
    comm.all_gather(&mine, all.data(), sizeof(ShardHeader), stream);
  } else {
#ifdef FUSEDLOSS_WITH_CUDA
    Scratch buf(device, sizeof(ShardHeader) * (world + 1), stream);
    auto* dev = buf.as<ShardHeader>();
    cuda::copy_async(dev + world, &mine, sizeof(ShardHeader), true, stream);
    comm.all_gather(dev + world, dev, sizeof(ShardHeader), stream);
    cuda::copy_async(all.data(), dev, sizeof(ShardHeader) * world, false, stream);
    cuda::synchronize(stream);
#endif
  }
  const ShardHeader& h0 = all[0];
  for (int r = 0; r < world; ++r) {
    const ShardHeader& h = all[r];
    require(h.rows == h0.rows, "vocab-parallel rows: rank ", r, " has ", h.rows,
            " rows, rank 0 has ", h0.rows, "; expected the same rows on every rank");
    require(h.vocab_local == h0.vocab_local, "vocab-parallel shard size: rank ", r,
            " has V_local ", h.vocab_local, ", rank 0 has ", h0.vocab_local,
            "; expected equal shards on every rank");
  }
  if (!my_error.empty()) throw Error(my_error);
  for (int r = 0; r < world; ++r) {
    const ShardHeader& h = all[r];
    require(!h.local_error, "vocab-parallel: rank ", r,
            " rejected its arguments (its own error says why)");
    require(h.vocab_global == int64_t(world) * h.vocab_local, "options.vocab_global: rank ", r,
            " has ", h.vocab_global, ", expected communicator size (", world, ") x V_local (",
            h.vocab_local, ") = ", int64_t(world) * h.vocab_local);
    require(h.vocab_start == int64_t(r) * h.vocab_local, "options.vocab_start: rank ", r,
            " has ", h.vocab_start, ", expected rank x V_local = ", int64_t(r) * h.vocab_local);
    require(h.bad_row < 0, "target[", h.bad_row, "] on rank ", r, ": got ", h.bad_value,
            ", expected in [0, ", h.vocab_global, ") or ignore_index");
  }
}

}  // namespace

void validate_cross_entropy_options(const CrossEntropyOptions& options, int64_t rows,
                                    int64_t vocab_local) {
  core::resolve_params(options, rows, vocab_local);
}

void cross_entropy_local_stats(const MatrixView& logits, const IndexView& target,
                               const CrossEntropyOptions& options, RowStats* stats,
                               [[maybe_unused]] Stream stream) {
  detail::check_matrix(logits, "logits");
  core::CeParams p = core::resolve_params(options, logits.rows, logits.cols);
  detail::check_index(target, "target", logits.rows, logits.device);
  require(stats != nullptr || logits.rows == 0, "stats: got null, expected ", logits.rows,
          " RowStats");
  check_targets_on_host(target, p);
  FL_DISPATCH(logits.device, "cross_entropy_local_stats",
              cpu::ce_local_stats(logits, target, p, stats),
              cuda::ce_local_stats(logits, target, p, stats, stream));
}

void cross_entropy_prepare_sum(const RowStats* local, const float* global_max,
                               const IndexView& target, const CrossEntropyOptions& options,
                               int64_t vocab_local, int rank, RowStats* summable, Device device,
                               [[maybe_unused]] Stream stream) {
  core::CeParams p = core::resolve_params(options, target.size, vocab_local);
  detail::check_index(target, "target", target.size, device);
  require(rank >= 0, "rank: got ", rank, ", expected >= 0");
  require((local && global_max && summable) || target.size == 0,
          "local/global_max/summable: got a null pointer, expected buffers of ", target.size,
          " rows");
  FL_DISPATCH(device, "cross_entropy_prepare_sum",
              cpu::ce_prepare_sum(local, global_max, target, p, rank, summable),
              cuda::ce_prepare_sum(local, global_max, target, p, rank, summable, stream));
}

void cross_entropy_merge(const RowStats* combined, int parts, const RowStats* local,
                         const IndexView& target, const CrossEntropyOptions& options,
                         int64_t vocab_local, const CrossEntropyOutputs& out,
                         [[maybe_unused]] Stream stream) {
  core::CeParams p = core::resolve_params(options, target.size, vocab_local);
  require(parts >= 1, "parts: got ", parts, ", expected >= 1");
  require(combined != nullptr || target.size == 0, "combined: got null, expected ", parts,
          " x ", target.size, " RowStats");
  require(!p.partition_scope || local != nullptr || target.size == 0,
          "local: got null, expected this rank's RowStats (SmoothingScope::Partition)");
  require(out.loss != nullptr || (p.reduction == Reduction::None && target.size == 0),
          "out.loss: got null, expected a float buffer");
  require(out.lse != nullptr || target.size == 0, "out.lse: got null, expected ", target.size,
          " floats");
  FL_DISPATCH(target.device, "cross_entropy_merge",
              cpu::ce_merge(combined, parts, local, target, p, out),
              cuda::ce_merge(combined, parts, local, target, p, out, stream));
}

void cross_entropy_forward(const MatrixView& logits, const IndexView& target,
                           const CrossEntropyOptions& options, const CrossEntropyOutputs& out,
                           Communicator* comm, Stream stream) {
  const int world = comm ? comm->size() : 1;
  const Device dev = logits.device;
  const int64_t rows = logits.rows;

  if (world == 1) {
    detail::check_matrix(logits, "logits");  // named as such before the options see its shape
    core::CeParams p = core::resolve_params(options, logits.rows, logits.cols);
    check_forward_args(logits, target, out, p);
    require(p.vocab_start == 0 && p.vocab_global == logits.cols, "options.vocab_global/start: got ",
            p.vocab_global, "/", p.vocab_start, " without a communicator of size > 1, expected ",
            logits.cols, "/0 (the whole vocabulary on one rank)");
    check_targets_on_host(target, p);
    // TP=1: the stats are already global, so the CUDA backend merges inside the stats pass.
    std::vector<RowStats> stats(dev == Device::CPU ? rows : 0);
    FL_DISPATCH(dev, "cross_entropy_forward",
                cpu::ce_local_stats(logits, target, p, stats.data());
                cpu::ce_merge(stats.data(), 1, stats.data(), target, p, out),
                cuda::ce_forward_tp1(logits, target, p, out, stream));
    return;
  }

  // Vocab-parallel: local argument errors travel in the header instead of being thrown here.
  ShardHeader header{rows, logits.cols, options.vocab_start, options.vocab_global, -1, 0, 0};
  std::string local_error;
  core::CeParams p;
  try {
    p = core::resolve_params(options, logits.rows, logits.cols);
    check_forward_args(logits, target, out, p);
    require(comm->device() == dev, "comm: a ", to_string(comm->device()),
            " communicator was given for ", to_string(dev), " logits; expected the same device");
    if (dev == Device::CPU) header.bad_row = cpu::first_bad_target(target, p, &header.bad_value);
  } catch (const Error& e) {
    local_error = e.what();
    header.local_error = 1;
  }
  const Communicator::AgreedShape shape{rows, logits.cols, options.vocab_start,
                                        options.vocab_global};
  if (dev == Device::CPU || header.local_error || !(comm->agreed_shape == shape)) {
    comm->agreed_shape = {};
    exchange_and_check_headers(*comm, header, local_error, dev, stream);
    comm->agreed_shape = shape;
  }

  const int rank = comm->rank();
  const bool gather = options.collective == CollectiveForm::AllGather;
  // gather: [local][rank 0 .. world-1]; reduce: [local][summable] + rows floats of maxima
  const size_t stat_rows = gather ? size_t(world + 1) * rows : size_t(2) * rows;
  Scratch buf(dev, sizeof(RowStats) * stat_rows + sizeof(float) * rows, stream);
  RowStats* local = buf.as<RowStats>();
  RowStats* combined = local + rows;
  float* maxima = reinterpret_cast<float*>(local + stat_rows);

  FL_DISPATCH(dev, "cross_entropy_forward", cpu::ce_local_stats(logits, target, p, local),
              cuda::ce_local_stats(logits, target, p, local, stream));
  if (gather) {
    comm->all_gather(local, combined, sizeof(RowStats) * rows, stream);
    FL_DISPATCH(dev, "cross_entropy_forward",
                cpu::ce_merge(combined, world, local, target, p, out),
                cuda::ce_merge(combined, world, local, target, p, out, stream));
    return;
  }
  FL_DISPATCH(dev, "cross_entropy_forward",
              for (int64_t r = 0; r < rows; ++r) maxima[r] = local[r].max,
              cuda::ce_extract_max(local, rows, maxima, stream));
  comm->all_reduce(maxima, rows, ReduceOp::Max, stream);
  FL_DISPATCH(dev, "cross_entropy_forward",
              cpu::ce_prepare_sum(local, maxima, target, p, rank, combined),
              cuda::ce_prepare_sum(local, maxima, target, p, rank, combined, stream));
  comm->all_reduce(reinterpret_cast<float*>(combined), 4 * size_t(rows), ReduceOp::Sum, stream);
  FL_DISPATCH(dev, "cross_entropy_forward", cpu::ce_merge(combined, 1, local, target, p, out),
              cuda::ce_merge(combined, 1, local, target, p, out, stream));
}

void cross_entropy_backward(const MatrixView& logits, const IndexView& target, const float* lse,
                            const float* grad_loss, const float* valid_count,
                            const CrossEntropyOptions& options, const MatrixView& grad_logits,
                            [[maybe_unused]] Stream stream) {
  detail::check_matrix(logits, "logits");
  core::CeParams p = core::resolve_params(options, logits.rows, logits.cols);
  detail::check_matrix(grad_logits, "grad_logits");
  detail::check_index(target, "target", logits.rows, logits.device);
  require(grad_logits.rows == logits.rows && grad_logits.cols == logits.cols,
          "grad_logits: got shape [", grad_logits.rows, ", ", grad_logits.cols, "], expected [",
          logits.rows, ", ", logits.cols, "] (the logits' shape)");
  require(grad_logits.dtype == logits.dtype, "grad_logits.dtype: got ",
          to_string(grad_logits.dtype), ", expected ", to_string(logits.dtype));
  require(grad_logits.device == logits.device, "grad_logits.device: got ",
          to_string(grad_logits.device), ", expected ", to_string(logits.device));
  bool in_place = grad_logits.data == logits.data && grad_logits.row_stride == logits.row_stride;
  require(in_place || !detail::overlaps(grad_logits, logits),
          "grad_logits: overlaps the logits without being the same view; expected the logits "
          "themselves (in place) or a disjoint buffer");
  require(lse != nullptr || logits.rows == 0, "lse: got null, expected the forward's lse");
  require(grad_loss != nullptr || logits.rows == 0, "grad_loss: got null, expected ",
          p.reduction == Reduction::None ? logits.rows : 1, " floats");
  require(valid_count != nullptr || p.reduction != Reduction::Mean || logits.rows == 0,
          "valid_count: got null, expected the forward's valid_count for Reduction::Mean");
  check_targets_on_host(target, p);
  FL_DISPATCH(logits.device, "cross_entropy_backward",
              cpu::ce_backward(logits, target, lse, grad_loss, valid_count, p, grad_logits),
              cuda::ce_backward(logits, target, lse, grad_loss, valid_count, p, grad_logits,
                                stream));
}

void check_device_errors(Stream stream) {
#ifdef FUSEDLOSS_WITH_CUDA
  cuda::check_device_errors(stream);
#else
  (void)stream;
#endif
}

}  // namespace fusedloss
