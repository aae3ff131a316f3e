// HeadStore: the registry of prepared heads the service resolves request head names against.
//
// Thread safety: every method may be called from any thread at any time (one absl::Mutex; lookups
// take it shared). Heads are handed out as shared_ptr<const PreparedHead>: a request that found a
// head keeps using those weights even if the head is replaced meanwhile, so in-flight work always
// finishes on the version it started with.
//
// Invariants: at most one head per name; the key of each entry is its head's weights().name, a
// valid head name (see ValidateHeadName); stored pointers are never null; a replacement's version
// is strictly greater than the version it replaces.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/heads/prepared_head.h"

namespace logitserve {

class HeadStore {
 public:
  HeadStore() = default;
  HeadStore(const HeadStore&) = delete;
  HeadStore& operator=(const HeadStore&) = delete;

  // Adds a head under its weights' name. ALREADY_EXISTS when the name is taken; INVALID_ARGUMENT
  // for a null head or an invalid name.
  absl::Status Add(std::shared_ptr<const PreparedHead> head);

  // Atomically installs `head` under its name, in place of any head of that name, and returns the
  // previous head (nullptr when there was none). FAILED_PRECONDITION, leaving the old head in
  // place, unless head's version is greater than the old one's (a concurrent replacement won).
  absl::StatusOr<std::shared_ptr<const PreparedHead>> Replace(
      std::shared_ptr<const PreparedHead> head);

  // The head named `name`, or nullptr.
  std::shared_ptr<const PreparedHead> Find(absl::string_view name) const;

  // Every head, sorted by name.
  std::vector<std::shared_ptr<const PreparedHead>> List() const;

  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const PreparedHead>, std::less<>> heads_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace logitserve
