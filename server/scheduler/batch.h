// Batch assembly: which validated jobs may run as one backend job, and how to merge their inputs
// and split the merged result back.
//
// Co-batching never changes a bit of anyone's result: every backend computes each row from that
// row's inputs alone, over fixed row tiles and vocabulary blocks (SPEC §3 determinism), so a row
// gives the same outputs at any position of any batch. Jobs share a batch only when everything
// but their rows is identical: the same PreparedHead objects (so never two versions of a head),
// the same input dtypes and widths, temperatures, outputs, top_k, K and ignore_index.
//
// Thread safety: pure functions; a MergedInputs is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "server/backend/backend.h"

namespace logitserve {

// True when `a` and `b` may be computed as one job (see above).
bool CanShareBatch(const ScoreJob& a, const ScoreJob& b);

// A byte buffer that only grows and is never zero-filled: the concatenated inputs of merged
// jobs are written whole before they are read, and reusing one buffer per worker avoids a large
// allocation (and the page faults of its first touch) per batch.
class StagingBytes {
 public:
  // At least `bytes` bytes, contents unspecified; earlier pointers are invalid after a growth.
  std::byte* Reserve(size_t bytes) {
    if (bytes > capacity_) {
      data_.reset();  // free first: the old and new buffers are never held together
      data_.reset(new std::byte[bytes]);
      capacity_ = bytes;
    }
    return data_.get();
  }
  size_t capacity() const { return capacity_; }
  // Frees the buffer when it holds more than `keep` bytes (a rare huge batch, e.g. logits mode at
  // V = 151936, is not held for good).
  void TrimTo(size_t keep) {
    if (capacity_ > keep) {
      data_.reset();
      capacity_ = 0;
    }
  }

 private:
  std::unique_ptr<std::byte[]> data_;
  size_t capacity_ = 0;
};

// Owns the concatenated inputs of a merged job; must outlive the job. Reusable: a scheduler
// worker keeps one between batches, up to kKeepBytes per input (a hidden-mode batch of 8192 rows
// at H = 4096 bf16 is 64 MiB); a larger one is freed after its batch, as before reuse.
struct MergedInputs {
  static constexpr size_t kKeepBytes = size_t{256} << 20;
  StagingBytes model;
  StagingBytes reference;
  void Trim() {
    model.TrimTo(kKeepBytes);
    reference.TrimTo(kKeepBytes);
  }
};

// One job over the rows of `parts` in order (their inputs copied into `storage`).
// REQUIRES: parts.size() >= 1 and CanShareBatch of every pair; the parts' views are valid.
// The merged job has no stop callback: the caller sets one.
ScoreJob MergeJobs(const std::vector<const ScoreJob*>& parts, MergedInputs* storage);

// The rows [row0, row0 + rows) of `merged`'s result, laid out as a result of a job of `rows`
// rows (same outputs, K and top_k as the merged job).
ScoreResult SliceResult(const ScoreJob& merged, const ScoreResult& result, int64_t row0,
                        int64_t rows);

}  // namespace logitserve
