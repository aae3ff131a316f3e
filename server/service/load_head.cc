// ScorerService::LoadHead: the streaming head upload (admin role), on gRPC's callback API.
//
// Protocol (proto: LoadHeadRequest / HeadSpec / LoadHeadResponse): the first chunk carries the
// spec; weight bytes
// ([vocab, hidden] row-major in spec.dtype) then bias bytes ([vocab] in spec.dtype, only when
// spec.has_bias) follow in order, split over chunks any way the client likes.
//
// The reactor validates as the bytes arrive and fails the call at the first problem, before the
// rest of the upload is read:
//   - spec missing from the first chunk, or repeated later                  INVALID_ARGUMENT
//   - bad name, sizes out of range, non-float dtype, bad transform           INVALID_ARGUMENT
//   - weight + bias bytes over ServiceOptions::max_head_bytes                RESOURCE_EXHAUSTED
//   - an explicit spec.version above kMaxExplicitVersion                     INVALID_ARGUMENT
//   - an explicit spec.version not above the current version                 FAILED_PRECONDITION
//   - more weight / bias bytes than the spec declares, bias before the whole
//     weight, bias bytes without spec.has_bias                               INVALID_ARGUMENT
// and, once the client half-closes: exact byte counts, finite weights and bias
// (INVALID_ARGUMENT), Backend::PrepareHead, then the install: HeadStore::Add for a new name,
// HeadStore::Replace (atomic) for an existing one. Requests that already resolved the old head
// keep their shared_ptr to it and finish on the old weights. Nothing is installed when the upload
// fails, is cancelled or the client disconnects: the old head keeps serving.
//
// Memory: the weight bytes go straight into one buffer reserved at the declared size on the first
// chunk (the HeadWeights buffer itself, moved, never copied again); bias bytes into a [vocab]
// buffer, converted to fp32 at the end.
//
// Threads: gRPC runs OnReadDone on its callback threads, one reaction at a time per call, so
// the upload state needs no lock. The finishing work (finiteness scan, PrepareHead: seconds for a
// large head) runs on a thread of its own so that it never blocks gRPC's callback threads; it
// starts after the last read, so it is the state's only user from then on. Installs are
// serialised process-wide (install_mu) so that "version 0 = current + 1" cannot race with
// another upload of the same head, and so that two large uploads are never prepared (converted,
// sharded, copied to devices) at the same time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status_macros.h"
#include "common/wire/dtype.h"
#include "server/heads/head_loader.h"
#include "server/service/auth.h"
#include "server/service/metrics.h"
#include "server/service/service.h"
#include "server/service/status.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

using kernels::FloatType;

// Held from the version decision to the store update of every upload (see the file comment).
ABSL_CONST_INIT absl::Mutex install_mu(absl::kConstInit);

// The largest explicit spec.version: with versions below 2^63, "current + 1" can never reach
// 2^64 - 1 and wrap (a head there could not be replaced until restart).
constexpr uint64_t kMaxExplicitVersion = (uint64_t{1} << 63) - 1;

// A transform field of HeadSpec: 0 (proto3's unset) means `none`; anything else is kept for
// ValidateHeadTransform to judge (negative, NaN and inf are rejected there).
float OrNone(float value, float none) { return value == 0.0f ? none : value; }

