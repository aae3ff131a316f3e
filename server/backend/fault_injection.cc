#include "server/backend/fault_injection.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/forwarding_backend.h"

namespace logitserve {

namespace {

class FaultInjectingBackend final : public ForwardingBackend {
 public:
  FaultInjectingBackend(std::unique_ptr<Backend> inner, int64_t fatal_after, int64_t slow_tile_ms)
      : ForwardingBackend(std::move(inner)),
        fatal_after_(fatal_after),
        slow_tile_ms_(slow_tile_ms) {}

  absl::Status Health() const override {
    absl::MutexLock lock(&mu_);
    return fatal_.ok() ? inner().Health() : fatal_;
  }

  absl::Status Score(const ScoreJob& job, ScoreResult* result) override {
    if (fatal_after_ >= 0 && calls_.fetch_add(1) >= fatal_after_) {
      absl::MutexLock lock(&mu_);
      fatal_ = absl::InternalError("injected fatal device error (--test-fault fatal-after)");
      return fatal_;
    }
    if (slow_tile_ms_ <= 0) return inner().Score(job, result);
    ScoreJob slow = job;
    // MS per 64 rows of the tile, so a request takes as long on every backend whatever its tile
    // size (64 rows on the CPU, 512 or more on CUDA); tests then reason about rows, not tiles.
    slow.stop = [&job, ms = slow_tile_ms_](int64_t tile_rows) {
      const int64_t units = std::max<int64_t>(1, (tile_rows + 63) / 64);
      std::this_thread::sleep_for(std::chrono::milliseconds(ms * units));
      return job.CheckStop(tile_rows);
    };
    return inner().Score(slow, result);
  }

 private:
  const int64_t fatal_after_;  // -1 = never
  const int64_t slow_tile_ms_;
  std::atomic<int64_t> calls_{0};
  mutable absl::Mutex mu_;
  absl::Status fatal_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

TestFaultSpec::Kind TestFaultKind(const std::string& spec) {
  using Kind = TestFaultSpec::Kind;
  const absl::string_view kind = absl::string_view(spec).substr(0, spec.find(':'));
  if (kind == "fatal-after") return Kind::kFatalAfter;
  if (kind == "slow-tile") return Kind::kSlowTile;
  if (kind == "slow-load") return Kind::kSlowLoad;
  if (kind == "skip-collective") return Kind::kSkipCollective;
  if (kind == "stall") return Kind::kStall;
  if (kind == "sticky-error") return Kind::kStickyError;
  return Kind::kNone;
}

absl::StatusOr<TestFaultSpec> ParseTestFault(const std::string& spec) {
  TestFaultSpec f;
  if (spec.empty()) return f;
  f.kind = TestFaultKind(spec);
  const size_t colon = spec.find(':');
  if (f.kind == TestFaultSpec::Kind::kNone) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--test-fault '", spec, "': unknown fault '", absl::string_view(spec).substr(0, colon),
        "' (fatal-after, slow-tile, slow-load, skip-collective, stall, sticky-error)"));
  }
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(spec).substr(colon + 1), &f.value) || f.value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--test-fault '", spec, "': expected KIND:VALUE with VALUE an integer >= 0"));
  }
  return f;
}

absl::StatusOr<std::unique_ptr<Backend>> WrapWithTestFault(std::unique_ptr<Backend> backend,
                                                           const std::string& spec) {
  using Kind = TestFaultSpec::Kind;
  const Kind kind = TestFaultKind(spec);
  absl::StatusOr<TestFaultSpec> f = ParseTestFault(spec);
  if (kind != Kind::kFatalAfter && kind != Kind::kSlowTile) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--test-fault '", spec, "': unknown fault '",
        absl::string_view(spec).substr(0, spec.find(':')), "' (fatal-after, slow-tile)"));
  }
  if (!f.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--test-fault '", spec, "': expected fatal-after:N or slow-tile:MS (N, MS >= 0)"));
  }
  if (kind == Kind::kFatalAfter) {
    return std::unique_ptr<Backend>(new FaultInjectingBackend(std::move(backend), f->value, 0));
  }
  return std::unique_ptr<Backend>(new FaultInjectingBackend(std::move(backend), -1, f->value));
}

bool IsCudaTestFault(const std::string& spec) {
  TestFaultSpec f;
  f.kind = TestFaultKind(spec);
  return f.cuda() && spec.find(':') != std::string::npos;
}

std::chrono::milliseconds SlowLoadDelay(const std::string& spec) {
  absl::StatusOr<TestFaultSpec> f = ParseTestFault(spec);
  if (!f.ok() || f->kind != TestFaultSpec::Kind::kSlowLoad) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(f->value);
}

}  // namespace logitserve
