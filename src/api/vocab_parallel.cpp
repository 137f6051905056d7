#include "api/vocab_parallel.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <iomanip>
#include <new>
#include <optional>
#include <sstream>
#include <type_traits>
#include "core/cross_entropy_math.h"
#include "core/dispatch.h"
#include "common/error.h"
#include "cpu/cross_entropy_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/cross_entropy_cuda.h"
#endif

namespace fusedloss::vocab_parallel {

Scratch::Scratch(Device device, size_t bytes, Stream stream, const char* fn)
    : device_(device), stream_(stream) {
  if (bytes == 0) return;
  if (device == Device::CPU) {
    try {
      host_.resize((bytes + sizeof(RowStats) - 1) / sizeof(RowStats));
    } catch (const std::bad_alloc&) {
      throw OutOfMemory(std::string(fn) + ": fusedloss scratch of " + std::to_string(bytes) +
                        " bytes: out of host memory");
    }
    ptr_ = host_.data();
  } else {
    FL_CUDA_BRANCH(fn, ptr_ = cuda::alloc_async(bytes, stream));
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
  int64_t rank;  // comm.rank(): every rank checks that slot r holds rank r's header
  int64_t rows, vocab_local, has_error, chunk_rows, collective;
  uint64_t options;
  uint64_t targets;  // last: on a device communicator it is added on the device
};
// Gathered as raw bytes between ranks and written at an offset on the device: no padding,
// the checksum last.
static_assert(std::is_standard_layout_v<Header> && sizeof(Header) == 8 * 8 &&
              offsetof(Header, targets) == sizeof(Header) - 8);

uint64_t host_checksum(const IndexView& t) {
  uint64_t sum = 0;
  core::dispatch_index(t.type, [&](auto idx) {
    using Index = decltype(idx);
    const auto* v = static_cast<const Index*>(t.data);
    for (int64_t r = 0; r < t.size; ++r) sum += core::target_checksum_term(int64_t(v[r]), r);
  });
  return sum;
}

const char* collective_name(int64_t form) {
  return form == int64_t(CollectiveForm::AllGather)   ? "AllGather"
         : form == int64_t(CollectiveForm::AllReduce) ? "AllReduce"
                                                      : "unknown";
}

// A call into the caller's communicator: its own exceptions reach the caller as Error, naming
// the call, with the original nested inside (std::rethrow_if_nested recovers it: the Python
// binding re-raises a Python exception as it was); an Error passes as it is.
template <class F>
auto hook(const char* what, F&& call) {
  try {
    return call();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::throw_with_nested(Error(std::string("comm.") + what + ": " + e.what()));
  }
}

// all[r * bytes, (r + 1) * bytes) on the host receives rank r's `mine`, whatever memory the
// communicator works in (device communicators go through `staging`: bytes x (world + 1) of
// device memory, and a host sync). On a device communicator, `on_device` (if any) may complete
// this rank's staged copy on the device before the gather (stream-ordered: no extra host sync).
void gather_to_host(Communicator& comm, const void* mine, void* all, size_t bytes, char* staging,
                    Stream stream, const char* fn,
                    const std::function<void(char*)>& on_device = {}) {
  const Device dev = comm.device();
  if (dev == Device::CPU) {
    hook("all_gather", [&] { comm.all_gather(mine, all, bytes, stream); });
    return;
  }
  const size_t world = size_t(comm.size());
  char* staged = staging;
  FL_CUDA_BRANCH(fn, cuda::copy_async(staged + bytes * world, mine, bytes, true, stream));
  if (on_device) on_device(staged + bytes * world);
  hook("all_gather", [&] { comm.all_gather(staged + bytes * world, staged, bytes, stream); });
  FL_CUDA_BRANCH(fn, cuda::copy_async(all, staged, bytes * world, false, stream);
                 cuda::synchronize(stream));
}

uint64_t mix(uint64_t h, const void* bytes, size_t n) {  // FNV-1a
  const auto* b = static_cast<const unsigned char*>(bytes);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

template <class T>
uint64_t mix(uint64_t h, const T& v) {
  return mix(h, &v, sizeof(v));
}

}  // namespace

void check_communicator(const Communicator& comm) {
  const int world = hook("size()", [&] { return comm.size(); });
  const int rank = hook("rank()", [&] { return comm.rank(); });
  detail::require(world >= 1 && world <= kMaxRanks, "comm.size(): got ", world, ", expected 1..",
                  kMaxRanks);
  detail::require(rank >= 0 && rank < world, "comm.rank(): got ", rank, ", expected 0..",
                  world - 1, " (comm.size() is ", world, ")");
}

uint64_t fingerprint(const CrossEntropyOptions& o) {
  uint64_t h = 0xcbf29ce484222325ull;
  h = mix(h, o.ignore_index);
  h = mix(h, o.label_smoothing + 0.0f);  // + 0: -0 and 0 are one option
  h = mix(h, int(o.smoothing_formula));
  h = mix(h, int(o.smoothing_scope));
  h = mix(h, o.z_loss + 0.0f);
  h = mix(h, int(o.reduction));
  h = mix(h, o.vocab_global);
  h = mix(h, o.logit_softcap + 0.0f);
  return h;
}

uint64_t fingerprint_more(uint64_t seed, const void* bytes, size_t n) {
  return mix(seed, bytes, n);
}

std::string describe(const CrossEntropyOptions& o) {
  std::ostringstream os;
  os << std::setprecision(9) << "ignore_index=" << o.ignore_index
     << ", label_smoothing=" << o.label_smoothing + 0.0f << ", smoothing_formula="
     << (o.smoothing_formula == SmoothingFormula::PyTorch ? "PyTorch" : "Megatron")
     << ", smoothing_scope=" << (o.smoothing_scope == SmoothingScope::Global ? "Global" : "Partition")
     << ", z_loss=" << o.z_loss + 0.0f << ", reduction="
     << (o.reduction == Reduction::None ? "None" : o.reduction == Reduction::Sum ? "Sum" : "Mean")
     << ", vocab_global=" << o.vocab_global << ", logit_softcap=" << o.logit_softcap + 0.0f;
  return os.str();
}

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

namespace {

// "rank r's NAME=A differs from rank 0's NAME=B" for the first pair of two describe() texts
// that differs (the whole texts when none does: a difference the text rounds away).
std::string differing_option(const std::string& mine, const std::string& first, int r) {
  auto pairs = [](const std::string& text) {
    std::vector<std::string> out;
    for (size_t at = 0; at <= text.size();) {
      const size_t end = std::min(text.find(", ", at), text.size());
      out.push_back(text.substr(at, end - at));
      at = end + 2;
    }
    return out;
  };
  const std::vector<std::string> a = pairs(mine), b = pairs(first);
  const std::string rank = "rank " + std::to_string(r) + "'s ";
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i]) return rank + a[i] + " differs from rank 0's " + b[i];
  return rank + "differ from rank 0's, though both read (" + mine + ")";
}

}  // namespace

