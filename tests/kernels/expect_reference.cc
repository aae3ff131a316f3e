#include "tests/kernels/expect_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "tests/reference/job_reference.h"

namespace logitserve::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::mutex& StatsMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, double>& Stats() {
  static std::map<std::string, double> stats;
  return stats;
}

class ErrorSummary : public ::testing::Environment {
 public:
  void TearDown() override {
    std::lock_guard<std::mutex> lock(StatsMutex());
    if (Stats().empty()) return;
    std::printf("[ tolerance ] largest |got - ref| / tol per output:\n");
    for (const auto& [name, ratio] : Stats()) {
      std::printf("[ tolerance ]   %-18s %.3g\n", name.c_str(), ratio);
    }
  }
};
[[maybe_unused]] ::testing::Environment* const kErrorSummary =
    ::testing::AddGlobalTestEnvironment(new ErrorSummary);

double LogV(int64_t vocab) { return std::log(static_cast<double>(std::max<int64_t>(vocab, 1))); }

// Reports at most kMaxReports failures per output kind and job, then counts the rest.
class Reporter {
 public:
  static constexpr int kMaxReports = 4;
  // `unit` names what the row index counts in messages ("row", "sequence").
  explicit Reporter(const char* unit = "row") : unit_(unit) {}
  bool Check(const std::string& output, ::testing::AssertionResult r, int64_t row, int64_t col,
             const std::string& extra = "") {
    if (r) return true;
    int& n = failures_[output];
    if (++n <= kMaxReports) {
      ADD_FAILURE() << output << " " << unit_ << " " << row
                    << (col >= 0 ? " col " + std::to_string(col) : "") << ": " << r.message()
                    << extra;
    }
    return false;
  }
  void Fail(const std::string& output, int64_t row, const std::string& message) {
    Check(output, ::testing::AssertionFailure() << message, row, -1);
  }
  ~Reporter() {
    for (const auto& [output, n] : failures_) {
      if (n > kMaxReports) ADD_FAILURE() << output << ": " << n << " failures in all";
    }
  }

 private:
  const char* unit_;
  std::map<std::string, int> failures_;
};

::testing::AssertionResult NearRecorded(const std::string& output, float got, double ref,
                                        double tol) {
  ::testing::AssertionResult r = Near(got, ref, tol);
  if (r && std::isfinite(ref) && tol > 0.0) {
    RecordErrorRatio(output, std::abs(static_cast<double>(got) - ref) / tol);
  }
  return r;
}

template <typename T>
void ExpectSameBits(const std::string& output, const std::vector<T>& a, size_t a0,
                    const std::vector<T>& b, size_t b0, size_t n) {
  if (a.size() < a0 + n || b.size() < b0 + n) {
    ADD_FAILURE() << output << ": sizes " << a.size() << " / " << b.size() << " too small";
    return;
  }
  if (std::memcmp(a.data() + a0, b.data() + b0, n * sizeof(T)) == 0) return;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[a0 + i], &b[b0 + i], sizeof(T)) != 0) {
      if constexpr (std::is_same_v<T, float>) {
        ADD_FAILURE() << output << " element " << i << " differs: " << Bits(a[a0 + i]) << " vs "
                      << Bits(b[b0 + i]);
      } else {
        ADD_FAILURE() << output << " element " << i << " differs: " << a[a0 + i] << " vs "
                      << b[b0 + i];
      }
      return;
    }
  }
}

