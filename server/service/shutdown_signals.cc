#include "server/service/shutdown_signals.h"

#include <pthread.h>
#include <unistd.h>

#include <utility>

#include "spdlog/spdlog.h"

namespace logitserve {

namespace {

sigset_t ShutdownSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

const char* SignalName(int sig) { return sig == SIGTERM ? "SIGTERM" : "SIGINT"; }

}  // namespace

void ShutdownSignals::Block() {
  const sigset_t set = ShutdownSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

ShutdownSignals::~ShutdownSignals() = default;

void ShutdownSignals::Start() {
  // Detached: the thread only ever ends the process or waits; joining it would need a signal.
  // It touches `this` only under mu_, and the object lives in Run's frame until main returns.
  std::thread([this] { WatchLoop(); }).detach();
}

void ShutdownSignals::MarkServing() {
  absl::MutexLock lock(&mu_);
  serving_ = true;
}

void ShutdownSignals::SetWorkInFlight(std::function<int64_t()> in_flight) {
  absl::MutexLock lock(&mu_);
  in_flight_ = std::move(in_flight);
}

int ShutdownSignals::Wait(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const auto got = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return first_signal_ != 0; };
  mu_.AwaitWithTimeout(absl::Condition(&got), timeout);
  return first_signal_;
}

void ShutdownSignals::WatchLoop() {
  const sigset_t set = ShutdownSet();
  while (true) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    bool exit_now = false;
    bool was_serving = false;
    int code = 0;
    {
      absl::MutexLock lock(&mu_);
      ++received_;
      was_serving = serving_;
      if (!serving_) {
        exit_now = true;  // still starting: nothing admitted, nothing to drain
      } else if (received_ >= 2) {
        exit_now = true;
        code = in_flight_ && in_flight_() > 0 ? kExitForced : 0;
      } else {
        first_signal_ = sig;
      }
    }
    if (exit_now) {
      if (code == 0) {
        spdlog::warn("received {} while {}; exiting now", SignalName(sig),
                     was_serving ? "closing connections" : "starting");
      } else {
        spdlog::critical(
            "received {} again while draining; exiting now, abandoning in-flight "
            "work (exit {})",
            SignalName(sig), code);
      }
      spdlog::default_logger()->flush();
      _exit(code);
    }
  }
}

}  // namespace logitserve
