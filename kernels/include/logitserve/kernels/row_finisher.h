// The row finisher: from one row's folded statistics (block_stats.h), that row's outputs. One
// definition for the CPU backend's fold (server/backend/cpu/) and the CUDA fold kernel
// (kernels/cuda/fold_kernels.cu), so the two cannot drift: ignore_index, the target and top-k
// log-probabilities, entropy, reference entropy, forward / reverse KL and the JSD endpoints
// (beta = 0 is forward KL's bits, beta = 1 reverse KL's: explicit branches, not limits).
//
// What stays with each backend: finding a target id's logit in the gathered messages (the
// callable FinishRow takes) and merging the ranks' top-k lists. The merge is the same total order
// (Better) in both, but the CPU merges whole lists pairwise into a buffer (TopKMerge) while the
// CUDA kernel walks the ranks' lists with one cursor each, k-way, without a k-entry buffer per
// thread; sharing one of them would cost the other its natural form. Each hands every entry to
// FinishTopKEntry.
//
// Host and device (LOGITSERVE_HD); pure: writes only the given row's outputs.
#pragma once

#include <cstdint>

#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cpu_kernels.h"  // TopKEntry

namespace logitserve::kernels {

// Job-wide outputs, indexed by global row; a null pointer = not requested. Host memory for the
// CPU backend, device memory for the CUDA fold kernel.
struct RowOutputs {
  const int32_t* target_ids = nullptr;  // [N * ids_per_row]
  int32_t ids_per_row = 0;
  int32_t ignore_index = -100;
  float* target_logprobs = nullptr;  // [N * ids_per_row]
  int32_t top_k = 0;
  int32_t* top_k_ids = nullptr;     // [N * top_k]
  float* top_k_logprobs = nullptr;  // [N * top_k]
  float* entropy = nullptr;         // H(model)
  float* reference_entropy = nullptr;
  float* forward_kl = nullptr;  // KL(reference || model) = KlBA (a = model, b = reference)
  float* reverse_kl = nullptr;  // KL(model || reference) = KlAB
  // JSD at an endpoint copies a KL's bits: 1 = beta 0 (forward KL), 2 = beta 1 (reverse KL).
  // 0: no JSD or 0 < beta < 1 (the JSD pass writes jsd).
  float* jsd = nullptr;
  int32_t jsd_endpoint = 0;
};

// The JSD endpoint code of RowOutputs::jsd_endpoint for a job's beta (has_beta false: no JSD).
LOGITSERVE_HD int32_t JsdEndpoint(bool has_beta, float beta) {
  if (!has_beta) return 0;
  return beta == 0.0f ? 1 : (beta == 1.0f ? 2 : 0);
}

// Every output of global row `row` except top-k. a = model, b = reference (EmptyRowStats without
// one), pair = their folded pair (EmptyPairRowStats without one). target_logit(j, id) returns the
// logit z of the row's j-th target id `id` (never called for ignore_index).
template <typename TargetLogit>
LOGITSERVE_HD void FinishRow(const RowOutputs& o, int64_t row, const RowStats& a, const RowStats& b,
                             const PairRowStats& pair, const TargetLogit& target_logit) {
  if (o.target_logprobs != nullptr) {
    for (int32_t j = 0; j < o.ids_per_row; ++j) {
      const int64_t idx = row * o.ids_per_row + j;
      const int32_t id = o.target_ids[idx];
      if (id == o.ignore_index) {
        o.target_logprobs[idx] = 0.0f;
        continue;
      }
      o.target_logprobs[idx] = LogProb(target_logit(j, id), a);
    }
  }
  if (o.entropy != nullptr) o.entropy[row] = Entropy(a);
  if (o.reference_entropy != nullptr) o.reference_entropy[row] = Entropy(b);
  // Model = a, reference = b: forward KL(reference || model) = KL(b || a).
  if (o.forward_kl != nullptr || o.jsd_endpoint == 1) {
    const float f = KlBA(pair);
    if (o.forward_kl != nullptr) o.forward_kl[row] = f;
    if (o.jsd_endpoint == 1) o.jsd[row] = f;
  }
  if (o.reverse_kl != nullptr || o.jsd_endpoint == 2) {
    const float rv = KlAB(pair);
    if (o.reverse_kl != nullptr) o.reverse_kl[row] = rv;
    if (o.jsd_endpoint == 2) o.jsd[row] = rv;
  }
}

// Top-k entry j (0 <= j < o.top_k) of global row `row`, from the merged list's entry `e`, best
// first; a = the model's folded row. e == nullptr: the merged list ran short, which cannot happen
// for top_k <= vocab (validation's rule); the output stays defined anyway (id -1, NaN).
LOGITSERVE_HD void FinishTopKEntry(const RowOutputs& o, int64_t row, int32_t j, const TopKEntry* e,
                                   const RowStats& a) {
  const int64_t idx = row * o.top_k + j;
  if (e == nullptr) {
    o.top_k_ids[idx] = -1;
    o.top_k_logprobs[idx] = QuietNaN();
    return;
  }
  o.top_k_ids[idx] = e->id;
  o.top_k_logprobs[idx] = LogProb(e->value, a);
}

}  // namespace logitserve::kernels