class LoadHeadReactor final : public grpc::ServerReadReactor<v1::LoadHeadRequest> {
 public:
  LoadHeadReactor(grpc::CallbackServerContext* context, v1::LoadHeadResponse* response,
                  Backend* backend, HeadStore* heads, const ServiceOptions& options)
      : context_(context),
        response_(response),
        backend_(backend),
        heads_(heads),
        options_(options),
        start_(std::chrono::steady_clock::now()) {
    if (options_.authorizer != nullptr) {
      if (absl::Status s = options_.authorizer->Check(*context_, Role::kAdmin); !s.ok()) {
        FinishWith(s);
        return;
      }
    }
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close, cancellation or disconnect
      if (context_->IsCancelled()) {
        FinishWith(absl::CancelledError("LoadHead: the upload was cancelled; nothing installed"));
        return;
      }
      StartInstall();
      return;
    }
    if (absl::Status s = Accept(chunk_); !s.ok()) {
      FinishWith(s);
      return;
    }
    chunk_.Clear();
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  // Validates one chunk against what came before and appends its bytes.
  absl::Status Accept(const v1::LoadHeadRequest& chunk) {
    if (!started_) {
      if (!chunk.has_spec()) {
        return absl::InvalidArgumentError(
            "spec: required on the first LoadHeadRequest (name, sizes, dtype of the upload)");
      }
      LOGITSERVE_RETURN_IF_ERROR(Start(chunk.spec()));
      started_ = true;
    } else if (chunk.has_spec()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec: only the first LoadHeadRequest may carry it (head \"", head_->name, "\")"));
    }
    const std::string& weight = chunk.weight_data();
    const std::string& bias = chunk.bias_data();
    if (!weight.empty()) {
      const size_t room = weight_bytes_ - head_->weight.size();
      if (weight.size() > room) {
        return absl::InvalidArgumentError(absl::StrCat(
            "weight_data: more than the ", weight_bytes_, " bytes spec declares ([",
            head_->vocab_size, ", ", head_->hidden_size, "] ", FloatTypeName(head_->dtype),
            "): ", head_->weight.size() + weight.size(), " bytes so far"));
      }
      head_->weight.insert(head_->weight.end(), weight.begin(), weight.end());
    }
    if (!bias.empty()) {
      if (!has_bias_) {
        return absl::InvalidArgumentError(
            "bias_data: sent, but spec.has_bias is false (set it to upload a bias)");
      }
      if (head_->weight.size() != weight_bytes_) {
        return absl::InvalidArgumentError(
            absl::StrCat("bias_data: sent before all weight_data (", head_->weight.size(), " of ",
                         weight_bytes_, " weight bytes so far); the bias follows the weight"));
      }
      const size_t room = bias_bytes_ - bias_.size();
      if (bias.size() > room) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bias_data: more than the ", bias_bytes_, " bytes spec declares ([", head_->vocab_size,
            "] ", FloatTypeName(head_->dtype), "): ", bias_.size() + bias.size(), " bytes so far"));
      }
      bias_.insert(bias_.end(), bias.begin(), bias.end());
    }
    return absl::OkStatus();
  }

  // Checks the spec and reserves the buffers.
  absl::Status Start(const v1::HeadSpec& spec) {
    const auto field = [](const char* name, const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("spec.", name, ": ", s.message()));
    };
    if (absl::Status s = ValidateHeadName(spec.name()); !s.ok()) return field("name", s);
    const std::optional<FloatType> dtype = wire::FloatTypeOf(spec.dtype());
    if (!dtype.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.dtype: ", wire::DTypeName(spec.dtype()),
                       " is not a head weight type (FLOAT32, BFLOAT16 or FLOAT16)"));
    }
    if (spec.vocab_size() < 1 || spec.vocab_size() > kMaxHeadVocab) {
      return absl::InvalidArgumentError(absl::StrCat("spec.vocab_size: ", spec.vocab_size(),
                                                     " is outside [1, ", kMaxHeadVocab, "]"));
    }
    if (spec.hidden_size() < 1 || spec.hidden_size() > kMaxHeadHidden) {
      return absl::InvalidArgumentError(absl::StrCat("spec.hidden_size: ", spec.hidden_size(),
                                                     " is outside [1, ", kMaxHeadHidden, "]"));
    }
    HeadTransform transform;
    transform.logit_scale = OrNone(spec.logit_scale(), 1.0f);
    transform.logits_scaling = OrNone(spec.logits_scaling(), 1.0f);
    transform.softcap = spec.final_logit_softcapping();
    if (absl::Status s = ValidateHeadTransform(transform); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("spec.", s.message()));
    }
    // <= 2^24 * 2^17 * 4 + 2^24 * 4: no overflow.
    const int64_t size = kernels::SizeOf(*dtype);
    const int64_t weight_bytes = spec.vocab_size() * spec.hidden_size() * size;
    const int64_t bias_bytes = spec.has_bias() ? spec.vocab_size() * size : 0;
    const int64_t limit = std::min(options_.max_head_bytes, kMaxHeadWeightBytes);
    if (weight_bytes + bias_bytes > limit) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "spec: [", spec.vocab_size(), ", ", spec.hidden_size(), "] ", FloatTypeName(*dtype),
          spec.has_bias() ? " weight and bias are " : " weight is ", weight_bytes + bias_bytes,
          " bytes, over the server's limit of ", limit, " bytes"));
    }
    // An explicit version that cannot win is refused before the upload (and again at install,
    // in case another upload got there first).
    if (spec.version() > kMaxExplicitVersion) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.version: ", spec.version(), " is above the largest version an upload may set (",
          kMaxExplicitVersion, " = 2^63 - 1, so that current + 1 never wraps)"));
    }
    if (spec.version() != 0) {
      LOGITSERVE_RETURN_IF_ERROR(CheckExplicitVersion(spec.name(), spec.version()));
    }

    head_ = std::make_shared<HeadWeights>();
    head_->name = spec.name();
    head_->vocab_size = spec.vocab_size();
    head_->hidden_size = spec.hidden_size();
    head_->dtype = *dtype;
    head_->transform = transform;
    head_->source = absl::StrCat("LoadHead from ", context_->peer());
    requested_version_ = spec.version();
    has_bias_ = spec.has_bias();
    weight_bytes_ = static_cast<size_t>(weight_bytes);
    bias_bytes_ = static_cast<size_t>(bias_bytes);
    try {
      head_->weight.reserve(weight_bytes_);
      bias_.reserve(bias_bytes_);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "spec: cannot allocate ", weight_bytes + bias_bytes, " bytes for the upload"));
    }
    spdlog::info("LoadHead '{}': receiving [{}, {}] {}{} ({} bytes) from {}", head_->name,
                 head_->vocab_size, head_->hidden_size, std::string(FloatTypeName(*dtype)),
                 has_bias_ ? " with bias" : "", weight_bytes + bias_bytes, context_->peer());
    return absl::OkStatus();
  }

  absl::Status CheckExplicitVersion(const std::string& name, uint64_t version) const {
    const std::shared_ptr<const PreparedHead> current = heads_->Find(name);
    if (current == nullptr || version > current->weights().version) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "spec.version: ", version, " is not greater than head \"", name, "\"'s current version ",
        current->weights().version, " (use 0 for current + 1)"));
  }

  // After the half-close: hands the rest to a thread of its own.
  void StartInstall() {
    if (!started_) {
      FinishWith(
          absl::InvalidArgumentError("spec: the upload ended before its first LoadHeadRequest"));
      return;
    }
    try {
      std::thread(&LoadHeadReactor::Install, this).detach();
    } catch (const std::system_error&) {  // no thread to be had: finish on this one
      Install();
    }
  }

  // Checks the complete upload, prepares it and installs it; finishes the call. The reactor
  // stays alive until OnDone, which cannot come before Finish: `this` is valid throughout.
  void Install() {
    absl::Status status = Complete();
    if (status.ok()) status = PrepareAndInstall();
    if (status.ok()) {
      const HeadWeights& w = *head_;
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
              .count();
      spdlog::info("LoadHead '{}': version {} installed ([{}, {}] {}{}, {:.1f} ms)", w.name,
                   w.version, w.vocab_size, w.hidden_size, std::string(FloatTypeName(w.dtype)),
                   w.bias.empty() ? "" : " with bias", ms);
    }
    FinishWith(status);
  }

  // Exact sizes, the bias in fp32, finite values.
  absl::Status Complete() {
    if (head_->weight.size() != weight_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight_data: the upload ended after ", head_->weight.size(), " of ",
                       weight_bytes_, " bytes ([", head_->vocab_size, ", ", head_->hidden_size,
                       "] ", FloatTypeName(head_->dtype), "); nothing installed"));
    }
    if (bias_.size() != bias_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias_data: the upload ended after ", bias_.size(), " of ", bias_bytes_, " bytes ([",
          head_->vocab_size, "] ", FloatTypeName(head_->dtype), "); nothing installed"));
    }
    if (has_bias_) {
      head_->bias.resize(static_cast<size_t>(head_->vocab_size));
      for (int64_t j = 0; j < head_->vocab_size; ++j) {
        head_->bias[static_cast<size_t>(j)] = kernels::LoadAsFloat(head_->dtype, bias_.data(), j);
      }
      std::vector<uint8_t>().swap(bias_);
    }
    if (absl::Status s = CheckHeadFinite(head_->name, *head_); !s.ok()) {
      const bool in_bias = absl::StrContains(s.message(), "\": bias [");
      return absl::InvalidArgumentError(
          absl::StrCat(in_bias ? "bias_data: " : "weight_data: ", s.message()));
    }
    return absl::OkStatus();
  }

  absl::Status PrepareAndInstall() {
    absl::MutexLock lock(&install_mu);
    const std::shared_ptr<const PreparedHead> current = heads_->Find(head_->name);
    if (requested_version_ != 0) {
      if (absl::Status s = CheckExplicitVersion(head_->name, requested_version_); !s.ok()) {
        return s;
      }
      head_->version = requested_version_;
    } else {
      if (current != nullptr && current->weights().version == UINT64_MAX) {
        return absl::FailedPreconditionError(absl::StrCat(
            "spec.version: head \"", head_->name, "\" is at the largest version ", UINT64_MAX));
      }
      head_->version = current == nullptr ? 1 : current->weights().version + 1;
    }
    if (context_->IsCancelled()) {
      return absl::CancelledError("LoadHead: cancelled before the install; nothing installed");
    }
    const std::string name = head_->name;
    absl::StatusOr<std::shared_ptr<const PreparedHead>> prepared = backend_->PrepareHead(head_);
    if (!prepared.ok()) {
      return absl::Status(prepared.status().code(),
                          absl::StrCat("head \"", name, "\": ", prepared.status().message()));
    }
    if (context_->IsCancelled()) {
      return absl::CancelledError("LoadHead: cancelled before the install; nothing installed");
    }
    // Under install_mu nobody else installs, so Add cannot meet the name and Replace cannot
    // meet a newer version; their errors are still passed on rather than assumed away.
    if (current == nullptr) {
      LOGITSERVE_RETURN_IF_ERROR(heads_->Add(*prepared));
    } else {
      LOGITSERVE_RETURN_IF_ERROR(heads_->Replace(*prepared).status());
    }
    ScorerService::FillHeadInfo((*prepared)->weights(), *backend_, response_->mutable_head());
    return absl::OkStatus();
  }

  // Finishes the call with `status` (OK only from Install), counted in the metrics. Called
  // exactly once per call.
  void FinishWith(const absl::Status& status) {
    if (!status.ok()) {
      spdlog::warn("LoadHead '{}' failed, nothing installed: {}",
                   head_ == nullptr ? std::string("?") : head_->name,
                   std::string(status.message()));
    }
    if (options_.metrics != nullptr) {
      options_.metrics->RecordRequest("LoadHead", static_cast<grpc::StatusCode>(status.code()));
    }
    Finish(ToGrpcStatus(status));
  }

  grpc::CallbackServerContext* const context_;
  v1::LoadHeadResponse* const response_;
  Backend* const backend_;
  HeadStore* const heads_;
  const ServiceOptions& options_;
  const std::chrono::steady_clock::time_point start_;

  v1::LoadHeadRequest chunk_;  // the message being read
  bool started_ = false;       // the spec was accepted
  std::shared_ptr<HeadWeights> head_;
  uint64_t requested_version_ = 0;
  bool has_bias_ = false;
  size_t weight_bytes_ = 0;    // declared
  size_t bias_bytes_ = 0;      // declared (0 without a bias)
  std::vector<uint8_t> bias_;  // bias bytes in the spec's dtype, until converted
};

}  // namespace

grpc::ServerReadReactor<v1::LoadHeadRequest>* ScorerService::LoadHead(
    grpc::CallbackServerContext* context, v1::LoadHeadResponse* response) {
  return new LoadHeadReactor(context, response, backend_, heads_, options_);
}

}  // namespace logitserve
