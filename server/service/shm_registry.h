// SharedMemoryRegistry: the POSIX shared-memory regions clients on the server's host registered
// (RegisterSharedMemory), so that a Tensor can name region + offset instead of carrying bytes
// (SPEC §6, as Triton's system shared memory extension).
//
// A region is a byte range of a POSIX shared-memory object (shm_open), mapped read-only
// (PROT_READ, MAP_SHARED) when it is registered; the server never writes it. Requests take a
// Lease on the region (Resolve); the mapping lives as long as the registry or any lease holds it.
// Unregister removes the name at once (later Resolve calls fail with NOT_FOUND) and reports
// through its callback when the last lease is gone, i.e. when no request reads the region any
// more; only then is the object unmapped.
//
// Bounds: Resolve checks offset + byte_size against the region (overflow-safe) before returning a
// view, and re-checks with fstat that the object still backs the whole region (a client that
// shrank it with ftruncate gets FAILED_PRECONDITION instead of the server touching pages that no
// longer exist). A client that shrinks the object while a request is reading it can still make
// the server fault: registration is for co-located clients the operator trusts with a token
// (docs/operations.md).
//
// Thread safety: every method may be called from any thread. Unregister's callback runs on the
// thread that drops the last lease (a gRPC or a scheduler thread), without the registry's lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace logitserve {

// shm_open's portable form: one leading '/', 1 to 254 more characters, no other '/' (so no path
// into another folder). Shared with the call channels (shm_channel.h).
bool ValidSharedMemoryKey(const std::string& key);
// `what`: strerror(err), as NOT_FOUND (ENOENT), PERMISSION_DENIED (EACCES, EPERM),
// RESOURCE_EXHAUSTED (EMFILE, ENFILE, ENOMEM) or INTERNAL.
absl::Status SharedMemoryErrnoStatus(int err, const std::string& what);

// One mapped region. Destroyed (unmapped, then its release callbacks run) with its last owner.
class SharedMemoryRegion {
 public:
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  const std::string& key() const { return key_; }
  uint64_t size() const { return size_; }

 private:
  friend class SharedMemoryRegistry;
  SharedMemoryRegion(std::string name, std::string key, int fd, void* mapping,
                     uint64_t mapping_size, uint64_t page_delta, uint64_t object_offset,
                     uint64_t size);

  const std::string name_;
  const std::string key_;
  const int fd_;         // kept open for the fstat re-check
  void* const mapping_;  // page-aligned start of the mapping
  const uint64_t mapping_size_;
  const uint64_t page_delta_;     // region start - mapping start
  const uint64_t object_offset_;  // region start within the object
  const uint64_t size_;
  absl::Mutex mu_;
  std::vector<std::function<void()>> on_release_ ABSL_GUARDED_BY(mu_);
};

class SharedMemoryRegistry {
 public:
  // At most `max_regions` regions at once; 0 disables registration (RegisterSharedMemory fails
  // with FAILED_PRECONDITION).
  explicit SharedMemoryRegistry(int max_regions);

  // Maps [offset, offset + byte_size) of object `key` read-only under `name`. INVALID_ARGUMENT
  // for a malformed name / key / range or a range past the object's end, ALREADY_EXISTS for a
  // name in use, NOT_FOUND when the object does not exist, PERMISSION_DENIED when the server may
  // not read it, RESOURCE_EXHAUSTED when max_regions are registered.
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);

  // Removes `name` (NOT_FOUND when there is none); `released` runs exactly once when the region's
  // last lease is gone: inline when no request holds one, else later on the releasing thread.
  absl::Status Unregister(const std::string& name, std::function<void()> released);

  // A read-only view of [offset, offset + byte_size) of region `name` and the lease that keeps
  // it mapped. NOT_FOUND for an unknown region; INVALID_ARGUMENT (message starting with `field`)
  // when the range is not inside the region; FAILED_PRECONDITION when the object was shrunk.
  struct Resolved {
    absl::string_view bytes;
    std::shared_ptr<const SharedMemoryRegion> lease;
  };
  absl::StatusOr<Resolved> Resolve(absl::string_view field, const std::string& name,
                                   uint64_t offset, uint64_t byte_size) const;

  int size() const;

 private:
  const int max_regions_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<SharedMemoryRegion>> regions_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace logitserve
