#include "tests/service/e2e_support.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference.h"
#include "server/heads/head_loader.h"

namespace logitserve::e2e {

namespace {

// fp32 unit roundoff.
constexpr double kU = 0x1p-24;
// Tolerances, per row (a row's outputs share its logits). With rounding errors of random sign,
// an fp32 sum of V positive terms errs relatively by about sqrt(V)·u, which bounds the error of
// log S and, scaled by the spread of z - M, of the weighted means W/S that entropy and KL use:
// sqrt(V)·u·(1 + range(z)). Logits computed from hidden states carry the fp32 dot-product error,
// at most H·u·max_j sum_i |h_i W_ji|. Every output combines at most kTermsPerOutput such terms
// (M, L and a weighted mean, for up to two distributions).
constexpr double kTermsPerOutput = 8.0;
// Floor for outputs whose every term vanishes (one-hot rows): a few ulps of an O(1) value.
constexpr double kAbsFloor = 1e-6;

kernels::FloatType FloatTypeOf(v1::DType dtype) {
  switch (dtype) {
    case v1::BFLOAT16:
      return kernels::FloatType::kBFloat16;
    case v1::FLOAT16:
      return kernels::FloatType::kFloat16;
    default:
      return kernels::FloatType::kFloat32;
  }
}

MatrixView ViewOf(const v1::Tensor& t) {
  return MatrixView{FloatTypeOf(t.dtype()), t.shape(0), t.shape(1), t.data().data()};
}

std::vector<int32_t> IdsOf(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) {
    if (t.dtype() == v1::INT64) {
      int64_t v;
      std::memcpy(&v, t.data().data() + 8 * i, 8);
      ids[i] = static_cast<int32_t>(v);
    } else {
      std::memcpy(&ids[i], t.data().data() + 4 * i, 4);
    }
  }
  return ids;
}

// The job the request describes, built directly from its fields (the test's own reading of the
// contract, not the service's validation code).
ScoreJob JobOf(const v1::ScoreRequest& r,
               const std::map<std::string, std::shared_ptr<const PreparedHead>>& heads) {
  ScoreJob job;
  auto side = [&](const std::string& head, const v1::Tensor& hidden, bool has_hidden,
                  const v1::Tensor& logits, float temperature, DistributionInput* in) {
    in->temperature = temperature;
    if (has_hidden) {
      in->head = heads.at(head);
      in->hidden = ViewOf(hidden);
      job.rows = hidden.shape(0);
      job.vocab = in->head->weights().vocab_size;
    } else {
      in->logits = ViewOf(logits);
      job.rows = logits.shape(0);
      job.vocab = logits.shape(1);
    }
  };
  job.forward_kl = r.forward_kl();
  job.reverse_kl = r.reverse_kl();
  job.reference_entropy = r.reference_entropy();
  if (r.has_jsd_beta()) job.jsd_beta = r.jsd_beta();
  if (job.NeedsReference()) {
    side(r.reference_head(), r.reference_hidden(), r.has_reference_hidden(), r.reference_logits(),
         r.has_reference_temperature() ? r.reference_temperature() : 1.0f, &job.reference);
  }
  side(r.head(), r.hidden(), r.has_hidden(), r.logits(),
       r.has_temperature() ? r.temperature() : 1.0f, &job.model);
  job.entropy = r.entropy();
  job.top_k = static_cast<int32_t>(r.top_k());
  job.ignore_index = r.has_ignore_index() ? r.ignore_index() : -100;
  if (r.has_target_ids()) {
    job.target_ids = IdsOf(r.target_ids());
    job.ids_per_row =
        r.target_ids().shape_size() == 2 ? static_cast<int32_t>(r.target_ids().shape(1)) : 1;
  }
  return job;
}

double RowTolerance(const ScoreJob& job, int64_t row) {
  double terms = 0.0;
  for (const DistributionInput* in : {&job.model, &job.reference}) {
    if (!in->present()) continue;
    const std::vector<double> z = reference::RowLogits(*in, row, job.vocab);
    double hi = -std::numeric_limits<double>::infinity();
    double lo = std::numeric_limits<double>::infinity();
    for (double v : z) {
      if (std::isfinite(v)) {
        hi = std::max(hi, v);
        lo = std::min(lo, v);
      }
    }
    const double range = hi >= lo ? hi - lo : 0.0;
    terms += std::sqrt(static_cast<double>(job.vocab)) * kU * (1.0 + range);
    if (in->hidden_mode()) {
      terms += static_cast<double>(in->head->weights().hidden_size) * kU *
               reference::HiddenDotMagnitude(*in, row, job.vocab) / in->temperature;
    }
  }
  return kAbsFloor + kTermsPerOutput * terms;
}

void ExpectValue(float got, double want, double tol, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what << ": got " << got << ", want NaN";
  } else if (std::isinf(want)) {
    EXPECT_EQ(got, static_cast<float>(want)) << what;
  } else {
    // Plus the final rounding of the output to fp32.
    EXPECT_NEAR(got, want, tol + 2 * kU * std::abs(want)) << what;
  }
}