void agree(Communicator& comm, const ShardClaim& mine, Stream stream) {
  const int world = comm.size();
  Header header{comm.rank(),     mine.rows,
                mine.vocab_local, mine.error.empty() ? 0 : mine.out_of_memory ? 2 : 1,
                mine.chunk_rows, int64_t(mine.collective),
                mine.options,    0};
  // The targets' checksum: on the host for a host communicator (whose targets are host
  // memory: the devices were checked), else added on the device into the staged header's
  // field, which the copy of `header` zeroed.
  const bool sum_targets = mine.error.empty() && mine.target.size > 0;
  const bool sum_weights = sum_targets && mine.row_weight != nullptr;
  const int64_t rows = mine.target.size;
  std::function<void(char*)> on_device;
  if (sum_targets && comm.device() == Device::CPU) {
    header.targets = host_checksum(mine.target);
    for (int64_t r = 0; sum_weights && r < rows; ++r)
      header.targets += core::row_weight_checksum_term(mine.row_weight[r], r, rows);
  } else if (sum_targets) {
    on_device = [&](char* staged) {
      [[maybe_unused]] auto* field = reinterpret_cast<uint64_t*>(staged + offsetof(Header, targets));
      FL_CUDA_BRANCH(mine.fn, cuda::ce_target_checksum(mine.target, field, stream));
      if (sum_weights)
        FL_CUDA_BRANCH(mine.fn, cuda::ce_row_weight_checksum(mine.row_weight, rows, field, stream));
    };
  }
  // The device staging of both rounds, before the first: nothing is allocated between them (a
  // rank out of memory is likeliest to reach the second round, the error path). A failure here
  // is this rank's alone: without device memory it cannot take part in the exchange.
  std::optional<Scratch> staging;
  if (comm.device() != Device::CPU)
    staging.emplace(comm.device(), (sizeof(Header) + kErrorBytes) * size_t(world + 1), stream,
                    mine.fn);
  char* staged = staging ? staging->as<char>() : nullptr;
  std::vector<Header> all(world);
  std::vector<char> texts(kErrorBytes * size_t(world));
  gather_to_host(comm, &header, all.data(), sizeof(Header), staged, stream, mine.fn, on_device);
  // Slot r must hold rank r's header: a communicator that loses or reorders them (or whose
  // rank() disagrees with its gather's order) cannot carry an error or place the shards.
  // Decided from the gathered bytes alone, the same way on every rank.
  for (int r = 0; r < world; ++r)
    detail::require(all[r].rank == r, "comm.all_gather: slot ", r, " holds the header of rank ",
                    all[r].rank, "; expected recv[r] to receive rank r's send buffer (and "
                    "comm.rank() to be that order)");

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
    // Ranks whose arguments were valid: a chunked caller's collectives follow its chunking,
    // and everyone's follow the collective form.
    for (int r = 0; r < world; ++r) {
      const Header& h = all[r];
      detail::require(h.chunk_rows == h0.chunk_rows, "vocab-parallel chunking: rank ", r,
                      " computes ", h.chunk_rows, " tokens per chunk, rank 0 ", h0.chunk_rows,
                      "; expected the same workspace_bytes / chunk_rows, dtype and FUSEDLOSS_LCE_BUFFERS / "
                      "FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB on every rank");
      detail::require(h.collective == h0.collective, "vocab-parallel options.collective: rank ",
                      r, " uses ", collective_name(h.collective), ", rank 0 ",
                      collective_name(h0.collective), "; expected the same on every rank");
      if (h.options != h0.options) {
        // Every rank read the same headers: each takes this second round, which names the
        // option (its text, truncated to the fixed size the collective needs).
        char text[kErrorBytes] = {};
        std::memcpy(text, mine.options_text.data(),
                    std::min(mine.options_text.size(), kErrorBytes - 1));
        gather_to_host(comm, text, texts.data(), kErrorBytes, staged, stream, mine.fn);
        auto text_of = [&](int q) {
          const char* t = texts.data() + kErrorBytes * size_t(q);
          return std::string(t, strnlen(t, kErrorBytes));
        };
        detail::fail("vocab-parallel options: ", differing_option(text_of(r), text_of(0), r),
                     "; expected the same options on every rank");
      }
      // (after the options: a rank with row weights and one without differ there first)
      detail::require(h.targets == h0.targets, "vocab-parallel targets: rank ", r,
                      "'s differ from rank 0's (a checksum of their values",
                      mine.row_weight ? ", and of the row weights'" : "",
                      "); expected the same targets", mine.row_weight ? " and row weights" : "",
                      " on every rank (each rank computes the loss of the same tokens)");
    }
    return;
  }

  // Second round, only on the error path: each rank's text, truncated to a fixed size so the
  // collective matches on every rank.
  char text[kErrorBytes] = {};
  std::memcpy(text, mine.error.data(), std::min(mine.error.size(), kErrorBytes - 1));
  gather_to_host(comm, text, texts.data(), kErrorBytes, staged, stream, mine.fn);
  for (int r = 0; r < world; ++r) {
    if (!all[r].has_error) continue;
    const char* t = texts.data() + kErrorBytes * size_t(r);
    throw_as(all[r].has_error == 2, "vocab-parallel: rank " + std::to_string(r) + ": " +
                                        std::string(t, strnlen(t, kErrorBytes)));
  }
}

