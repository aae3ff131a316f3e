// ServerProcess: runs the real `logitserve` binary as a child process for end-to-end tests.
//
// Start() fork/execs the server with `--listen 127.0.0.1:0` plus the caller's arguments, waits
// (up to 30 s) for its `logitserve listening on HOST:PORT` line on stdout and exposes the address
// (and the metrics address from an earlier `logitserve metrics on HOST:PORT` line, if any).
// The child's stderr (its logs) goes to the test's stderr; the rest of its stdout is collected by
// a reader thread. The child is killed when the object is destroyed and when the thread that
// started it exits (PR_SET_PDEATHSIG: start servers from the test's main thread or a thread that
// outlives them), so a crashed or failing test never leaves a server behind.
//
// Thread safety: one thread owns a ServerProcess; address() and pid() are safe from any thread.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace logitserve::testing {

class ServerProcess {
 public:
  // The logitserve binary of this build tree: $LOGITSERVE_SERVER_BINARY when set, else
  // LOGITSERVE_BINARY_DIR/server/logitserve.
  static std::string DefaultBinary();

  // Starts `binary` (DefaultBinary() when empty) with --listen 127.0.0.1:0 (unless `args` hold
  // their own --listen) and `args`.
  // Fails (and reaps the child) when it exits or prints nothing within `timeout`; the error
  // carries the exit status and whatever it printed.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      std::vector<std::string> args, std::string binary = "",
      std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // Starts the binary like Start, with its stderr merged into the collected output, and returns
  // once a complete line containing `marker` has been printed (address() is empty when the
  // listening line has not come by then): for tests that act on the server before it listens.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> StartUntilOutput(
      std::vector<std::string> args, const std::string& marker,
      std::chrono::milliseconds timeout = std::chrono::seconds(30));

  struct ExitResult {
    int exit_code = 0;   // the exit status, or 128 + signal when killed
    std::string output;  // stdout and stderr, interleaved
  };
  // Runs the binary with --listen 127.0.0.1:0 and `args` to completion (killed after `timeout`);
  // for start-up failure tests.
  static absl::StatusOr<ExitResult> RunToExit(
      std::vector<std::string> args, std::string binary = "",
      std::chrono::milliseconds timeout = std::chrono::seconds(30));

  ~ServerProcess();  // SIGKILL and reap, if still running
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // "127.0.0.1:PORT", as printed by the server (empty: see StartUntilOutput).
  const std::string& address() const { return address_; }
  // "HOST:PORT" of the Prometheus endpoint from the server's `logitserve metrics on HOST:PORT`
  // line (printed before the listening line when --metrics-listen is given); empty otherwise.
  const std::string& metrics_address() const { return metrics_address_; }
  pid_t pid() const { return pid_; }

  // Sends `sig` and waits (up to `timeout`, then SIGKILL) for the exit; returns the exit status
  // (128 + signal when killed by one). Returns the same value when called again.
  int Stop(int sig = SIGTERM, std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // stdout the server wrote besides the listening and metrics lines (complete once it has
  // exited; with StartUntilOutput also its stderr).
  std::string output() const;

 private:
  ServerProcess(pid_t pid, int stdout_fd, std::string address);
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Launch(std::vector<std::string> args,
                                                               std::string binary,
                                                               std::chrono::milliseconds timeout,
                                                               bool merge_stderr,
                                                               const std::string& marker);
  void ReadRemainingOutput();

  const pid_t pid_;
  const int stdout_fd_;
  const std::string address_;
  std::string metrics_address_;  // set once by Start, before the object is shared
  bool reaped_ = false;
  int exit_code_ = -1;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string output_ ABSL_GUARDED_BY(mu_);
};

}  // namespace logitserve::testing
