#include "server/service/process_stats.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace logitserve {
namespace {

double Seconds(const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; }

std::optional<double> CountOpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return std::nullopt;
  double count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the descriptor of `dir` itself
}

// Boot time (Unix seconds) from /proc/stat's btime line.
std::optional<double> BootTime() {
  std::ifstream in("/proc/stat");
  std::string key;
  double value = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    if (fields >> key >> value && key == "btime") return value;
  }
  return std::nullopt;
}

// Field 22 of /proc/self/stat (starttime, clock ticks after boot). The fields are counted after
// the command name's closing parenthesis: the name itself may hold spaces.
std::optional<double> StartTicksAfterBoot() {
  std::ifstream in("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(paren + 1));
  std::string field;
  for (int index = 3; index <= 22; ++index) {  // the text after ')' starts at field 3
    if (!(fields >> field)) return std::nullopt;
  }
  return std::stod(field);
}

}  // namespace

ProcessStats ReadProcessStats() {
  ProcessStats stats;
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) {
    stats.cpu_seconds = Seconds(usage.ru_utime) + Seconds(usage.ru_stime);
  }
  const double page_bytes = static_cast<double>(sysconf(_SC_PAGESIZE));
  std::ifstream statm("/proc/self/statm");
  double size_pages = 0;
  double resident_pages = 0;
  if (statm >> size_pages >> resident_pages) {
    stats.virtual_memory_bytes = size_pages * page_bytes;
    stats.resident_memory_bytes = resident_pages * page_bytes;
  }
  stats.open_fds = CountOpenFds();
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    stats.max_fds = static_cast<double>(limit.rlim_cur);
  }
  const std::optional<double> boot = BootTime();
  const std::optional<double> ticks = StartTicksAfterBoot();
  if (boot.has_value() && ticks.has_value()) {
    stats.start_time_seconds = *boot + *ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  return stats;
}

}  // namespace logitserve
