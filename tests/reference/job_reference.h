// The ScoreJob-level fp64 oracle the backend suites and the benchmarks compare against: a job's
// inputs read through kernels/reference (which takes only rows and plain structs), every
// requested output by its textbook definition. Test support, not production code: it knows
// ScoreJob and HeadWeights so the kernels' reference does not have to.
//
// Thread safety: every function is pure; call it from any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/reference/reference.h"
#include "server/backend/backend.h"

namespace logitserve::reference {

// Logits of one row of a distribution input, in double.
//   Logits mode: z_j = upcast(logits[row, j]) / temperature.
//   Hidden mode: z_j = TransformLogit(sum_i h[row, i] W[j, i], bias_j, temperature), the product
//   summed in double over exactly upcast elements.
// When `dot_magnitude` is given it receives, in hidden mode, max_j sum_i |h[row, i] W[j, i]|: the
// scale of an fp32 dot product's rounding error (|error| <= H u times it); 0 in logits mode.
std::vector<double> RowLogits(const DistributionInput& input, int64_t row, int64_t vocab,
                              double* dot_magnitude = nullptr);

// Hidden mode only: max_j sum_i |h[row, i] W[j, i]| (a full pass; RowLogits can return it for
// free). 0 in logits mode.
double HiddenDotMagnitude(const DistributionInput& input, int64_t row, int64_t vocab);

// Everything the reference knows about one row of a job: the logits and log-probabilities of
// both distributions and every requested output (NaN / empty where not requested).
struct ReferenceRow {
  std::vector<double> logits;      // model z (after transform and temperature)
  std::vector<double> logprobs;    // model lp
  double dot_magnitude = 0.0;      // see RowLogits
  std::vector<double> ref_logits;  // reference z; empty unless the job needs the reference
  std::vector<double> ref_logprobs;
  double ref_dot_magnitude = 0.0;
  std::vector<double> target_logprobs;  // [ids_per_row]
  std::vector<TopKItem> top_k;          // [top_k]
  double entropy = 0.0;                 // H(model)
  double reference_entropy = 0.0;       // H(reference)
  double forward_kl = 0.0;              // KL(reference || model)
  double reverse_kl = 0.0;              // KL(model || reference)
  double jsd = 0.0;                     // JSD_beta(student = model, teacher = reference)
};

// Scores row `row` of a job. REQUIRES: as ScoreReference.
ReferenceRow ScoreReferenceRow(const ScoreJob& job, int64_t row);

// Every output of a ScoreJob, in double, laid out exactly like ScoreResult; a vector is empty
// when its output was not requested.
struct ReferenceResult {
  std::vector<double> target_logprobs;  // [rows * ids_per_row]
  std::vector<int32_t> top_k_ids;       // [rows * top_k]
  std::vector<double> top_k_logprobs;   // [rows * top_k]
  std::vector<double> entropy;          // [rows], H(model)
  std::vector<double> reference_entropy;
  std::vector<double> forward_kl;  // KL(reference || model)
  std::vector<double> reverse_kl;  // KL(model || reference)
  std::vector<double> jsd;         // JSD_beta(student = model, teacher = reference)
};

// Scores a whole job with the definitions above. Hidden mode reads job.<input>.head->weights().
// REQUIRES: the job is valid (what the service validates: shapes, ids, options). NaN / +inf
// inputs are not rejected here; they propagate.
ReferenceResult ScoreReference(const ScoreJob& job);

}  // namespace logitserve::reference
