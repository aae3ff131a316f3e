#include "server/service/shm_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/thread_name.h"
#include "common/wire/shm_channel.h"
#include "server/service/shm_registry.h"

namespace logitserve {

namespace {

using wire::ShmChannelLayout;
using Clock = std::chrono::steady_clock;

// How long one futex sleep lasts before the thread looks at `stopping_` again (Stop also wakes
// it; this bounds a missed wake).
constexpr std::chrono::microseconds kSleepSlice{100000};

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Open(const std::string& key,
                                                             uint64_t max_request_bytes,
                                                             uint64_t max_response_bytes) {
  if (!ValidSharedMemoryKey(key)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: '", key, "' must be '/' followed by 1 to 254 characters other than '/'"));
  }
  const int fd = shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return SharedMemoryErrnoStatus(errno, absl::StrCat("key: shm_open('", key, "')"));
  auto fail = [fd](absl::Status s) {
    close(fd);
    return s;
  };
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return fail(SharedMemoryErrnoStatus(errno, absl::StrCat("key: fstat('", key, "')")));
  }
  const uint64_t object_bytes = static_cast<uint64_t>(st.st_size);
  if (object_bytes < ShmChannelLayout::kHeaderBytes) {
    return fail(absl::InvalidArgumentError(absl::StrCat("key: '", key, "' holds ", object_bytes,
                                                        " bytes, less than a channel header (",
                                                        ShmChannelLayout::kHeaderBytes, ")")));
  }
  // The header first (one page), then the whole object once its capacities are known.
  void* header = mmap(nullptr, ShmChannelLayout::kHeaderBytes, PROT_READ, MAP_SHARED, fd, 0);
  if (header == MAP_FAILED) {
    return fail(SharedMemoryErrnoStatus(errno, absl::StrCat("key: mmap('", key, "')")));
  }
  const uint32_t magic = wire::Word32(header, ShmChannelLayout::kMagic).load();
  const uint32_t version = wire::Word32(header, ShmChannelLayout::kVersion).load();
  const uint64_t request_capacity = wire::Word64(header, ShmChannelLayout::kRequestCapacity).load();
  const uint64_t response_capacity =
      wire::Word64(header, ShmChannelLayout::kResponseCapacity).load();
  munmap(header, ShmChannelLayout::kHeaderBytes);
  if (magic != wire::kShmChannelMagic || version != wire::kShmChannelVersion) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("key: '", key, "' is not a version ", wire::kShmChannelVersion,
                     " channel region (magic ", magic, ", version ", version, ")")));
  }
  if (request_capacity == 0 || request_capacity > max_request_bytes || response_capacity == 0 ||
      response_capacity > max_response_bytes) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("key: the region's request capacity ", request_capacity,
                     " and response capacity ", response_capacity, " must be 1 to ",
                     max_request_bytes, " and 1 to ", max_response_bytes, " bytes")));
  }
  const uint64_t total = ShmChannelLayout::TotalBytes(request_capacity, response_capacity);
  if (object_bytes < total) {
    return fail(absl::InvalidArgumentError(absl::StrCat("key: '", key, "' holds ", object_bytes,
                                                        " bytes; its capacities need ", total)));
  }
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    return fail(SharedMemoryErrnoStatus(errno, absl::StrCat("key: mmap('", key, "')")));
  }
  uint32_t unclaimed = 0;
  if (!wire::Word32(base, ShmChannelLayout::kClaimed).compare_exchange_strong(unclaimed, 1)) {
    munmap(base, total);
    return fail(absl::FailedPreconditionError(
        absl::StrCat("key: '", key, "' is already served by another channel")));
  }
  return std::unique_ptr<ShmChannel>(
      new ShmChannel(key, fd, base, total, request_capacity, response_capacity));
}

ShmChannel::ShmChannel(std::string key, int fd, void* base, uint64_t mapped_bytes,
                       uint64_t request_capacity, uint64_t response_capacity)
    : key_(std::move(key)),
      fd_(fd),
      base_(base),
      mapped_bytes_(mapped_bytes),
      request_capacity_(request_capacity),
      response_capacity_(response_capacity) {
  // Requests posted before the server opened the channel are not served: the client waits for
  // the open call's first message before its first request.
  answered_.store(wire::Word32(base_, ShmChannelLayout::kRequestSeq).load());
}

ShmChannel::~ShmChannel() {
  Stop();
  if (thread_.joinable()) {
    // Destroyed from on_exit (its owner finished there): the thread touches nothing of this
    // object after on_exit, so it may finish on its own.
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  munmap(base_, mapped_bytes_);
  close(fd_);
}

void ShmChannel::Start(Serve serve, std::chrono::microseconds spin,
                       std::function<void(const absl::Status&)> on_exit) {
  thread_ = std::thread(&ShmChannel::Run, this, std::move(serve), spin, std::move(on_exit));
}

void ShmChannel::Stop() {
  stopping_.store(true);
  wire::FutexWakeAll(wire::Addr32(base_, ShmChannelLayout::kRequestSeq));
  answered_.notify_all();
}

bool ShmChannel::StillMapped() const {
  struct stat st;
  return fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) >= mapped_bytes_;
}

