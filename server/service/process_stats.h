// ProcessStats: what the standard Prometheus process_* metrics report about this process (the
// names, types and units of the official Go and Python client libraries), read from getrusage,
// getrlimit and /proc at scrape time. Metrics::RenderPrometheus renders them.
//
// Thread safety: a free function reading kernel state; callable from any thread.
#pragma once

#include <optional>

namespace logitserve {

struct ProcessStats {
  double cpu_seconds = 0;  // process_cpu_seconds_total: user + system CPU time, all threads
  // Each is nullopt when it cannot be read (no /proc): left out of the scrape, never a fake 0.
  std::optional<double> resident_memory_bytes;  // process_resident_memory_bytes
  std::optional<double> virtual_memory_bytes;   // process_virtual_memory_bytes
  std::optional<double> open_fds;               // process_open_fds
  std::optional<double> max_fds;                // process_max_fds: RLIMIT_NOFILE soft limit
  std::optional<double> start_time_seconds;     // process_start_time_seconds: Unix time
};

ProcessStats ReadProcessStats();

}  // namespace logitserve