// `z` and `lp`: the row's reference logits and log-probabilities.
void CheckTopK(Reporter& rep, int64_t row, std::span<const double> z, std::span<const double> lp,
               const RowScale& scale, int64_t vocab, int32_t k, const int32_t* got_ids,
               const float* got_vals, const int32_t* ref_ids) {
  const std::string out = "top_k";
  std::set<int32_t> seen;
  for (int32_t i = 0; i < k; ++i) {
    const int32_t id = got_ids[i];
    if (id < 0 || id >= vocab) {
      rep.Fail(out, row,
               "id " + std::to_string(id) + " out of range at position " + std::to_string(i));
      return;
    }
    if (!seen.insert(id).second) {
      rep.Fail(out, row, "id " + std::to_string(id) + " returned twice");
      return;
    }
  }
  const bool undefined = std::any_of(lp.begin(), lp.end(), [](double x) { return std::isnan(x); });
  if (undefined) {  // all masked: every token ranks "masked", by id; values NaN
    for (int32_t i = 0; i < k; ++i) {
      rep.Check(out,
                ::testing::AssertionResult(got_ids[i] == ref_ids[i])
                    << "all-masked row: id " << got_ids[i] << " at " << i << ", want "
                    << ref_ids[i],
                row, i);
      rep.Check(out, NearRecorded(out, got_vals[i], lp[got_ids[i]], 0.0), row, i);
    }
    return;
  }
  auto tol = [&](int32_t id) { return LogprobTol(scale, vocab, lp[id]); };
  for (int32_t i = 0; i < k; ++i) {
    // Each returned value is the log-probability of the id returned with it.
    rep.Check(out, NearRecorded(out, got_vals[i], lp[got_ids[i]], tol(got_ids[i])), row, i,
              " (id " + std::to_string(got_ids[i]) + ")");
    // Descending, equal values by ascending id.
    if (i > 0) {
      const float prev = got_vals[i - 1];
      const float cur = got_vals[i];
      const bool ordered = prev > cur || (prev == cur && got_ids[i - 1] < got_ids[i]);
      rep.Check(out,
                ::testing::AssertionResult(ordered)
                    << "order broken: (" << got_ids[i - 1] << ", " << Bits(prev) << ") before ("
                    << got_ids[i] << ", " << Bits(cur) << ")",
                row, i);
    }
    // Position by position the same as the reference (a set that misses a clear top-k member
    // fails here), except between near-ties, whose order rounding may flip. A true tie is decided
    // by the contract instead: the smaller id, i.e. the reference's. True ties are equal logits
    // (equal in every arithmetic, so the fast path sees them equal too) and masked tokens (-inf
    // log-probability), which rank after every unmasked one in id order. Equal fp64
    // log-probabilities of different logits are not one: next to a +3e38 maximum, z - M rounds
    // every ordinary logit to the same -3e38 in fp64 (and fp32), while the exact order is z's.
    if (got_ids[i] != ref_ids[i]) {
      const double x = lp[got_ids[i]];
      const double y = lp[ref_ids[i]];
      const bool exact_tie = z[got_ids[i]] == z[ref_ids[i]] || (x == y && !std::isfinite(x));
      const bool near_tie = !exact_tie && std::isfinite(x) && std::isfinite(y) &&
                            std::abs(x - y) <= tol(got_ids[i]) + tol(ref_ids[i]);
      rep.Check(out,
                ::testing::AssertionResult(near_tie)
                    << "id " << got_ids[i] << " (ref lp " << x << ") where the reference has id "
                    << ref_ids[i] << " (ref lp " << y << ")"
                    << (exact_tie ? ": an exact tie goes to the smaller id" : ""),
                row, i);
    }
  }
}

}  // namespace

RowScale ScaleOf(const DistributionInput& input, std::span<const double> z, double dot_magnitude) {
  RowScale s;
  double m = -kInf;
  for (double x : z) {
    if (static_cast<float>(x) != -std::numeric_limits<float>::infinity()) m = std::max(m, x);
  }
  if (m == -kInf) return s;
  double max_abs = 0.0;
  for (double x : z) {
    if (reference::IsMasked(x, m)) continue;
    max_abs = std::max(max_abs, std::abs(x));
    s.max_centred = std::max(s.max_centred, std::min(m - x, kFp32ExpUnderflow));
  }
  if (input.hidden_mode()) {
    const HeadWeights& w = input.head->weights();
    const double gain = std::abs(static_cast<double>(w.transform.logit_scale) /
                                 w.transform.logits_scaling / input.temperature);
    double max_bias = 0.0;
    for (float b : w.bias) max_bias = std::max(max_bias, std::abs(static_cast<double>(b)));
    const double dot = dot_magnitude;
    // fp32 GEMM: |error| <= H u sum_i |h_i W_ji| (any summation order); the bias add and the
    // scale round once more each at |x| <= dot + bias; the softcap's slope is <= 1; the tanh,
    // the cap multiply and the temperature round relative to the final magnitude.
    s.input_error =
        (static_cast<double>(w.hidden_size) * dot + 2.0 * (dot + max_bias)) * kU * gain +
        kTransformRelTol * max_abs;
  } else if (input.temperature != 1.0f) {
    s.input_error = kU * max_abs;  // one correctly rounded fp32 division per logit
  }
  return s;
}

