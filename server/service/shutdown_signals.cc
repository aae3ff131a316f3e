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

ShutdownSignals::~ShutdownSignals() {
  absl::MutexLock lock(&state_->mu);
  state_->exiting = true;
  state_->in_flight = nullptr;
}

void ShutdownSignals::Start() {
  // Detached: the thread only ever ends the process or waits; joining it would need a signal.
  // It co-owns the state, which therefore outlives this object (and main).
  std::thread([state = state_] { WatchLoop(state); }).detach();
}

void ShutdownSignals::MarkServing() {
  absl::MutexLock lock(&state_->mu);
  state_->serving = true;
}

void ShutdownSignals::SetWorkInFlight(std::function<int64_t()> in_flight) {
  absl::MutexLock lock(&state_->mu);
  state_->in_flight = std::move(in_flight);
}

int ShutdownSignals::Wait(absl::Duration timeout) {
  State& st = *state_;
  absl::MutexLock lock(&st.mu);
  const auto got = [&st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.first_signal != 0; };
  st.mu.AwaitWithTimeout(absl::Condition(&got), timeout);
  return st.first_signal;
}

void ShutdownSignals::WatchLoop(const std::shared_ptr<State>& state) {
  const sigset_t set = ShutdownSet();
  State& st = *state;
  while (true) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    bool exit_now = false;
    bool was_serving = false;
    int code = 0;
    {
      absl::MutexLock lock(&st.mu);
      if (st.exiting) continue;  // main has returned: the process is ending with its own code
      ++st.received;
      was_serving = st.serving;
      if (!st.serving) {
        exit_now = true;  // still starting: nothing admitted, nothing to drain
      } else if (st.received >= 2) {
        exit_now = true;
        code = st.in_flight && st.in_flight() > 0 ? kExitForced : 0;
      } else {
        st.first_signal = sig;
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
