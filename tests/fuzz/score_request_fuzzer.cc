// libFuzzer target: a ScoreRequest from arbitrary bytes (protobuf parsing), then
// ValidateScoreRequest against a fixed set of fake heads, then the invariants a validated job
// promises the backends: every view lies inside the request's bytes, every target id is
// ignore_index or in [0, V), sizes match the heads and the limits. A broken invariant aborts (a
// crash for libFuzzer); AddressSanitizer checks every byte CheckHiddenStatesFinite reads.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "google/protobuf/stubs/logging.h"
#include "logitserve/v1/logitserve.pb.h"
#include "server/backend/backend.h"
#include "server/service/validate.h"

namespace logitserve {
namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "score_request_fuzzer: invariant broken: %s\n", what);
  std::abort();
}
#define FUZZ_CHECK(cond)      \
  do {                        \
    if (!(cond)) Fail(#cond); \
  } while (0)

// Heads named in the seed corpus: two with the same vocabulary (a model / reference pair), one
// tiny, one with an odd version.
const std::map<std::string, std::shared_ptr<const PreparedHead>>& Heads() {
  static const auto* heads = [] {
    auto* m = new std::map<std::string, std::shared_ptr<const PreparedHead>>;
    auto add = [&](const char* name, int64_t vocab, int64_t hidden, uint64_t version) {
      auto w = std::make_shared<HeadWeights>();
      w->name = name;
      w->vocab_size = vocab;
      w->hidden_size = hidden;
      w->version = version;
      w->source = "fuzz";
      (*m)[name] = std::make_shared<PreparedHead>(w);
    };
    add("policy", 1000, 16, 1);
    add("teacher", 1000, 8, 1);
    add("tiny", 17, 4, 7);
    return m;
  }();
  return *heads;
}

// True when [p, p + bytes) lies inside `s`.
bool Inside(const void* p, int64_t bytes, const std::string& s) {
  const char* c = static_cast<const char*>(p);
  return bytes >= 0 && c >= s.data() && c + bytes <= s.data() + s.size();
}

int64_t ElementBytes(kernels::FloatType t) { return t == kernels::FloatType::kFloat32 ? 4 : 2; }

void CheckInput(const DistributionInput& in, const v1::Tensor& hidden, const v1::Tensor& logits,
                int64_t rows, int64_t vocab) {
  if (in.hidden_mode()) {
    FUZZ_CHECK(in.hidden.rows == rows);
    FUZZ_CHECK(in.hidden.cols == in.head->weights().hidden_size);
    FUZZ_CHECK(vocab == in.head->weights().vocab_size);
    FUZZ_CHECK(Inside(in.hidden.data, rows * in.hidden.cols * ElementBytes(in.hidden.type),
                      hidden.data()) ||
               rows * in.hidden.cols == 0);
  } else {
    FUZZ_CHECK(!in.logits.empty() || rows == 0);
    FUZZ_CHECK(in.logits.rows == rows);
    FUZZ_CHECK(in.logits.cols == vocab);
    FUZZ_CHECK(Inside(in.logits.data, rows * vocab * ElementBytes(in.logits.type), logits.data()) ||
               rows * vocab == 0);
  }
}

}  // namespace
}  // namespace logitserve

// Protobuf logs every string field with invalid UTF-8 it parses (most mutated inputs): silence it,
// the parse result is what is checked.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace logitserve;
  v1::ScoreRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;

  RequestLimits limits;
  limits.max_top_k = 64;
  limits.max_tokens_per_request = 4096;
  limits.max_target_ids_per_row = 64;
  auto resolve = [](const std::string& name) -> std::shared_ptr<const PreparedHead> {
    auto it = Heads().find(name);
    return it == Heads().end() ? nullptr : it->second;
  };
  absl::StatusOr<ValidatedRequest> v = ValidateScoreRequest(request, resolve, limits);
  static const bool verbose = std::getenv("LOGITSERVE_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "validate: %s\n", v.status().ToString().c_str());
  if (!v.ok()) {
    // Only the documented codes, each with a message naming the field.
    const absl::StatusCode c = v.status().code();
    FUZZ_CHECK(c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kNotFound ||
               c == absl::StatusCode::kFailedPrecondition ||
               c == absl::StatusCode::kResourceExhausted);
    FUZZ_CHECK(!v.status().message().empty());
    return 0;
  }
  const ScoreJob& job = v->job;
  FUZZ_CHECK(job.rows >= 0 && job.rows <= limits.max_tokens_per_request);
  FUZZ_CHECK(job.vocab >= 1);
  FUZZ_CHECK(job.model.present());
  CheckInput(job.model, request.hidden(), request.logits(), job.rows, job.vocab);
  if (job.NeedsReference()) {
    FUZZ_CHECK(job.reference.present());
    CheckInput(job.reference, request.reference_hidden(), request.reference_logits(), job.rows,
               job.vocab);
  }
  FUZZ_CHECK(job.top_k >= 0 && job.top_k <= limits.max_top_k && job.top_k <= job.vocab);
  FUZZ_CHECK(job.ids_per_row >= 0 && job.ids_per_row <= limits.max_target_ids_per_row);
  FUZZ_CHECK(static_cast<int64_t>(job.target_ids.size()) == job.rows * job.ids_per_row);
  for (int32_t id : job.target_ids) {
    FUZZ_CHECK(id == job.ignore_index || (id >= 0 && id < job.vocab));
  }
  if (!v->sequence_lengths.empty()) {
    int64_t sum = 0;
    for (int64_t len : v->sequence_lengths) {
      FUZZ_CHECK(len >= 0);
      sum += len;
    }
    FUZZ_CHECK(sum == job.rows);
  }
  FUZZ_CHECK(std::isfinite(job.model.temperature) && job.model.temperature > 0);
  // Reads every hidden byte through the job's views (ASan: out of bounds = crash).
  const absl::Status finite = CheckHiddenStatesFinite(job);
  FUZZ_CHECK(finite.ok() || finite.code() == absl::StatusCode::kInvalidArgument);
  return 0;
}
