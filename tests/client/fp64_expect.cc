#include "tests/client/fp64_expect.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>

#include "gtest/gtest.h"
#include "kernels/reference/reference.h"

namespace logitserve::client::testing {
namespace {

void ExpectClose(const char* what, int64_t index, float actual, double expected, int64_t vocab,
                 double range) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(actual)) << what << "[" << index << "] = " << actual << ", want NaN";
    return;
  }
  if (std::isinf(expected)) {
    EXPECT_EQ(static_cast<double>(actual), expected) << what << "[" << index << "]";
    return;
  }
  EXPECT_NEAR(actual, expected, Fp32Tol(vocab, range, expected)) << what << "[" << index << "]";
}

void ExpectPerRow(const char* what, const std::vector<float>& actual,
                  const std::vector<double>& expected, int64_t vocab, double range) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    ExpectClose(what, static_cast<int64_t>(i), actual[i], expected[i], vocab, range);
  }
}

}  // namespace

double Fp32Tol(int64_t vocab, double range, double value) {
  return 4.0 * static_cast<double>(vocab + 16) * kFp32Eps * (1.0 + std::abs(value) + range);
}

double LogitRange(const Rows& rows) {
  double range = 0.0;
  for (const std::vector<double>& z : rows) {
    double m = -INFINITY;
    for (double v : z) m = std::max(m, v);
    for (double v : z) {
      if (std::isfinite(v) && std::isfinite(m)) range = std::max(range, m - v);
    }
  }
  return range;
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = std::bit_cast<uint32_t>(v[i]);
  return out;
}

void ExpectMatchesFp64(const ScoreOutput& out, const Rows& model, const Rows* reference,
                       const Fp64Options& o, double range) {
  const int64_t n = static_cast<int64_t>(model.size());
  ASSERT_EQ(out.rows, n);
  const int64_t vocab = n > 0 ? static_cast<int64_t>(model[0].size()) : 0;
  std::vector<double> tlp, ent, ref_ent, fkl, rkl, jsd;
  std::vector<std::vector<double>> lps(n);
  for (int64_t r = 0; r < n; ++r) {
    const std::vector<double> lp = reference::LogSoftmax(model[r]);
    lps[r] = lp;
    for (int k = 0; k < o.ids_per_row; ++k) {
      const int64_t id = o.target_ids[r * o.ids_per_row + k];
      tlp.push_back(reference::TargetLogProb(lp, static_cast<int32_t>(id), o.ignore_index));
    }
    if (o.entropy) ent.push_back(reference::Entropy(lp));
    if (reference != nullptr) {
      const std::vector<double> lq = reference::LogSoftmax((*reference)[r]);
      if (o.reference_entropy) ref_ent.push_back(reference::Entropy(lq));
      if (o.forward_kl) fkl.push_back(reference::Kl(lq, lp));
      if (o.reverse_kl) rkl.push_back(reference::Kl(lp, lq));
      if (o.jsd_beta.has_value()) jsd.push_back(reference::Jsd(lp, lq, *o.jsd_beta));
    }
  }
  ASSERT_EQ(out.target_ids_per_row, static_cast<uint32_t>(o.ids_per_row));
  ExpectPerRow("target_logprobs", out.target_logprobs, tlp, vocab, range);
  ExpectPerRow("entropy", out.entropy, ent, vocab, range);
  ExpectPerRow("reference_entropy", out.reference_entropy, ref_ent, vocab, range);
  ExpectPerRow("forward_kl", out.forward_kl, fkl, vocab, range);
  ExpectPerRow("reverse_kl", out.reverse_kl, rkl, vocab, range);
  ExpectPerRow("jsd", out.jsd, jsd, vocab, range);
  for (int64_t r = 0; r < n; ++r) {
    for (int k = 0; k < o.ids_per_row; ++k) {
      if (o.target_ids[r * o.ids_per_row + k] == o.ignore_index) {
        EXPECT_EQ(out.target_logprobs[r * o.ids_per_row + k], 0.0f) << "ignored id, row " << r;
      }
    }
  }

  // Top-k: each returned log-prob matches fp64 at its id; the list descends; and it is a valid
  // top-k: nothing left out beats the last one returned by more than the tolerance. (Exact id
  // equality would be flaky where two fp64 log-probs differ by less than the fp32 error.)
  ASSERT_EQ(out.top_k, static_cast<uint32_t>(o.top_k));
  ASSERT_EQ(out.top_k_ids.size(), static_cast<size_t>(n * o.top_k));
  ASSERT_EQ(out.top_k_logprobs.size(), static_cast<size_t>(n * o.top_k));
  for (int64_t r = 0; r < n && o.top_k > 0; ++r) {
    const std::vector<reference::TopKItem> want = reference::TopK(lps[r], o.top_k + 1);
    for (int k = 0; k < o.top_k; ++k) {
      const int32_t id = out.top_k_ids[r * o.top_k + k];
      const float lp = out.top_k_logprobs[r * o.top_k + k];
      ASSERT_GE(id, 0);
      ASSERT_LT(id, vocab);
      ExpectClose("top_k_logprobs", r * o.top_k + k, lp, lps[r][id], vocab, range);
      if (k > 0) {
        EXPECT_LE(lp, out.top_k_logprobs[r * o.top_k + k - 1]) << "row " << r;
      }
      const double kth = want[std::min<size_t>(o.top_k - 1, want.size() - 1)].logprob;
      EXPECT_GE(lps[r][id], kth - 2 * Fp32Tol(vocab, range, kth)) << "row " << r << " id " << id;
    }
  }

  if (!o.sequence_lengths.empty()) {
    ASSERT_TRUE(out.sequence_sums.has_value());
    const SequenceSumsOutput& sums = *out.sequence_sums;
    int64_t row = 0;
    for (size_t s = 0; s < o.sequence_lengths.size(); ++s) {
      double sum_ent = 0.0, sum_fkl = 0.0;
      int64_t count = 0;
      for (int64_t i = 0; i < o.sequence_lengths[s]; ++i, ++row) {
        bool all_ignored = o.ids_per_row > 0;
        for (int k = 0; k < o.ids_per_row; ++k) {
          all_ignored &= o.target_ids[row * o.ids_per_row + k] == o.ignore_index;
        }
        if (all_ignored) continue;
        ++count;
        if (o.entropy) sum_ent += ent[row];
        if (o.forward_kl) sum_fkl += fkl[row];
      }
      const double len = static_cast<double>(std::max<int64_t>(1, o.sequence_lengths[s]));
      ASSERT_LT(s, sums.token_count.size());
      EXPECT_EQ(sums.token_count[s], count) << "sequence " << s;
      // A sum of L fp32 values adds L u of relative error to L times the per-token tolerance.
      if (o.entropy) {
        EXPECT_NEAR(sums.entropy[s], sum_ent, len * Fp32Tol(vocab, range, sum_ent))
            << "entropy sum, sequence " << s;
      }
      if (o.forward_kl) {
        EXPECT_NEAR(sums.forward_kl[s], sum_fkl, len * Fp32Tol(vocab, range, sum_fkl))
            << "forward_kl sum, sequence " << s;
      }
    }
  }
}

}  // namespace logitserve::client::testing
