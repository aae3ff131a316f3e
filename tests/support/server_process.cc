#include "tests/support/server_process.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"

#ifndef LOGITSERVE_BINARY_DIR
#error "LOGITSERVE_BINARY_DIR must name the build tree"
#endif

namespace logitserve::testing {

namespace {

using Clock = std::chrono::steady_clock;
constexpr char kListeningPrefix[] = "logitserve listening on ";
constexpr char kMetricsPrefix[] = "logitserve metrics on ";

// Removes the first complete `prefix...` line from `out` and returns what followed the prefix;
// "" when there is none.
std::string TakeLine(std::string& out, const char* prefix) {
  const size_t begin = out.find(prefix);
  if (begin == std::string::npos) return "";
  const size_t eol = out.find('\n', begin);
  if (eol == std::string::npos) return "";
  const size_t value = begin + std::strlen(prefix);
  std::string result = out.substr(value, eol - value);
  out.erase(begin, eol + 1 - begin);
  return result;
}

struct Child {
  pid_t pid;
  int fd;  // read end of the child's stdout (and stderr when merged)
};

// Forks and execs `binary --listen 127.0.0.1:0 args...` (without the --listen when `args` give
// their own).
absl::StatusOr<Child> Spawn(const std::string& binary, const std::vector<std::string>& args,
                            bool merge_stderr) {
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("no executable logitserve at ", binary));
  }
  std::vector<std::string> strings = {binary};
  if (std::find(args.begin(), args.end(), "--listen") == args.end()) {
    strings.insert(strings.end(), {"--listen", "127.0.0.1:0"});
  }
  strings.insert(strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    if (merge_stderr) dup2(fds[1], STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  return Child{pid, fds[0]};
}

int ExitCodeOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

// Waits up to `timeout` for `pid` to exit; returns its exit code, or nullopt if still running.
std::optional<int> WaitFor(pid_t pid, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return ExitCodeOf(status);
    if (r < 0 && errno != EINTR) return -1;
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int KillAndReap(pid_t pid) {
  kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return ExitCodeOf(status);
}

// Reads what is available on `fd` within `timeout_ms`: >0 bytes appended, 0 on EOF, -1 on
// timeout.
int ReadSome(int fd, int timeout_ms, std::string* out) {
  pollfd p{fd, POLLIN, 0};
  const int ready = poll(&p, 1, timeout_ms);
  if (ready == 0) return -1;
  if (ready < 0) return errno == EINTR ? 1 : 0;
  char buf[4096];
  const ssize_t n = read(fd, buf, sizeof(buf));
  if (n < 0) return errno == EINTR || errno == EAGAIN ? 1 : 0;
  out->append(buf, static_cast<size_t>(n));
  return static_cast<int>(n);
}

int RemainingMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

}  // namespace

std::string ServerProcess::DefaultBinary() {
  if (const char* env = std::getenv("LOGITSERVE_SERVER_BINARY"); env != nullptr && *env != 0) {
    return env;
  }
  return std::string(LOGITSERVE_BINARY_DIR) + "/server/logitserve";
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    std::vector<std::string> args, std::string binary, std::chrono::milliseconds timeout) {
  return Launch(std::move(args), std::move(binary), timeout, /*merge_stderr=*/false,
                kListeningPrefix);
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::StartUntilOutput(
    std::vector<std::string> args, const std::string& marker, std::chrono::milliseconds timeout) {
  return Launch(std::move(args), "", timeout, /*merge_stderr=*/true, marker);
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Launch(
    std::vector<std::string> args, std::string binary, std::chrono::milliseconds timeout,
    bool merge_stderr, const std::string& marker) {
  if (binary.empty()) binary = DefaultBinary();
  LOGITSERVE_ASSIGN_OR_RETURN(Child child, Spawn(binary, args, merge_stderr));
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string out;
  while (true) {
    const size_t at = out.find(marker);
    if (at != std::string::npos && out.find('\n', at) != std::string::npos) {
      std::string address = TakeLine(out, kListeningPrefix);
      auto server = std::unique_ptr<ServerProcess>(
          new ServerProcess(child.pid, child.fd, std::move(address)));
      server->metrics_address_ = TakeLine(out, kMetricsPrefix);
      {
        absl::MutexLock lock(&server->mu_);
        server->output_ = std::move(out);
      }
      server->reader_ = std::thread([s = server.get()] { s->ReadRemainingOutput(); });
      return server;
    }
    const int n = ReadSome(child.fd, RemainingMs(deadline), &out);
    if (n == 0) {  // EOF: the server exited before printing the marker
      close(child.fd);
      const std::optional<int> code = WaitFor(child.pid, std::chrono::seconds(10));
      const int exit_code = code.has_value() ? *code : KillAndReap(child.pid);
      return absl::FailedPreconditionError(absl::StrCat("logitserve exited with status ", exit_code,
                                                        " before printing '", marker,
                                                        "'; output: ", out));
    }
    if (n < 0 || RemainingMs(deadline) == 0) {
      close(child.fd);
      KillAndReap(child.pid);
      return absl::DeadlineExceededError(absl::StrCat(
          "logitserve printed no '", marker, "' within ", timeout.count(), " ms; output: ", out));
    }
  }
}

absl::StatusOr<ServerProcess::ExitResult> ServerProcess::RunToExit(
    std::vector<std::string> args, std::string binary, std::chrono::milliseconds timeout) {
  if (binary.empty()) binary = DefaultBinary();
  LOGITSERVE_ASSIGN_OR_RETURN(Child child, Spawn(binary, args, /*merge_stderr=*/true));
  const Clock::time_point deadline = Clock::now() + timeout;
  ExitResult result;
  bool killed = false;
  while (true) {
    const int n = ReadSome(child.fd, killed ? 1000 : RemainingMs(deadline), &result.output);
    if (n == 0) break;
    if (n < 0 || (!killed && RemainingMs(deadline) == 0)) {
      if (killed) break;  // a grandchild holds the pipe; stop reading
      kill(child.pid, SIGKILL);
      killed = true;
    }
  }
  close(child.fd);
  const std::optional<int> code = WaitFor(child.pid, std::chrono::seconds(10));
  result.exit_code = code.has_value() ? *code : KillAndReap(child.pid);
  return result;
}

ServerProcess::ServerProcess(pid_t pid, int stdout_fd, std::string address)
    : pid_(pid), stdout_fd_(stdout_fd), address_(std::move(address)) {}

ServerProcess::~ServerProcess() {
  if (!reaped_) {
    exit_code_ = KillAndReap(pid_);
    reaped_ = true;
  }
  if (reader_.joinable()) reader_.join();
  close(stdout_fd_);
}

int ServerProcess::Stop(int sig, std::chrono::milliseconds timeout) {
  if (reaped_) return exit_code_;
  kill(pid_, sig);
  const std::optional<int> code = WaitFor(pid_, timeout);
  exit_code_ = code.has_value() ? *code : KillAndReap(pid_);
  reaped_ = true;
  if (reader_.joinable()) reader_.join();
  return exit_code_;
}

std::string ServerProcess::output() const {
  absl::MutexLock lock(&mu_);
  return output_;
}

void ServerProcess::ReadRemainingOutput() {
  char buf[4096];
  while (true) {
    const ssize_t n = read(stdout_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    absl::MutexLock lock(&mu_);
    output_.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace logitserve::testing
