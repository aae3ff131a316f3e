// Shared-memory inputs for clients on the server's host (SPEC §6): the client writes tensors
// into a POSIX shared-memory object, registers it with the server once
// (Client::RegisterSharedMemory) and then sends requests whose tensors name region + offset
// instead of carrying bytes; the server reads them in place.
//
//   auto shm = logitserve::client::SharedMemoryBuffer::Create("/worker-3", 64 << 20);
//   std::memcpy((*shm)->data(), hidden_bf16, bytes);
//   client->RegisterSharedMemory("worker-3", (*shm)->key(), 0, (*shm)->size());
//   *req.mutable_hidden() = SharedMemoryTensor("worker-3", 0, v1::DATA_TYPE_BFLOAT16, {n, h});
//   client->Score(req);   // do not rewrite those bytes until Score returned
//   client->UnregisterSharedMemory("worker-3");  // returns once the server reads it no more
//
// Thread safety: a SharedMemoryBuffer's methods may be called from any thread; writing its bytes
// while a request reading them is in flight gives that request unspecified inputs.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::client {

// A POSIX shared-memory object this process created (shm_open O_CREAT | O_EXCL, mode 0600 unless
// `mode` says otherwise), sized and mapped read-write. Unmapped and unlinked on destruction;
// unregister it from the server first.
class SharedMemoryBuffer {
 public:
  // `key`: "/" then 1..254 characters other than "/". ALREADY_EXISTS when the object exists.
  static absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> Create(std::string key,
                                                                    uint64_t byte_size,
                                                                    unsigned mode = 0600);
  ~SharedMemoryBuffer();
  SharedMemoryBuffer(const SharedMemoryBuffer&) = delete;
  SharedMemoryBuffer& operator=(const SharedMemoryBuffer&) = delete;

  // Removes the object's name now (shm_unlink); the mapping, and any other process's, stays.
  // The destructor then only unmaps.
  void Unlink();

  const std::string& key() const { return key_; }
  uint64_t size() const { return size_; }
  void* data() { return data_; }
  const void* data() const { return data_; }

 private:
  SharedMemoryBuffer(std::string key, void* data, uint64_t size);
  const std::string key_;
  void* const data_;
  const uint64_t size_;
  std::atomic<bool> linked_{true};
};

// A Tensor of `dtype` and `shape` whose bytes are [offset, offset + bytes) of the region the
// server knows as `region` (byte_size left 0: the server derives it from shape and dtype).
v1::Tensor SharedMemoryTensor(const std::string& region, uint64_t offset, v1::DataType dtype,
                              const std::vector<int64_t>& shape);

}  // namespace logitserve::client