void ExpectPerRow(const std::string& name, const google::protobuf::RepeatedField<float>& got,
                  const std::vector<double>& want, const std::vector<double>& tol) {
  ASSERT_EQ(static_cast<size_t>(got.size()), want.size()) << name;
  for (size_t r = 0; r < want.size(); ++r) {
    ExpectValue(got[static_cast<int>(r)], want[r], tol[r], absl::StrCat(name, "[", r, "]"));
  }
}

}  // namespace

std::string SyntheticHead::Flag() const {
  return absl::StrCat(name, ":vocab=", vocab, ",hidden=", hidden, ",seed=", seed);
}

std::shared_ptr<const PreparedHead> ReferenceHead(const SyntheticHead& head) {
  absl::StatusOr<std::shared_ptr<HeadWeights>> w =
      MakeSyntheticHead(head.name, head.vocab, head.hidden, head.seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return std::make_shared<PreparedHead>(*std::move(w));
}

std::shared_ptr<grpc::Channel> Connect(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

grpc::Status CallScore(v1::Scorer::Stub& stub, const v1::ScoreRequest& request,
                       v1::ScoreResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return stub.Score(&context, request, response);
}

void ExpectMatchesReference(
    const v1::ScoreRequest& request, const v1::ScoreResponse& response,
    const std::map<std::string, std::shared_ptr<const PreparedHead>>& heads) {
  const ScoreJob job = JobOf(request, heads);
  const reference::ReferenceResult want = reference::ScoreReference(job);
  const int64_t n = job.rows;
  std::vector<double> tol(n);
  for (int64_t r = 0; r < n; ++r) tol[r] = RowTolerance(job, r);

  EXPECT_EQ(response.request_id(), request.request_id());
  EXPECT_EQ(response.target_ids_per_row(), static_cast<uint32_t>(job.ids_per_row));
  EXPECT_EQ(response.top_k(), static_cast<uint32_t>(job.top_k));
  EXPECT_GE(response.queue_us(), 0);
  EXPECT_GE(response.compute_us(), 0);

  // Target log-probabilities; ignored ids are exactly 0.
  const int64_t k = job.ids_per_row;
  ASSERT_EQ(response.target_logprobs_size(), n * k);
  for (int64_t i = 0; i < n * k; ++i) {
    const std::string what = absl::StrCat("target_logprobs[", i / std::max<int64_t>(k, 1), ", ",
                                          i % std::max<int64_t>(k, 1), "]");
    if (job.target_ids[i] == job.ignore_index) {
      EXPECT_EQ(response.target_logprobs(i), 0.0f) << what;
    } else {
      ExpectValue(response.target_logprobs(i), want.target_logprobs[i], tol[i / k], what);
    }
  }

  // Top-k: the i-th value matches the i-th largest reference log-probability; the id matches
  // the reference's unless its neighbour is within tolerance (a near tie may order either way),
  // and in any case the returned id has that log-probability.
  ASSERT_EQ(response.top_k_ids_size(), n * job.top_k);
  ASSERT_EQ(response.top_k_logprobs_size(), n * job.top_k);
  for (int64_t r = 0; r < n && job.top_k > 0; ++r) {
    const std::vector<double> lp =
        reference::LogSoftmax(reference::RowLogits(job.model, r, job.vocab));
    for (int64_t i = 0; i < job.top_k; ++i) {
      const int64_t at = r * job.top_k + i;
      const std::string what = absl::StrCat("top_k[", r, ", ", i, "]");
      const int32_t id = response.top_k_ids(static_cast<int>(at));
      ASSERT_GE(id, 0) << what;
      ASSERT_LT(id, job.vocab) << what;
      ExpectValue(response.top_k_logprobs(static_cast<int>(at)), want.top_k_logprobs[at], tol[r],
                  what);
      ExpectValue(response.top_k_logprobs(static_cast<int>(at)), lp[id], tol[r],
                  what + " (lp of the returned id)");
      const double v = want.top_k_logprobs[at];
      // Masked (-inf) and undefined (NaN, all-masked row) entries may come in any id order.
      if (!std::isfinite(v)) continue;
      const bool near_prev = i > 0 && std::abs(want.top_k_logprobs[at - 1] - v) <= 2 * tol[r];
      const bool near_next =
          i + 1 < job.top_k && std::abs(want.top_k_logprobs[at + 1] - v) <= 2 * tol[r];
      if (!near_prev && !near_next) {
        EXPECT_EQ(id, want.top_k_ids[at]) << what;
      }
    }
  }

  ExpectPerRow("entropy", response.entropy(), want.entropy, tol);
  ExpectPerRow("reference_entropy", response.reference_entropy(), want.reference_entropy, tol);
  ExpectPerRow("forward_kl", response.forward_kl(), want.forward_kl, tol);
  ExpectPerRow("reverse_kl", response.reverse_kl(), want.reverse_kl, tol);
  ExpectPerRow("jsd", response.jsd(), want.jsd, tol);

  // Per-sequence sums of the reference values, with the contract's row exclusion.
  if (request.sequence_lengths_size() == 0) {
    EXPECT_FALSE(response.has_sequence_sums());
    return;
  }
  const v1::SequenceSums& sums = response.sequence_sums();
  const int s_count = request.sequence_lengths_size();
  ASSERT_EQ(sums.token_count_size(), s_count);
  int64_t row = 0;
  for (int s = 0; s < s_count; ++s) {
    const int64_t len = request.sequence_lengths(s);
    int64_t count = 0;
    double sum_tol = 0.0;
    std::vector<double> t_sum(k, 0.0);
    double e = 0, re = 0, fk = 0, rk = 0, js = 0;
    for (int64_t r = row; r < row + len; ++r) {
      bool all_ignored = k > 0;
      for (int64_t c = 0; c < k; ++c) all_ignored &= job.target_ids[r * k + c] == job.ignore_index;
      if (all_ignored) continue;
      ++count;
      sum_tol += tol[r];
      for (int64_t c = 0; c < k; ++c) {
        if (job.target_ids[r * k + c] != job.ignore_index)
          t_sum[c] += want.target_logprobs[r * k + c];
      }
      if (job.entropy) e += want.entropy[r];
      if (job.reference_entropy) re += want.reference_entropy[r];
      if (job.forward_kl) fk += want.forward_kl[r];
      if (job.reverse_kl) rk += want.reverse_kl[r];
      if (job.jsd_beta.has_value()) js += want.jsd[r];
    }
    const std::string at = absl::StrCat("sequence ", s);
    EXPECT_EQ(sums.token_count(s), count) << at;
    ASSERT_EQ(sums.target_logprobs_size(), s_count * k);
    for (int64_t c = 0; c < k; ++c) {
      ExpectValue(sums.target_logprobs(static_cast<int>(s * k + c)), t_sum[c], sum_tol,
                  at + " target_logprobs");
    }
    auto check = [&](bool wanted, const google::protobuf::RepeatedField<float>& got, double v,
                     const char* name) {
      if (!wanted) {
        EXPECT_EQ(got.size(), 0) << name;
        return;
      }
      ASSERT_EQ(got.size(), s_count) << name;
      ExpectValue(got[s], v, sum_tol, at + " " + name);
    };
    check(job.entropy, sums.entropy(), e, "entropy");
    check(job.reference_entropy, sums.reference_entropy(), re, "reference_entropy");
    check(job.forward_kl, sums.forward_kl(), fk, "forward_kl");
    check(job.reverse_kl, sums.reverse_kl(), rk, "reverse_kl");
    check(job.jsd_beta.has_value(), sums.jsd(), js, "jsd");
    row += len;
  }
}

}  // namespace logitserve::e2e