bool ShmChannel::WaitForRequest(uint32_t last, Clock::time_point spin_until, uint32_t* seq) {
  uint32_t* word = wire::Addr32(base_, ShmChannelLayout::kRequestSeq);
  std::atomic_ref<uint32_t> request_seq(*word);
  for (;;) {
    if (stopping_.load(std::memory_order_relaxed)) return false;
    const uint32_t now_seq = request_seq.load(std::memory_order_acquire);
    if (now_seq != last) {
      *seq = now_seq;
      return true;
    }
    if (Clock::now() < spin_until) {
      for (int i = 0; i < 64; ++i) CpuRelax();
      continue;
    }
    wire::FutexWait(word, last, kSleepSlice);
  }
}

void ShmChannel::WriteAnswer(uint32_t seq, const absl::Status& status,
                             const v1::ScoreResponse* response) {
  char* area = static_cast<char*>(base_) + ShmChannelLayout::ResponseArea(request_capacity_);
  absl::Status out = status;
  uint64_t bytes = 0;
  if (out.ok()) {
    const size_t size = response->ByteSizeLong();
    if (size > response_capacity_) {
      out = absl::ResourceExhaustedError(absl::StrCat(
          "response: ", size, " bytes do not fit the channel's response area of ",
          response_capacity_, " bytes (make it larger, or send this request over gRPC)"));
    } else {
      response->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(area));
      bytes = size;
    }
  }
  if (!out.ok()) {
    bytes = std::min<uint64_t>(out.message().size(), response_capacity_);
    std::memcpy(area, out.message().data(), bytes);
  }
  wire::Word32(base_, ShmChannelLayout::kStatusCode)
      .store(static_cast<uint32_t>(out.code()), std::memory_order_relaxed);
  wire::Word64(base_, ShmChannelLayout::kResponseBytes).store(bytes, std::memory_order_relaxed);
  wire::Word32(base_, ShmChannelLayout::kResponseSeq).store(seq, std::memory_order_release);
  wire::FutexWakeAll(wire::Addr32(base_, ShmChannelLayout::kResponseSeq));
}

void ShmChannel::Run(Serve serve, std::chrono::microseconds spin,
                     std::function<void(const absl::Status&)> on_exit) {
  NameThisThread("ls-shm-channel");
  absl::Status exit_status;
  std::string copy;          // the request bytes, out of the client's reach
  v1::ScoreRequest request;  // reused: protobuf keeps its allocations between parses
  Clock::time_point spin_until = Clock::now() + spin;
  uint32_t last = answered_.load();
  uint32_t seq = 0;
  while (WaitForRequest(last, spin_until, &seq)) {
    if (!StillMapped()) {
      exit_status = absl::FailedPreconditionError(
          absl::StrCat("key: the object '", key_, "' no longer holds the channel's region"));
      break;
    }
    const uint64_t n = wire::Word64(base_, ShmChannelLayout::kRequestBytes).load();
    const uint64_t timeout_us = wire::Word64(base_, ShmChannelLayout::kTimeoutUs).load();
    const Clock::time_point start = Clock::now();
    absl::Status bad;
    if (n > request_capacity_) {
      bad = absl::InvalidArgumentError(absl::StrCat("request_bytes: ", n,
                                                    " bytes exceed the channel's request area of ",
                                                    request_capacity_, " bytes"));
    } else {
      copy.assign(static_cast<const char*>(base_) + ShmChannelLayout::RequestArea(), n);
      if (!request.ParseFromArray(copy.data(), static_cast<int>(copy.size()))) {
        bad = absl::InvalidArgumentError(
            "request: the request area does not hold a logitserve.v1.ScoreRequest (it does not "
            "parse)");
      }
    }
    if (!bad.ok()) {
      WriteAnswer(seq, bad, nullptr);
      answered_.store(seq);
    } else {
      // Past this point the client's deadline (timeout_us from now; 0 = none) and its cancel
      // word rule.
      const Clock::time_point deadline =
          timeout_us > 0
              ? start + std::chrono::microseconds(std::min<uint64_t>(timeout_us, uint64_t{1} << 40))
              : Clock::time_point::max();
      auto stop = [this, seq, deadline]() -> absl::Status {
        if (stopping_.load(std::memory_order_relaxed)) {
          return absl::CancelledError("the shared-memory channel is closing");
        }
        if (wire::Word32(base_, ShmChannelLayout::kCancelSeq).load(std::memory_order_relaxed) ==
            seq) {
          return absl::CancelledError("the call was cancelled");
        }
        if (Clock::now() > deadline) {
          return absl::DeadlineExceededError(
              "the call's deadline expired before its result was ready");
        }
        return absl::OkStatus();
      };
      serve(request, stop, [this, seq](const absl::Status& status, const v1::ScoreResponse* r) {
        WriteAnswer(seq, status, r);
        answered_.store(seq);
        answered_.notify_all();
      });
      // The request (and the views the job holds into it) must outlive the answer.
      uint32_t seen = answered_.load();
      while (seen != seq) {
        answered_.wait(seen);
        seen = answered_.load();
      }
    }
    last = seq;
    spin_until = Clock::now() + spin;
  }
  wire::Word32(base_, ShmChannelLayout::kClosed).store(1, std::memory_order_release);
  wire::FutexWakeAll(wire::Addr32(base_, ShmChannelLayout::kResponseSeq));
  on_exit(exit_status);  // last: the owner may destroy this channel from here on
}

}  // namespace logitserve