double LogprobTol(const RowScale& s, int64_t vocab, double ref) {
  return 3.0 * s.input_error + kSumRelTol + kU * (2.0 * LogV(vocab) + 3.0 * std::abs(ref));
}

double EntropyTol(const RowScale& s, int64_t vocab, double ref_h) {
  const double h = std::abs(ref_h);
  return kSumRelTol * (1.0 + 2.0 * h) + kU * LogV(vocab) + 2.0 * s.input_error * h + 2.0 * kU * h;
}

double KlTol(const RowScale& a, const RowScale& b, int64_t vocab, double h_a, double ref_kl) {
  const double e = std::max(a.input_error, b.input_error);
  const double kl = std::abs(ref_kl);
  const double h = std::abs(h_a);
  return kSumRelTol * (2.0 * h + kl + 2.0 + 2.0 * LogV(vocab)) + e * (4.0 * h + 2.0 * kl + 4.0) +
         kU * (2.0 * h + 2.0 * kl + 2.0 * LogV(vocab));
}

double JsdTol(const RowScale& s, const RowScale& t, int64_t vocab, double beta, double ref_jsd) {
  const double g = (1.0 - beta) * (1.0 - std::log1p(-beta)) + beta * (1.0 - std::log(beta));
  const double e = std::max(s.input_error, t.input_error);
  const double lp_err =
      3.0 * e + kSumRelTol + kU * (std::max(s.max_centred, t.max_centred) + LogV(vocab));
  // The GPU takes log m_j with lg2.approx (2^-22.6 absolute on [0.5, 2], 2 ulp elsewhere) times
  // ln 2: |error| <= 2^-22 + 4 u |log m_j|. JSD's derivative in log m_j is -m_j, so the sum moves
  // by at most 2^-22 + 4 u H(m) <= 2^-22 + 4 u log V.
  const double log_m_err = 0x1p-22 + 4.0 * kU * LogV(vocab);
  return g * (lp_err + kSumRelTol) + log_m_err + 2.0 * kU * std::abs(ref_jsd);
}

