// Batch assembly: which validated jobs may run as one backend job, and how to merge their inputs
// and split the merged result back.
//
// Co-batching never changes a bit of anyone's result: every backend computes each row from that
// row's inputs alone, over fixed row tiles and vocabulary blocks (SPEC §3 determinism), so a row
// gives the same outputs at any position of any batch. Jobs share a batch only when everything
// but their rows is identical: the same PreparedHead objects (so never two versions of a head),
// the same input dtypes and widths, temperatures, outputs, top_k, K and ignore_index.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "server/backend/backend.h"

namespace logitserve {

// True when `a` and `b` may be computed as one job (see above).
bool CanShareBatch(const ScoreJob& a, const ScoreJob& b);

// Owns the concatenated inputs of a merged job; must outlive the job.
struct MergedInputs {
  std::vector<std::byte> model;
  std::vector<std::byte> reference;
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
