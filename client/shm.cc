#include "client/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace logitserve::client {

absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> SharedMemoryBuffer::Create(std::string key,
                                                                               uint64_t byte_size,
                                                                               unsigned mode) {
  if (key.size() < 2 || key[0] != '/' || key.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory key '", key, "' must be '/' followed by no other '/'"));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("shared-memory size must be > 0");
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, mode);
  if (fd < 0) {
    const int err = errno;
    const std::string message = absl::StrCat("shm_open('", key, "'): ", std::strerror(err));
    return err == EEXIST ? absl::AlreadyExistsError(message) : absl::InternalError(message);
  }
  // fchmod: shm_open's mode is filtered by the umask.
  if (fchmod(fd, mode) != 0 || ftruncate(fd, static_cast<off_t>(byte_size)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(key.c_str());
    return absl::InternalError(
        absl::StrCat("sizing shared memory '", key, "': ", std::strerror(err)));
  }
  void* data = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the object
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::InternalError(absl::StrCat("mmap('", key, "'): ", std::strerror(err)));
  }
  return std::unique_ptr<SharedMemoryBuffer>(
      new SharedMemoryBuffer(std::move(key), data, byte_size));
}

SharedMemoryBuffer::SharedMemoryBuffer(std::string key, void* data, uint64_t size)
    : key_(std::move(key)), data_(data), size_(size) {}

SharedMemoryBuffer::~SharedMemoryBuffer() {
  munmap(data_, size_);
  Unlink();
}

void SharedMemoryBuffer::Unlink() {
  if (linked_.exchange(false)) shm_unlink(key_.c_str());
}

v1::Tensor SharedMemoryTensor(const std::string& region, uint64_t offset, v1::DataType dtype,
                              const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.mutable_shared_memory()->set_region(region);
  t.mutable_shared_memory()->set_offset(offset);
  return t;
}

}  // namespace logitserve::client