void agree_or_throw(Communicator& comm, const ShardClaim& mine, bool check, Stream stream) {
  if (check)
    agree(comm, mine, stream);
  else if (!mine.error.empty())
    throw_as(mine.out_of_memory, mine.error);
}

void throw_as(bool out_of_memory, const std::string& message) {
  if (out_of_memory) throw OutOfMemory(message);
  throw Error(message);
}

size_t forward_scratch_bytes(int64_t rows, int world, CollectiveForm form) {
  // gather: [local][rank 0 .. world-1]; reduce: [local][summable] + rows floats of maxima
  const size_t stat_rows =
      form == CollectiveForm::AllGather ? size_t(world + 1) * size_t(rows) : 2 * size_t(rows);
  return sizeof(RowStats) * stat_rows + 2 * sizeof(float) * size_t(rows);  // + maxima, row losses
}

void forward(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
             CollectiveForm form, const CrossEntropyOutputs& out, Communicator& comm,
             void* scratch, [[maybe_unused]] Stream stream, const char* fn) {
  const int world = comm.size(), rank = comm.rank();
  const Device dev = logits.device;
  const int64_t rows = logits.rows;
  const bool gather = form == CollectiveForm::AllGather;
  // the layout of forward_scratch_bytes
  const size_t stat_rows = gather ? size_t(world + 1) * rows : size_t(2) * rows;
  RowStats* local = static_cast<RowStats*>(scratch);
  RowStats* combined = local + rows;
  float* maxima = reinterpret_cast<float*>(local + stat_rows);
  float* row_losses = maxima + rows;  // the merge's, for a Sum / Mean

  FL_DISPATCH(dev, fn, cpu::ce_local_stats(logits, target, p, local),
              cuda::ce_local_stats(logits, target, p, local, stream));
  if (gather) {
    hook("all_gather", [&] { comm.all_gather(local, combined, sizeof(RowStats) * rows, stream); });
    FL_DISPATCH(dev, fn,
                cpu::ce_merge(combined, world, local, target, p, out, row_losses),
                cuda::ce_merge(combined, world, local, target, p, out, stream, row_losses));
    return;
  }
  FL_DISPATCH(dev, fn,
              for (int64_t r = 0; r < rows; ++r) maxima[r] = local[r].max,
              cuda::ce_extract_max(local, rows, maxima, stream));
  hook("all_reduce", [&] { comm.all_reduce(maxima, rows, ReduceOp::Max, stream); });
  FL_DISPATCH(dev, fn,
              cpu::ce_prepare_sum(local, maxima, target, p, rank, combined),
              cuda::ce_prepare_sum(local, maxima, target, p, rank, combined, stream));
  hook("all_reduce", [&] {
    comm.all_reduce(reinterpret_cast<float*>(combined), 4 * size_t(rows), ReduceOp::Sum, stream);
  });
  FL_DISPATCH(dev, fn, cpu::ce_merge(combined, 1, local, target, p, out, row_losses),
              cuda::ce_merge(combined, 1, local, target, p, out, stream, row_losses));
}

}  // namespace fusedloss::vocab_parallel
