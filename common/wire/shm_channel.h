// The shared-memory call channel (issue 12 target 3): Score calls of a client on the server's
// host without a gRPC round trip per call. Version 1 of its control region, shared by the server
// (server/service/shm_channel.h) and the clients (client/shm_channel.h, and the Python package's
// _shm_channel.py, which repeats these offsets).
//
// The client creates a POSIX shared-memory object (the control region), writes the header below
// and opens a Scorer.OpenSharedMemoryChannel call naming it. The server maps it read-write, claims
// it and serves one request at a time from it until the call ends (the client cancels it, or the
// connection breaks, or the server shuts down). A call:
//
//   client: writes the serialized ScoreRequest into the request area, then request_bytes and
//           timeout_us, then stores request_seq + 1 (release) and wakes the futex on request_seq;
//   server: sees the new request_seq (acquire), copies request_bytes bytes out and parses them,
//           computes, writes the serialized ScoreResponse (status_code 0) or the error message
//           (status_code = a gRPC code) into the response area, then response_bytes, then stores
//           response_seq = request_seq (release) and wakes the futex on response_seq.
//
// The two futex words sit on separate cache lines, each written by one side only. Every length
// the server reads from the region is checked against the area it describes; the server never
// reads or writes past the mapped object, and re-checks its size before each request.
//
// Offsets, in bytes, little-endian; integers naturally aligned:
//   0    u32  magic (kShmChannelMagic)                           client, before opening
//   4    u32  version (kShmChannelVersion)                       client, before opening
//   8    u64  request capacity (bytes of the request area)        client, before opening
//   16   u64  response capacity                                   client, before opening
//   24   u32  claimed: 0, set to 1 by the server that opens it   server (compare-and-swap)
//   64   u32  request_seq (futex word)                           client
//   68   u32  cancel_seq: a request_seq whose call should stop   client
//   72   u64  request_bytes                                       client
//   80   u64  timeout_us: the call's deadline, from when the server reads it; 0 = none
//   128  u32  response_seq (futex word)                          server
//   132  i32  status_code (absl / gRPC code; 0 = OK)              server
//   136  u64  response_bytes                                      server
//   144  u32  closed: 1 once the server serves the region no more server
//   4096                                  request area (request capacity bytes)
//   4096 + RoundUp(request capacity, 4096) response area (response capacity bytes)
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "common/base/cpu_relax.h"

namespace logitserve::wire {

inline constexpr uint32_t kShmChannelMagic = 0x3143534cu;  // "LSC1"
inline constexpr uint32_t kShmChannelVersion = 1;

struct ShmChannelLayout {
  static constexpr uint64_t kMagic = 0;
  static constexpr uint64_t kVersion = 4;
  static constexpr uint64_t kRequestCapacity = 8;
  static constexpr uint64_t kResponseCapacity = 16;
  static constexpr uint64_t kClaimed = 24;
  static constexpr uint64_t kRequestSeq = 64;
  static constexpr uint64_t kCancelSeq = 68;
  static constexpr uint64_t kRequestBytes = 72;
  static constexpr uint64_t kTimeoutUs = 80;
  static constexpr uint64_t kResponseSeq = 128;
  static constexpr uint64_t kStatusCode = 132;
  static constexpr uint64_t kResponseBytes = 136;
  static constexpr uint64_t kClosed = 144;
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint64_t kAlign = 4096;

  static constexpr uint64_t RoundUp(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
  static constexpr uint64_t RequestArea() { return kHeaderBytes; }
  static constexpr uint64_t ResponseArea(uint64_t request_capacity) {
    return kHeaderBytes + RoundUp(request_capacity);
  }
  // Bytes of the whole object.
  static constexpr uint64_t TotalBytes(uint64_t request_capacity, uint64_t response_capacity) {
    return ResponseArea(request_capacity) + RoundUp(response_capacity);
  }
};

// The word at `offset` of a mapped region (the region is page aligned; every offset above is
// naturally aligned), and an atomic view of it (std::atomic_ref needs no atomic object there).
inline uint32_t* Addr32(void* base, uint64_t offset) {
  return reinterpret_cast<uint32_t*>(static_cast<char*>(base) + offset);
}
inline std::atomic_ref<uint32_t> Word32(void* base, uint64_t offset) {
  return std::atomic_ref<uint32_t>(*Addr32(base, offset));
}
inline std::atomic_ref<uint64_t> Word64(void* base, uint64_t offset) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(static_cast<char*>(base) + offset));
}

// Futexes on a MAP_SHARED word (no FUTEX_PRIVATE_FLAG: the waiter and the waker are different
// processes). FutexWait returns when the word is no longer `expected`, on a wake, on a signal, or
// after `timeout` (spurious returns are allowed: the caller re-reads the word).
void FutexWait(uint32_t* word, uint32_t expected, std::chrono::microseconds timeout);
void FutexWakeAll(uint32_t* word);

}  // namespace logitserve::wire
