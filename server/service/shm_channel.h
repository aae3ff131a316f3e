// ShmChannel: the server's half of one shared-memory call channel (common/wire/shm_channel.h has
// the protocol and the control region's layout). ScorerService::OpenSharedMemoryChannel opens one
// per call and closes it when the call ends.
//
// One thread per channel serves its requests one at a time: it waits for the client's next
// request_seq (spinning for `spin` after each answer, when the client's next call usually comes,
// then sleeping on the futex), copies the request bytes out of the region (the client may scribble
// on them; the server parses its own copy), parses a ScoreRequest and hands it to `serve`, then
// waits until the answer is written. The answer (ShmChannel::Answer, from whichever thread
// finishes the request) writes the response or the error into the region and wakes the client.
//
// Trust: the region is the client's memory, mapped read-write. Every length read from it is
// checked against the area it describes, and the object's size is re-checked (fstat) before each
// request, so a client that shrinks it gets the channel closed (FAILED_PRECONDITION) instead of a
// fault; one that shrinks it while a request is being answered can still make the server fault,
// as with registered regions (SharedMemoryRegistry): channels are for co-located clients the
// operator trusts with a token.
//
// Thread safety: Stop may be called from any thread, more than once. The destructor stops the
// channel and joins its thread (it must not run on that thread: see Start's on_exit).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve {

class ShmChannel {
 public:
  // What `serve` returns its result through: call exactly once, from any thread, with the status
  // and (when OK) the response. The request passed to `serve` stays valid until then.
  using Answer = std::function<void(const absl::Status& status, const v1::ScoreResponse* response)>;
  // Runs on the channel's thread for each request. `stop` says whether the call should stop (the
  // client cancelled it, its deadline passed, or the channel is closing): OK to go on.
  using Serve = std::function<void(const v1::ScoreRequest& request,
                                   std::function<absl::Status()> stop, Answer answer)>;

  // Opens POSIX shared-memory object `key` read-write and claims it. INVALID_ARGUMENT for a
  // malformed key or header (magic, version, capacities: 1 ..= max_request_bytes and
  // 1 ..= max_response_bytes, the object too small for them), NOT_FOUND / PERMISSION_DENIED from
  // shm_open, FAILED_PRECONDITION when another channel claimed the object.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Open(const std::string& key,
                                                          uint64_t max_request_bytes,
                                                          uint64_t max_response_bytes);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  uint64_t request_capacity() const { return request_capacity_; }
  uint64_t response_capacity() const { return response_capacity_; }

  // Starts the serving thread. `on_exit` runs on it, as its last act, once the channel stopped
  // and no request is in flight: with OK after Stop, else with why the channel closed itself.
  void Start(Serve serve, std::chrono::microseconds spin,
             std::function<void(const absl::Status&)> on_exit);
  // Makes the thread finish: it answers no new request, lets the one in flight stop (its `stop`
  // reports CANCELLED), marks the region closed and wakes the client.
  void Stop();

 private:
  ShmChannel(std::string key, int fd, void* base, uint64_t mapped_bytes, uint64_t request_capacity,
             uint64_t response_capacity);
  void Run(Serve serve, std::chrono::microseconds spin,
           std::function<void(const absl::Status&)> on_exit);
  // Waits for a request_seq other than `last`; false once stopped.
  bool WaitForRequest(uint32_t last, std::chrono::steady_clock::time_point spin_until,
                      uint32_t* seq);
  // Whether the object still holds the whole mapping.
  bool StillMapped() const;
  void WriteAnswer(uint32_t seq, const absl::Status& status, const v1::ScoreResponse* response);

  const std::string key_;
  const int fd_;
  void* const base_;
  const uint64_t mapped_bytes_;
  const uint64_t request_capacity_;
  const uint64_t response_capacity_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint32_t> answered_{0};  // request_seq of the last answer written
  std::thread thread_;
};

}  // namespace logitserve
