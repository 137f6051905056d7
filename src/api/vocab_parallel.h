// The vocab-parallel hook of cross_entropy_forward (a communicator of size > 1): the shard
// agreement that runs before any size-dependent collective, and the two collective forms
// between the local stats and the merge.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>
#include "core/ce_params.h"
#include "fusedloss/cross_entropy.h"

namespace fusedloss::vocab_parallel {

// Scratch memory on `device`, released at scope exit (stream-ordered on CUDA); `fn` names the
// entry point in the error of a CUDA call without a usable device. Throws OutOfMemory when the
// memory is not there (host or device). At TP > 1 every allocation of a call happens before
// its agreement, which carries a rank's failure to every rank.
class Scratch {
 public:
  Scratch(Device device, size_t bytes, Stream stream, const char* fn);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* as(size_t offset_elems = 0) const {
    return static_cast<T*>(ptr_) + offset_elems;
  }

 private:
  Device device_;
  Stream stream_;
  std::vector<RowStats> host_;  // RowStats-aligned host storage
  void* ptr_ = nullptr;
};

// The communicator's own size and rank: 1 <= size <= kMaxRanks, 0 <= rank < size. Checked before
// anything relies on them, and thrown at once: a communicator that reports them wrong cannot
// carry an agreement either.
constexpr int kMaxRanks = 1 << 16;
void check_communicator(const Communicator& comm);

// Equal contiguous shards in rank order, on the communicator's device. Local facts only (this
// rank's options, rank and size), so callers check them before the agreement.
void check_shard_position(const core::CeParams& p, const Communicator& comm, Device device);

// A fingerprint of the options every rank must share (all but vocab_start, which is the rank's
// own); `seed` chains a caller's further options (fingerprint_more).
uint64_t fingerprint(const CrossEntropyOptions& o);
uint64_t fingerprint_more(uint64_t seed, const void* bytes, size_t n);
// The same options as "name=value" pairs joined by ", " (what an options mismatch names);
// a caller appends its further options' pairs to it.
std::string describe(const CrossEntropyOptions& o);

// What this rank brings to the agreement: its shape and, when its own arguments were
// rejected, the error it would have thrown (empty when none).
struct ShardClaim {
  int64_t rows = 0, vocab_local = 0;
  std::string error;
  bool out_of_memory = false;  // the error is an OutOfMemory: every rank throws one
  // Tokens per chunk of a chunked caller (the linear cross-entropy runs one collective per
  // chunk, so the chunking must agree too); 0 for an unchunked call.
  int64_t chunk_rows = 0;
  // The collective form (the collectives that follow differ with it) and the fingerprint of
  // the options (ranks that differ would compute different losses without an error).
  CollectiveForm collective = CollectiveForm::AllGather;
  uint64_t options = 0;
  // The fingerprinted options as text (describe(), and the caller's further pairs): exchanged
  // only when the fingerprints differ, to name the option and the two values.
  std::string options_text;
  // The targets, whose checksum every rank must share (the same tokens on every rank), and
  // row weights (`target.size` floats, or null) summed into it by their bits; read only when
  // this rank has no error.
  IndexView target;
  const float* row_weight = nullptr;
  const char* fn = "cross_entropy_forward";  // the entry point, for its errors
};

// Collective over `comm` (every rank calls it, whatever its arguments): one all-gather of a
// fixed-size header, then, only if some rank has an error, one all-gather of every rank's
// error text (kErrorBytes each). Throws the same Error on every rank when the row counts or
// the shard sizes differ, or when any rank has an error (the lowest such rank's, prefixed
// "vocab-parallel: rank R: ", an OutOfMemory when that rank's was one), or, with no error anywhere, when the chunking, the collective
// form, the options or the targets (a checksum of their values) differ (options: a second
// all-gather of each rank's options_text, kErrorBytes each, names the first that differs), or
// when the gather did not put rank r's header in slot r. On a device communicator it synchronises `stream`
// (the checksum is computed on the device, inside it). A failure of its own before the first
// gather (a device allocation, copy or launch: sticky CUDA errors) is thrown on this rank alone.
constexpr size_t kErrorBytes = 512;
void agree(Communicator& comm, const ShardClaim& mine, Stream stream);

// Runs `local` (this rank's checks and allocations: no collective inside): an Error it throws
// becomes this rank's claim (`mine.error`), which the agreement hands to every rank.
template <class Local>
void claim_errors(ShardClaim& mine, Local&& local) {
  try {
    local();
  } catch (const OutOfMemory& e) {
    mine.error = e.what();
    mine.out_of_memory = true;
  } catch (const Error& e) {
    mine.error = e.what();
  }
}

// agree() when `check` (the caller's check_shard_agreement), else this rank's own error, if any.
void agree_or_throw(Communicator& comm, const ShardClaim& mine, bool check, Stream stream);

// The bytes of `forward`'s scratch for up to `rows` rows.
size_t forward_scratch_bytes(int64_t rows, int world, CollectiveForm form);

// Local stats -> all-gather (or all-reduce max, then sum) -> merge, with arguments that are
// valid on this rank and agreed on every rank. `scratch` (forward_scratch_bytes for at least
// logits.rows, on the logits' device) was allocated before the agreement, so that nothing
// between the collectives can fail on one rank alone.
void forward(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
             CollectiveForm form, const CrossEntropyOutputs& out, Communicator& comm,
             void* scratch, Stream stream, const char* fn);

// The error to throw on every rank for a rank's failure: an OutOfMemory stays one.
[[noreturn]] void throw_as(bool out_of_memory, const std::string& message);

}  // namespace fusedloss::vocab_parallel
