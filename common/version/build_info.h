// What this binary is: release version, source commit, build type, and the CUDA toolkit, NCCL and
// GPU architectures it was built for (empty in a CPU-only build). Every binary's --version, the
// server's start-up log line, ListHeadsResponse.server_info and the logitserve_build_info metric
// report these same values.
//
// Thread safety: immutable; callable from any thread.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace logitserve {

struct BuildInfo {
  absl::string_view version;             // project version (CMakeLists.txt), e.g. "0.1.0"
  absl::string_view git_commit;          // `git describe --always --dirty`; "unknown" outside git
  absl::string_view build_type;          // CMAKE_BUILD_TYPE, e.g. "Release"
  absl::string_view cuda_version;        // CUDA toolkit built against, e.g. "13.0.88"; "" = no CUDA
  absl::string_view nccl_version;        // NCCL headers built against, e.g. "2.27.7"; "" = no CUDA
  absl::string_view cuda_architectures;  // CMAKE_CUDA_ARCHITECTURES, e.g. "90"; "" = no CUDA
  // Backends compiled in: "cpu" or "cpu,cuda".
  absl::string_view backends() const { return cuda_version.empty() ? "cpu" : "cpu,cuda"; }
};

const BuildInfo& GetBuildInfo();

// The text of `PROGRAM --version`: "PROGRAM VERSION (commit C, BUILD_TYPE)" and a line naming the
// compiled-in backends with their CUDA / NCCL versions (no final newline: CLI11 adds one).
std::string VersionText(absl::string_view program);

}  // namespace logitserve
