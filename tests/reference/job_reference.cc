#include "tests/reference/job_reference.h"

#include <algorithm>
#include <cstddef>
#include <limits>

#include "logitserve/kernels/dtype.h"

namespace logitserve::reference {
namespace {

const uint8_t* RowPointer(const MatrixView& m, int64_t row) {
  return static_cast<const uint8_t*>(m.data) + static_cast<size_t>(row) *
                                                   static_cast<size_t>(m.cols) *
                                                   static_cast<size_t>(kernels::SizeOf(m.type));
}

}  // namespace

std::vector<double> RowLogits(const DistributionInput& input, int64_t row, int64_t vocab,
                              double* dot_magnitude) {
  if (dot_magnitude != nullptr) *dot_magnitude = 0.0;
  const double temperature = input.temperature;
  if (!input.hidden_mode()) {
    return LogitsRowLogits(input.logits.type, RowPointer(input.logits, row), vocab, temperature);
  }
  const HeadWeights& w = input.head->weights();
  Head head;
  head.type = w.dtype;
  head.vocab = vocab;
  head.hidden = w.hidden_size;
  head.weight = w.weight.data();
  head.bias = w.bias;
  head.transform.logit_scale = w.transform.logit_scale;
  head.transform.logits_scaling = w.transform.logits_scaling;
  head.transform.softcap = w.transform.softcap;
  return HiddenRowLogits(head, input.hidden.type, RowPointer(input.hidden, row), temperature,
                         dot_magnitude);
}

double HiddenDotMagnitude(const DistributionInput& input, int64_t row, int64_t vocab) {
  double magnitude = 0.0;
  if (input.hidden_mode()) RowLogits(input, row, vocab, &magnitude);
  return magnitude;
}

ReferenceRow ScoreReferenceRow(const ScoreJob& job, int64_t row) {
  ReferenceRow r;
  constexpr double kNotRequested = std::numeric_limits<double>::quiet_NaN();
  r.entropy = r.reference_entropy = r.forward_kl = r.reverse_kl = r.jsd = kNotRequested;
  r.logits = RowLogits(job.model, row, job.vocab, &r.dot_magnitude);
  r.logprobs = LogSoftmax(r.logits);
  if (job.NeedsReference()) {
    r.ref_logits = RowLogits(job.reference, row, job.vocab, &r.ref_dot_magnitude);
    r.ref_logprobs = LogSoftmax(r.ref_logits);
  }
  r.target_logprobs.resize(static_cast<size_t>(std::max(job.ids_per_row, 0)));
  for (int32_t k = 0; k < job.ids_per_row; ++k) {
    const size_t i = static_cast<size_t>(row) * job.ids_per_row + k;
    r.target_logprobs[k] = TargetLogProb(r.logprobs, job.target_ids[i], job.ignore_index);
  }
  if (job.top_k > 0) r.top_k = TopK(r.logprobs, job.top_k);
  if (job.entropy) r.entropy = Entropy(r.logprobs);
  if (job.reference_entropy) r.reference_entropy = Entropy(r.ref_logprobs);
  if (job.forward_kl) r.forward_kl = Kl(r.ref_logprobs, r.logprobs);
  if (job.reverse_kl) r.reverse_kl = Kl(r.logprobs, r.ref_logprobs);
  if (job.jsd_beta.has_value()) r.jsd = Jsd(r.logprobs, r.ref_logprobs, *job.jsd_beta);
  return r;
}

ReferenceResult ScoreReference(const ScoreJob& job) {
  ReferenceResult out;
  const size_t rows = static_cast<size_t>(job.rows);
  if (job.ids_per_row > 0) out.target_logprobs.resize(rows * job.ids_per_row);
  if (job.top_k > 0) {
    out.top_k_ids.resize(rows * job.top_k);
    out.top_k_logprobs.resize(rows * job.top_k);
  }
  if (job.entropy) out.entropy.resize(rows);
  if (job.reference_entropy) out.reference_entropy.resize(rows);
  if (job.forward_kl) out.forward_kl.resize(rows);
  if (job.reverse_kl) out.reverse_kl.resize(rows);
  if (job.jsd_beta.has_value()) out.jsd.resize(rows);
  for (size_t row = 0; row < rows; ++row) {
    const ReferenceRow r = ScoreReferenceRow(job, static_cast<int64_t>(row));
    for (size_t k = 0; k < r.target_logprobs.size(); ++k) {
      out.target_logprobs[row * job.ids_per_row + k] = r.target_logprobs[k];
    }
    for (size_t k = 0; k < r.top_k.size(); ++k) {
      out.top_k_ids[row * job.top_k + k] = r.top_k[k].id;
      out.top_k_logprobs[row * job.top_k + k] = r.top_k[k].logprob;
    }
    if (job.entropy) out.entropy[row] = r.entropy;
    if (job.reference_entropy) out.reference_entropy[row] = r.reference_entropy;
    if (job.forward_kl) out.forward_kl[row] = r.forward_kl;
    if (job.reverse_kl) out.reverse_kl[row] = r.reverse_kl;
    if (job.jsd_beta.has_value()) out.jsd[row] = r.jsd;
  }
  return out;
}

}  // namespace logitserve::reference
