// ShutdownSignals: SIGTERM / SIGINT for the server's whole life, start-up included.
//
// The signals are blocked in every thread (Block(), before any thread exists) and taken by one
// watcher thread with sigwait, so no work ever runs in a signal handler:
//   - while the server is starting (heads loading; nothing admitted yet), the first signal ends
//     the process at once with exit code 0: there is nothing to drain, and a head load can take
//     minutes that an orchestrator's grace period does not have;
//   - once serving (MarkServing), the first signal is reported to the main loop (Wait), which
//     drains;
//   - any second signal ends the process at once: with kExitForced when work is still in flight
//     (SetWorkInFlight; it is abandoned, clients see the connection close and retry elsewhere),
//     with 0 when the drain had nothing left but closing connections.
// The two immediate exits use _exit on purpose, like the fatal-device path: other threads may be
// blocked in I/O or in a kernel, and nothing of the process's state needs saving.
//
// Lifetime: the watcher thread is detached and may take a signal after main has returned (a
// second SIGTERM while the process exits), so the state it touches lives in a shared State that
// the thread co-owns, never in this object; once this object is destroyed, signals are ignored
// (the process is exiting with main's own code).
//
// Thread safety: Block and Start once, from the main thread; the rest from any thread.
#pragma once

#include <signal.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace logitserve {

class ShutdownSignals {
 public:
  // Exit code of a second signal that abandons work in flight.
  static constexpr int kExitForced = 4;

  // Blocks SIGTERM and SIGINT in the calling thread (inherited by threads created later).
  static void Block();

  ShutdownSignals() = default;
  ~ShutdownSignals();  // from now on the watcher ignores signals (it may sigwait forever)
  ShutdownSignals(const ShutdownSignals&) = delete;
  ShutdownSignals& operator=(const ShutdownSignals&) = delete;

  // Starts the watcher thread. REQUIRES: Block() ran in this thread before any other thread.
  void Start();
  // From now on a first signal drains instead of exiting.
  void MarkServing();
  // How much work is in flight, asked (under this object's lock) when a second signal arrives;
  // empty = none. Reset it to empty before what it reads goes away.
  void SetWorkInFlight(std::function<int64_t()> in_flight);
  // The first signal received once serving (SIGTERM / SIGINT), or 0 after `timeout` without one.
  int Wait(absl::Duration timeout);

 private:
  struct State {
    absl::Mutex mu;
    bool serving ABSL_GUARDED_BY(mu) = false;
    bool exiting ABSL_GUARDED_BY(mu) = false;  // the ShutdownSignals object is gone
    int first_signal ABSL_GUARDED_BY(mu) = 0;
    int received ABSL_GUARDED_BY(mu) = 0;
    std::function<int64_t()> in_flight ABSL_GUARDED_BY(mu);
  };
  static void WatchLoop(const std::shared_ptr<State>& state);

  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace logitserve
