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

absl::StatusOr<std::unique_ptr<Backend>> WrapWithTestFault(std::unique_ptr<Backend> backend,
                                                           const std::string& spec) {
  const size_t colon = spec.find(':');
  const absl::string_view kind = absl::string_view(spec).substr(0, colon);
  int64_t value = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(spec).substr(colon + 1), &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--test-fault '", spec, "': expected fatal-after:N or slow-tile:MS (N, MS >= 0)"));
  }
  if (kind == "fatal-after") {
    return std::unique_ptr<Backend>(new FaultInjectingBackend(std::move(backend), value, 0));
  }
  if (kind == "slow-tile") {
    return std::unique_ptr<Backend>(new FaultInjectingBackend(std::move(backend), -1, value));
  }
  return absl::InvalidArgumentError(absl::StrCat("--test-fault '", spec, "': unknown fault '", kind,
                                                 "' (fatal-after, slow-tile)"));
}

bool IsCudaTestFault(const std::string& spec) {
  for (const char* kind : {"skip-collective:", "stall:", "sticky-error:"}) {
    if (spec.rfind(kind, 0) == 0) return true;
  }
  return false;
}

std::chrono::milliseconds SlowLoadDelay(const std::string& spec) {
  constexpr char kSlowLoadFault[] = "slow-load:";
  int ms = 0;
  if (spec.rfind(kSlowLoadFault, 0) != 0) return std::chrono::milliseconds(0);
  if (!absl::SimpleAtoi(spec.substr(sizeof(kSlowLoadFault) - 1), &ms) || ms < 0) ms = 0;
  return std::chrono::milliseconds(ms);
}

}  // namespace logitserve
