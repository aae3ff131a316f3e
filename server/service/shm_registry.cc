#include "server/service/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace logitserve {

namespace {

constexpr size_t kMaxNameLength = 128;
constexpr size_t kMaxKeyLength = 255;  // NAME_MAX, with the leading '/'

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// Whether [offset, offset + size) lies within [0, limit), without overflow.
bool RangeWithin(uint64_t offset, uint64_t size, uint64_t limit) {
  return offset <= limit && size <= limit - offset;
}

}  // namespace

bool ValidSharedMemoryKey(const std::string& key) {
  return key.size() >= 2 && key.size() <= kMaxKeyLength && key[0] == '/' &&
         key.find('/', 1) == std::string::npos && key.find('\0') == std::string::npos;
}

absl::Status SharedMemoryErrnoStatus(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

SharedMemoryRegion::SharedMemoryRegion(std::string name, std::string key, int fd, void* mapping,
                                       uint64_t mapping_size, uint64_t page_delta,
                                       uint64_t object_offset, uint64_t size)
    : name_(std::move(name)),
      key_(std::move(key)),
      fd_(fd),
      mapping_(mapping),
      mapping_size_(mapping_size),
      page_delta_(page_delta),
      object_offset_(object_offset),
      size_(size) {}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(mapping_, mapping_size_);
  close(fd_);
  std::vector<std::function<void()>> callbacks;
  {
    absl::MutexLock lock(&mu_);
    callbacks.swap(on_release_);
  }
  for (std::function<void()>& callback : callbacks) callback();
}

SharedMemoryRegistry::SharedMemoryRegistry(int max_regions) : max_regions_(max_regions) {}

int SharedMemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(regions_.size());
}

absl::Status SharedMemoryRegistry::Register(const std::string& name, const std::string& key,
                                            uint64_t offset, uint64_t byte_size) {
  if (max_regions_ <= 0) {
    return absl::FailedPreconditionError(
        "shared-memory inputs are disabled on this server (--max-shared-memory-regions 0)");
  }
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "name: '", name, "' must be 1 to ", kMaxNameLength, " characters of [A-Za-z0-9._-]"));
  }
  if (!ValidSharedMemoryKey(key)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: '", key, "' must be '/' followed by 1 to 254 characters other than '/'"));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  {
    absl::MutexLock lock(&mu_);
    if (regions_.contains(name)) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: a shared-memory region named '", name, "' is registered"));
    }
    if (static_cast<int>(regions_.size()) >= max_regions_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("name: ", max_regions_,
                       " shared-memory regions are registered, the server's limit "
                       "(--max-shared-memory-regions)"));
    }
  }

  const int fd = shm_open(key.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return SharedMemoryErrnoStatus(errno, absl::StrCat("key: shm_open('", key, "')"));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return SharedMemoryErrnoStatus(err, absl::StrCat("key: fstat('", key, "')"));
  }
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  if (!RangeWithin(offset, byte_size, object_size)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("offset, byte_size: [", offset, ", ", offset,
                                                   " + ", byte_size, ") is not inside '", key,
                                                   "' (", object_size, " bytes)"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = offset - offset % page;
  const uint64_t page_delta = offset - map_offset;
  const uint64_t map_size = page_delta + byte_size;
  void* mapping =
      mmap(nullptr, map_size, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(map_offset));
  if (mapping == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return SharedMemoryErrnoStatus(err, absl::StrCat("key: mmap('", key, "')"));
  }
  std::shared_ptr<SharedMemoryRegion> region(
      new SharedMemoryRegion(name, key, fd, mapping, map_size, page_delta, offset, byte_size));
  absl::MutexLock lock(&mu_);
  // Checked again: another Register may have taken the name or the last slot meanwhile (the
  // region then unmaps itself on return).
  if (regions_.contains(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: a shared-memory region named '", name, "' is registered"));
  }
  if (static_cast<int>(regions_.size()) >= max_regions_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "name: ", max_regions_, " shared-memory regions are registered, the server's limit"));
  }
  regions_.emplace(name, std::move(region));
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& name,
                                              std::function<void()> released) {
  std::shared_ptr<SharedMemoryRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat("name: no shared-memory region named '", name, "' is registered"));
    }
    region = std::move(it->second);
    regions_.erase(it);
  }
  {
    absl::MutexLock lock(&region->mu_);
    region->on_release_.push_back(std::move(released));
  }
  region.reset();  // the last owner unmaps and runs `released`, here or when the last lease goes
  return absl::OkStatus();
}

absl::StatusOr<SharedMemoryRegistry::Resolved> SharedMemoryRegistry::Resolve(
    absl::string_view field, const std::string& name, uint64_t offset, uint64_t byte_size) const {
  std::shared_ptr<const SharedMemoryRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it != regions_.end()) region = it->second;
  }
  if (region == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(field, ".shared_memory.region: no region named '", name, "' is registered"));
  }
  if (!RangeWithin(offset, byte_size, region->size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shared_memory: bytes [", offset, ", ", offset, " + ", byte_size,
                     ") are not inside region '", name, "' (", region->size(), " bytes)"));
  }
  struct stat st;
  if (fstat(region->fd_, &st) != 0 ||
      !RangeWithin(region->object_offset_, region->size(), static_cast<uint64_t>(st.st_size))) {
    return absl::FailedPreconditionError(absl::StrCat(field, ".shared_memory.region: the object '",
                                                      region->key(), "' behind region '", name,
                                                      "' no longer holds the registered bytes"));
  }
  const char* base = static_cast<const char*>(region->mapping_) + region->page_delta_;
  return Resolved{absl::string_view(base + offset, byte_size), std::move(region)};
}

}  // namespace logitserve
