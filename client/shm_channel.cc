#include "client/shm_channel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/call_end.h"
#include "client/request_split.h"
#include "client/shm.h"
#include "common/wire/shm_channel.h"

namespace logitserve::client {
namespace {

using wire::ShmChannelLayout;

enum Tag : intptr_t { kStart = 1, kRead = 2, kFinish = 3 };
void* TagPtr(intptr_t tag) { return reinterpret_cast<void*>(tag); }

// A fresh object name: pid, a per-process counter and 64 random bits (so that another client
// cannot guess it and race this one to open a channel on it).
std::string NewKey() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t r = (uint64_t{rd()} << 32) ^ rd();
  return absl::StrFormat("/logitserve-channel-%d-%d-%016x", getpid(), counter.fetch_add(1), r);
}

// The most bytes the answer to `request` can serialize to: every packed float / int32 array at
// its full size (4 bytes a value; top-k ids as int32 varints up to 5), the per-sequence outputs,
// and a generous allowance for tags, lengths and scalars.
uint64_t ResponseBytesBound(const v1::ScoreRequest& request) {
  const uint64_t n = static_cast<uint64_t>(std::max<int64_t>(0, RequestRows(request)));
  uint64_t k = 0;  // target ids per row
  if (request.has_target_ids()) {
    const auto& shape = request.target_ids().shape();
    k = shape.size() >= 2 ? static_cast<uint64_t>(std::max<int64_t>(0, shape[1])) : 1;
  }
  const uint64_t top_k = request.top_k();
  const uint64_t per_row_outputs = 6;  // entropies, KLs, JSD: at most these, 4 bytes each
  const uint64_t seqs = static_cast<uint64_t>(request.sequence_lengths_size());
  const uint64_t per_seq = 2 * (4 * (k + per_row_outputs) + 8 + 64);  // sums and means
  return n * (4 * k + 9 * top_k + 4 * per_row_outputs) + seqs * per_seq +
         request.request_id().size() + 4096;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Open(v1::Scorer::Stub& stub,
                                                             const std::string& bearer_token,
                                                             const ShmChannelOptions& options,
                                                             absl::Time deadline) {
  if (options.request_bytes == 0 || options.response_bytes == 0) {
    return absl::InvalidArgumentError("shared-memory channel areas must be > 0 bytes");
  }
  absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> region = SharedMemoryBuffer::Create(
      NewKey(), ShmChannelLayout::TotalBytes(options.request_bytes, options.response_bytes),
      options.mode);
  if (!region.ok()) return region.status();
  void* base = (*region)->data();
  wire::Word64(base, ShmChannelLayout::kRequestCapacity).store(options.request_bytes);
  wire::Word64(base, ShmChannelLayout::kResponseCapacity).store(options.response_bytes);
  wire::Word32(base, ShmChannelLayout::kVersion).store(wire::kShmChannelVersion);
  wire::Word32(base, ShmChannelLayout::kMagic).store(wire::kShmChannelMagic);

  std::unique_ptr<ShmChannel> channel(new ShmChannel(*std::move(region), options));
  if (!bearer_token.empty()) {
    channel->context_.AddMetadata("authorization", absl::StrCat("Bearer ", bearer_token));
  }
  v1::OpenSharedMemoryChannelRequest open;
  open.set_key(channel->region_->key());
  channel->call_ =
      stub.PrepareAsyncOpenSharedMemoryChannel(&channel->context_, open, &channel->cq_);
  channel->call_->StartCall(TagPtr(kStart));
  v1::OpenSharedMemoryChannelResponse opened;
  channel->call_->Read(&opened, TagPtr(kRead));
  channel->outstanding_ = 2;
  bool read_ok = false;
  while (channel->outstanding_ > 0) {
    void* tag = nullptr;
    bool ok = false;
    if (channel->cq_.AsyncNext(&tag, &ok, absl::ToChronoTime(deadline)) !=
        grpc::CompletionQueue::GOT_EVENT) {
      return absl::DeadlineExceededError("opening a shared-memory channel: deadline exceeded");
    }
    --channel->outstanding_;
    if (tag == TagPtr(kRead)) read_ok = ok;
  }
  if (!read_ok) {
    // The server refused: its status says why.
    grpc::Status status;
    channel->call_->Finish(&status, TagPtr(kFinish));
    void* tag = nullptr;
    bool ok = false;
    channel->cq_.Next(&tag, &ok);
    channel->call_.reset();
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.ok() ? "the server ended the channel call without serving it"
                                    : status.error_message());
  }
  channel->region_->Unlink();  // the server has it mapped; no name left behind
  return channel;
}

ShmChannel::ShmChannel(std::unique_ptr<SharedMemoryBuffer> region, const ShmChannelOptions& options)
    : region_(std::move(region)), options_(options) {}

ShmChannel::~ShmChannel() {
  CancelAndDrain(context_, cq_, call_.get(), outstanding_, TagPtr(kFinish));
}

bool ShmChannel::Fits(const ShmChannelOptions& options, const v1::ScoreRequest& request) {
  return request.ByteSizeLong() <= options.request_bytes &&
         ResponseBytesBound(request) <= options.response_bytes;
}

bool ShmChannel::WaitForAnswer(uint32_t seq, absl::Time until, bool* closed) {
  void* base = region_->data();
  uint32_t* word = wire::Addr32(base, ShmChannelLayout::kResponseSeq);
  std::atomic_ref<uint32_t> response_seq(*word);
  auto answered = [&] { return response_seq.load(std::memory_order_acquire) == seq; };
  const absl::Time spin_until = std::min(until, absl::Now() + options_.spin);
  while (!answered()) {
    if (absl::Now() >= spin_until) break;
    for (int i = 0; i < 64; ++i) CpuRelax();
  }
  constexpr absl::Duration kSlice = absl::Milliseconds(50);
  for (;;) {
    const uint32_t seen = response_seq.load(std::memory_order_acquire);
    if (seen == seq) return true;
    if (wire::Word32(base, ShmChannelLayout::kClosed).load(std::memory_order_acquire) != 0) {
      *closed = true;
      return answered();
    }
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    wire::FutexWait(word, seen, absl::ToChronoMicroseconds(std::min(left, kSlice)));
  }
}

absl::StatusOr<v1::ScoreResponse> ShmChannel::Call(const v1::ScoreRequest& request,
                                                   absl::Time deadline, bool* broken) {
  *broken = false;
  if (broken_) {
    *broken = true;
    return absl::UnavailableError("the shared-memory channel is broken");
  }
  void* base = region_->data();
  const size_t size = request.ByteSizeLong();
  if (size > options_.request_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request's ", size, " bytes exceed the channel's request area"));
  }
  request.SerializeWithCachedSizesToArray(static_cast<uint8_t*>(base) +
                                          ShmChannelLayout::RequestArea());
  const absl::Duration left = deadline - absl::Now();
  wire::Word64(base, ShmChannelLayout::kRequestBytes).store(size, std::memory_order_relaxed);
  wire::Word64(base, ShmChannelLayout::kTimeoutUs)
      .store(static_cast<uint64_t>(std::max<int64_t>(1, absl::ToInt64Microseconds(left))),
             std::memory_order_relaxed);
  const uint32_t seq = ++seq_;
  wire::Word32(base, ShmChannelLayout::kRequestSeq).store(seq, std::memory_order_release);
  wire::FutexWakeAll(wire::Addr32(base, ShmChannelLayout::kRequestSeq));

  bool closed = false;
  if (!WaitForAnswer(seq, deadline, &closed)) {
    // The server stops the request at its next check (cancel_seq; its own copy of the deadline
    // says the same). Its late answer must not be taken for the next call's: the channel is
    // done, and destroying it cancels the server's side.
    wire::Word32(base, ShmChannelLayout::kCancelSeq).store(seq, std::memory_order_release);
    broken_ = true;
    *broken = true;
    return closed ? absl::UnavailableError("the server closed the shared-memory channel")
                  : absl::DeadlineExceededError(
                        "Score on the shared-memory channel: deadline exceeded");
  }
  const uint64_t bytes = wire::Word64(base, ShmChannelLayout::kResponseBytes).load();
  const int32_t code =
      static_cast<int32_t>(wire::Word32(base, ShmChannelLayout::kStatusCode).load());
  const char* area =
      static_cast<const char*>(base) + ShmChannelLayout::ResponseArea(options_.request_bytes);
  const uint64_t n = std::min(bytes, options_.response_bytes);
  if (code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(code), std::string(area, n));
  }
  v1::ScoreResponse response;
  if (!response.ParseFromArray(area, static_cast<int>(n))) {
    broken_ = true;
    *broken = true;
    return absl::InternalError("the shared-memory channel's answer does not parse");
  }
  return response;
}

}  // namespace logitserve::client