::testing::AssertionResult Near(float got, double ref, double tol) {
  if (std::isnan(ref)) {
    if (std::isnan(got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << Bits(got) << ", want NaN";
  }
  const float ref_f = static_cast<float>(ref);
  if (std::isinf(ref_f)) {
    if (got == ref_f) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << Bits(got) << ", want " << ref_f;
  }
  const double err = std::abs(static_cast<double>(got) - ref);
  if (std::isfinite(got) && err <= tol) return ::testing::AssertionSuccess();
  char buf[160];
  std::snprintf(buf, sizeof(buf), "got %.9g, want %.12g: |err| = %.3g > tol %.3g",
                static_cast<double>(got), ref, err, tol);
  return ::testing::AssertionFailure() << buf;
}

namespace {

// One row's reference values and the tolerance of each of its per-token outputs.
struct RowExpectation {
  reference::ReferenceRow ref;
  RowScale model;
  RowScale reference;
  std::vector<double> target_tol;  // [ids_per_row]
  double entropy_tol = 0.0;
  double reference_entropy_tol = 0.0;
  double forward_kl_tol = 0.0;
  double reverse_kl_tol = 0.0;
  double jsd_tol = 0.0;
};

RowExpectation ExpectRow(const ScoreJob& job, int64_t row) {
  const int64_t v = job.vocab;
  RowExpectation e;
  e.ref = reference::ScoreReferenceRow(job, row);
  const reference::ReferenceRow& ref = e.ref;
  e.model = ScaleOf(job.model, ref.logits, ref.dot_magnitude);
  e.reference = job.NeedsReference() ? ScaleOf(job.reference, ref.ref_logits, ref.ref_dot_magnitude)
                                     : RowScale{};
  const RowScale& sm = e.model;
  const RowScale& sr = e.reference;
  for (double want : ref.target_logprobs) e.target_tol.push_back(LogprobTol(sm, v, want));
  if (job.entropy) e.entropy_tol = EntropyTol(sm, v, ref.entropy);
  if (job.reference_entropy) e.reference_entropy_tol = EntropyTol(sr, v, ref.reference_entropy);
  // The KL tolerances need the entropy of the distribution that weights the sum.
  const bool need_h_model = job.reverse_kl || (job.jsd_beta.has_value() && *job.jsd_beta == 1.0f);
  const bool need_h_ref = job.forward_kl || (job.jsd_beta.has_value() && *job.jsd_beta == 0.0f);
  const double h_model = need_h_model ? reference::Entropy(ref.logprobs) : 0.0;
  const double h_ref = need_h_ref ? reference::Entropy(ref.ref_logprobs) : 0.0;
  // forward = KL(reference || model), reverse = KL(model || reference).
  if (job.forward_kl) e.forward_kl_tol = KlTol(sr, sm, v, h_ref, ref.forward_kl);
  if (job.reverse_kl) e.reverse_kl_tol = KlTol(sm, sr, v, h_model, ref.reverse_kl);
  if (job.jsd_beta.has_value()) {
    const double beta = *job.jsd_beta;
    if (beta == 0.0) {
      e.jsd_tol = KlTol(sr, sm, v, h_ref, ref.jsd);
    } else if (beta == 1.0) {
      e.jsd_tol = KlTol(sm, sr, v, h_model, ref.jsd);
    } else {
      e.jsd_tol = JsdTol(sm, sr, v, beta, ref.jsd);
    }
  }
  return e;
}

// Whether row `row` counts in its sequence's sums: unless the job has target ids and every id
// of the row is ignore_index (a prompt or padding row).
bool CountsInSums(const ScoreJob& job, int64_t row) {
  if (job.ids_per_row == 0) return true;
  for (int32_t k = 0; k < job.ids_per_row; ++k) {
    if (job.target_ids[row * job.ids_per_row + k] != job.ignore_index) return true;
  }
  return false;
}

}  // namespace

void ExpectMatchesReference(const ScoreJob& job, const ScoreResult& got) {
  const size_t rows = static_cast<size_t>(job.rows);
  const auto expect_size = [](const char* name, size_t got_size, bool requested, size_t per_row) {
    const size_t want = requested ? per_row : 0;
    EXPECT_EQ(got_size, want) << name << " has the wrong size";
    return got_size == want;
  };
  bool sizes_ok = true;
  sizes_ok &= expect_size("target_logprobs", got.target_logprobs.size(), job.ids_per_row > 0,
                          rows * std::max(job.ids_per_row, 0));
  sizes_ok &=
      expect_size("top_k_ids", got.top_k_ids.size(), job.top_k > 0, rows * std::max(job.top_k, 0));
  sizes_ok &= expect_size("top_k_logprobs", got.top_k_logprobs.size(), job.top_k > 0,
                          rows * std::max(job.top_k, 0));
  sizes_ok &= expect_size("entropy", got.entropy.size(), job.entropy, rows);
  sizes_ok &=
      expect_size("reference_entropy", got.reference_entropy.size(), job.reference_entropy, rows);
  sizes_ok &= expect_size("forward_kl", got.forward_kl.size(), job.forward_kl, rows);
  sizes_ok &= expect_size("reverse_kl", got.reverse_kl.size(), job.reverse_kl, rows);
  sizes_ok &= expect_size("jsd", got.jsd.size(), job.jsd_beta.has_value(), rows);
  if (!sizes_ok) return;

  const int64_t v = job.vocab;
  Reporter rep;
  std::vector<int32_t> ref_ids;
  for (size_t r = 0; r < rows; ++r) {
    const int64_t row = static_cast<int64_t>(r);
    const RowExpectation e = ExpectRow(job, row);
    const reference::ReferenceRow& ref = e.ref;
    for (int32_t k = 0; k < job.ids_per_row; ++k) {
      const size_t i = r * job.ids_per_row + k;
      const float g = got.target_logprobs[i];
      if (job.target_ids[i] == job.ignore_index) {
        rep.Check("target_logprobs",
                  ::testing::AssertionResult(g == 0.0f && !std::signbit(g))
                      << "ignored id: got " << Bits(g) << ", want exactly +0.0",
                  row, k);
      } else {
        rep.Check("target_logprobs",
                  NearRecorded("target_logprobs", g, ref.target_logprobs[k], e.target_tol[k]), row,
                  k, " (id " + std::to_string(job.target_ids[i]) + ")");
      }
    }
    if (job.top_k > 0) {
      const size_t i = r * job.top_k;
      ref_ids.clear();
      for (const reference::TopKItem& t : ref.top_k) ref_ids.push_back(t.id);
      CheckTopK(rep, row, ref.logits, ref.logprobs, e.model, v, job.top_k, &got.top_k_ids[i],
                &got.top_k_logprobs[i], ref_ids.data());
    }
    const auto per_row = [&](bool requested, const char* name, const std::vector<float>& values,
                             double want, double tol) {
      if (requested) rep.Check(name, NearRecorded(name, values[r], want, tol), row, -1);
    };
    per_row(job.entropy, "entropy", got.entropy, ref.entropy, e.entropy_tol);
    per_row(job.reference_entropy, "reference_entropy", got.reference_entropy,
            ref.reference_entropy, e.reference_entropy_tol);
    per_row(job.forward_kl, "forward_kl", got.forward_kl, ref.forward_kl, e.forward_kl_tol);
    per_row(job.reverse_kl, "reverse_kl", got.reverse_kl, ref.reverse_kl, e.reverse_kl_tol);
    per_row(job.jsd_beta.has_value(), "jsd", got.jsd, ref.jsd, e.jsd_tol);
  }
}

void ExpectSequenceSumsMatchReference(const ScoreJob& job, std::span<const int64_t> lengths,
                                      const ScoreResult& got, std::span<const int64_t> token_count,
                                      bool means) {
  const size_t s_count = lengths.size();
  const size_t k = static_cast<size_t>(std::max(job.ids_per_row, 0));
  const auto expect_size = [&](const char* name, size_t got_size, bool requested, size_t width) {
    const size_t want = requested ? s_count * width : 0;
    EXPECT_EQ(got_size, want) << "sequence sums of " << name << " have the wrong size";
    return got_size == want;
  };
  bool sizes_ok = true;
  sizes_ok &= expect_size("target_logprobs", got.target_logprobs.size(), k > 0, k);
  sizes_ok &= expect_size("entropy", got.entropy.size(), job.entropy, 1);
  sizes_ok &=
      expect_size("reference_entropy", got.reference_entropy.size(), job.reference_entropy, 1);
  sizes_ok &= expect_size("forward_kl", got.forward_kl.size(), job.forward_kl, 1);
  sizes_ok &= expect_size("reverse_kl", got.reverse_kl.size(), job.reverse_kl, 1);
  sizes_ok &= expect_size("jsd", got.jsd.size(), job.jsd_beta.has_value(), 1);
  sizes_ok &= expect_size("top_k_ids", got.top_k_ids.size(), false, 0);
  sizes_ok &= expect_size("top_k_logprobs", got.top_k_logprobs.size(), false, 0);
  sizes_ok &= expect_size("token_count", token_count.size(), true, 1);
  if (!sizes_ok) return;

  // One fp64 sum (with its tolerance) per output column of a sequence.
  struct Sum {
    double value = 0.0;
    double tol = 0.0;        // sum of the per-token tolerances
    double magnitude = 0.0;  // sum of |value| + tol: bounds |every partial sum| of the service
    void Add(double want, double token_tol) {
      value += want;
      if (std::isfinite(want)) {
        tol += token_tol;
        magnitude += std::abs(want) + token_tol;
      }
    }
  };
  Reporter rep("sequence");
  int64_t row = 0;
  for (size_t s = 0; s < s_count; ++s) {
    const int64_t seq = static_cast<int64_t>(s);
    std::vector<Sum> target(k);
    Sum entropy, reference_entropy, forward_kl, reverse_kl, jsd;
    int64_t count = 0;
    for (int64_t end = row + lengths[s]; row < end; ++row) {
      if (!CountsInSums(job, row)) continue;
      ++count;
      const RowExpectation e = ExpectRow(job, row);
      for (size_t c = 0; c < k; ++c) {
        // An ignored id contributes exactly 0.
        if (job.target_ids[row * k + c] != job.ignore_index) {
          target[c].Add(e.ref.target_logprobs[c], e.target_tol[c]);
        }
      }
      entropy.Add(e.ref.entropy, e.entropy_tol);
      reference_entropy.Add(e.ref.reference_entropy, e.reference_entropy_tol);
      forward_kl.Add(e.ref.forward_kl, e.forward_kl_tol);
      reverse_kl.Add(e.ref.reverse_kl, e.reverse_kl_tol);
      jsd.Add(e.ref.jsd, e.jsd_tol);
    }
    rep.Check("token_count",
              ::testing::AssertionResult(token_count[s] == count)
                  << "got " << token_count[s] << " counted rows, want " << count,
              seq, -1);
    // Each counted got_r is within its tolerance of ref_r, so |sum got - sum ref| <= sum tol_r.
    // The service adds the fp32 values in double (each add rounds by 2^-53 of a partial sum,
    // and every partial sum is <= `magnitude`) and rounds the total to fp32 once (u |total|).
    const auto check = [&](bool requested, const char* name, float value, const Sum& sum,
                           int64_t col) {
      if (!requested) return;
      const double tol = sum.tol + (static_cast<double>(count) * 0x1p-53 + kU) * sum.magnitude;
      if (!means) {
        rep.Check(std::string("sum of ") + name, Near(value, sum.value, tol), seq, col);
      } else if (count == 0) {
        rep.Check(std::string("mean of ") + name,
                  ::testing::AssertionResult(std::isnan(value))
                      << "a sequence without counted rows has mean " << value << ", want NaN",
                  seq, col);
      } else {
        // The double sum divided by the count, then rounded to fp32 once more (u |mean|).
        const double n = static_cast<double>(count);
        const double mean = sum.value / n;
        rep.Check(std::string("mean of ") + name,
                  Near(value, mean, tol / n + kU * (std::abs(mean) + tol / n)), seq, col);
      }
    };
    for (size_t c = 0; c < k; ++c) {
      check(true, "target_logprobs", got.target_logprobs[s * k + c], target[c],
            static_cast<int64_t>(c));
    }
    const auto at = [s](const std::vector<float>& v) { return v.empty() ? 0.0f : v[s]; };
    check(job.entropy, "entropy", at(got.entropy), entropy, -1);
    check(job.reference_entropy, "reference_entropy", at(got.reference_entropy), reference_entropy,
          -1);
    check(job.forward_kl, "forward_kl", at(got.forward_kl), forward_kl, -1);
    check(job.reverse_kl, "reverse_kl", at(got.reverse_kl), reverse_kl, -1);
    check(job.jsd_beta.has_value(), "jsd", at(got.jsd), jsd, -1);
  }
}

void ExpectBitwiseEqual(const ScoreResult& a, const ScoreResult& b) {
  auto same = [](const char* name, const auto& x, const auto& y) {
    if (x.size() != y.size()) {
      ADD_FAILURE() << name << ": sizes " << x.size() << " vs " << y.size();
      return;
    }
    ExpectSameBits(name, x, 0, y, 0, x.size());
  };
  same("target_logprobs", a.target_logprobs, b.target_logprobs);
  same("top_k_ids", a.top_k_ids, b.top_k_ids);
  same("top_k_logprobs", a.top_k_logprobs, b.top_k_logprobs);
  same("entropy", a.entropy, b.entropy);
  same("reference_entropy", a.reference_entropy, b.reference_entropy);
  same("forward_kl", a.forward_kl, b.forward_kl);
  same("reverse_kl", a.reverse_kl, b.reverse_kl);
  same("jsd", a.jsd, b.jsd);
}

void ExpectRowBitwiseEqual(const ScoreResult& a, int64_t row_a, const ScoreResult& b, int64_t row_b,
                           int32_t ids_per_row, int32_t top_k) {
  auto same = [&](const char* name, const auto& x, const auto& y, int64_t stride) {
    if (x.empty() && y.empty()) return;
    ExpectSameBits(name, x, static_cast<size_t>(row_a * stride), y,
                   static_cast<size_t>(row_b * stride), static_cast<size_t>(stride));
  };
  same("target_logprobs", a.target_logprobs, b.target_logprobs, ids_per_row);
  same("top_k_ids", a.top_k_ids, b.top_k_ids, top_k);
  same("top_k_logprobs", a.top_k_logprobs, b.top_k_logprobs, top_k);
  same("entropy", a.entropy, b.entropy, 1);
  same("reference_entropy", a.reference_entropy, b.reference_entropy, 1);
  same("forward_kl", a.forward_kl, b.forward_kl, 1);
  same("reverse_kl", a.reverse_kl, b.reverse_kl, 1);
  same("jsd", a.jsd, b.jsd, 1);
}

void RecordErrorRatio(const std::string& output, double ratio) {
  std::lock_guard<std::mutex> lock(StatsMutex());
  double& r = Stats()[output];
  r = std::max(r, ratio);
}

std::string Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g (0x%08x)", static_cast<double>(x), u);
  return buf;
}

}  // namespace logitserve::testing
