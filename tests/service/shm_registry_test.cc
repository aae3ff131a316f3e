// SharedMemoryRegistry in-process: registration rules, bounds (page-unaligned regions, the last
// byte, overflow), the fstat re-check, and Unregister's release callback running exactly when the
// last lease is gone.
#include "server/service/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace logitserve {
namespace {

using ::testing::HasSubstr;

// A POSIX shared-memory object of `size` bytes holding 0, 1, 2, ... (mod 251), unlinked at the end.
class ShmObject {
 public:
  explicit ShmObject(size_t size)
      : key_("/ls-registry-test-" + std::to_string(getpid()) + "-" + std::to_string(counter_++)) {
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    std::string bytes(size, '\0');
    for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i % 251);
    EXPECT_EQ(pwrite(fd, bytes.data(), size, 0), static_cast<ssize_t>(size));
    close(fd);
  }
  ~ShmObject() { shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }
  void Truncate(size_t size) const {
    const int fd = shm_open(key_.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    close(fd);
  }

 private:
  static inline int counter_ = 0;
  const std::string key_;
};

TEST(SharedMemoryRegistryTest, UnalignedRegionReadsTheRightBytes) {
  ShmObject obj(3 * 4096 + 100);
  SharedMemoryRegistry registry(4);
  // The region starts 4196 bytes into the object (not a page boundary) and is 5000 bytes long.
  ASSERT_TRUE(registry.Register("r", obj.key(), 4196, 5000).ok());
  absl::StatusOr<SharedMemoryRegistry::Resolved> v = registry.Resolve("hidden", "r", 10, 4990);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->bytes.size(), 4990u);
  for (size_t i = 0; i < v->bytes.size(); i += 97) {
    ASSERT_EQ(static_cast<unsigned char>(v->bytes[i]), (4196 + 10 + i) % 251) << i;
  }
  EXPECT_EQ(static_cast<unsigned char>(v->bytes.back()), (4196 + 5000 - 1) % 251);
  // Empty ranges at either end are inside; one byte past the end is not; nor is a wrap-around.
  EXPECT_TRUE(registry.Resolve("hidden", "r", 5000, 0).ok());
  EXPECT_TRUE(registry.Resolve("hidden", "r", 0, 0).ok());
  EXPECT_EQ(registry.Resolve("hidden", "r", 1, 5000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Resolve("hidden", "r", 5001, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status wrap =
      registry.Resolve("logits", "r", std::numeric_limits<uint64_t>::max(), 2).status();
  EXPECT_EQ(wrap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrap.message(), HasSubstr("logits.shared_memory"));
}

TEST(SharedMemoryRegistryTest, RegistrationRules) {
  ShmObject obj(8192);
  SharedMemoryRegistry registry(2);
  EXPECT_EQ(registry.Register("a", obj.key(), 0, 8193).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("a", obj.key(), std::numeric_limits<uint64_t>::max(), 2).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("a", "/ls-no-such-object-xyz", 0, 1).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Register("a", "/dev/../etc", 0, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("", obj.key(), 0, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register(std::string(129, 'x'), obj.key(), 0, 1).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.Register("a", obj.key(), 0, 8192).ok());
  EXPECT_EQ(registry.Register("a", obj.key(), 0, 1).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.Register("b", obj.key(), 4096, 4096).ok());
  EXPECT_EQ(registry.Register("c", obj.key(), 0, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(registry.size(), 2);
  SharedMemoryRegistry off(0);
  EXPECT_EQ(off.Register("a", obj.key(), 0, 1).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SharedMemoryRegistryTest, ShrunkObjectIsRefused) {
  ShmObject obj(8192);
  SharedMemoryRegistry registry(1);
  ASSERT_TRUE(registry.Register("a", obj.key(), 4096, 4096).ok());
  ASSERT_TRUE(registry.Resolve("hidden", "a", 0, 4096).ok());
  obj.Truncate(8191);
  EXPECT_EQ(registry.Resolve("hidden", "a", 0, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SharedMemoryRegistryTest, UnregisterReleasesWhenTheLastLeaseGoes) {
  ShmObject obj(4096);
  SharedMemoryRegistry registry(1);
  ASSERT_TRUE(registry.Register("a", obj.key(), 0, 4096).ok());
  auto first = registry.Resolve("hidden", "a", 0, 16);
  auto second = registry.Resolve("target_ids", "a", 16, 16);
  ASSERT_TRUE(first.ok() && second.ok());
  int released = 0;
  ASSERT_TRUE(registry.Unregister("a", [&released] { ++released; }).ok());
  EXPECT_EQ(registry.size(), 0);
  EXPECT_EQ(registry.Resolve("hidden", "a", 0, 16).status().code(), absl::StatusCode::kNotFound);
  // The leases still read the mapping.
  EXPECT_EQ(static_cast<unsigned char>(second->bytes[0]), 16);
  EXPECT_EQ(released, 0);
  first->lease.reset();
  EXPECT_EQ(released, 0);
  second->lease.reset();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(registry.Unregister("a", [] {}).code(), absl::StatusCode::kNotFound);

  // No lease: the callback runs inline, and the name is free again.
  ASSERT_TRUE(registry.Register("a", obj.key(), 0, 4096).ok());
  ASSERT_TRUE(registry.Unregister("a", [&released] { ++released; }).ok());
  EXPECT_EQ(released, 2);
}

}  // namespace
}  // namespace logitserve
