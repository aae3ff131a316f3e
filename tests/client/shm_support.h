// Helpers of the shared-memory end-to-end tests (shm_e2e_test.cc, shm_channel_e2e_test.cc): the
// synthetic head's inputs as bytes and in a registered POSIX shared-memory object, the requests
// naming them, and a bitwise comparison of outputs.
#pragma once

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/shm.h"
#include "client/tensor.h"
#include "gtest/gtest.h"
#include "logitserve/kernels/dtype.h"
#include "tests/client/output_expect.h"
#include "tests/service/e2e_support.h"

namespace logitserve::client::shm_test {

using testing::Bits;

inline constexpr char kToken[] = "shm-user-token-71";
inline const e2e::SyntheticHead& kHead = e2e::kPolicy;  // V = 3000, H = 64

inline std::string Unique(const std::string& what) {
  return "ls-test-" + std::to_string(getpid()) + "-" + what;
}

inline std::string TokenFile() {
  const std::string path = ::testing::TempDir() + "/" + Unique("token");
  std::ofstream(path) << kToken << "\n";
  return path;
}

inline ClientOptions WithToken(const char* token) {
  ClientOptions o;
  o.rpc_timeout = absl::Seconds(30);
  o.max_attempts = 1;
  if (token != nullptr) o.bearer_token = token;
  return o;
}

// Random bf16 hidden states [rows, H] and in-range target ids [rows].
struct Inputs {
  std::vector<uint16_t> hidden;
  std::vector<int32_t> ids;
};
inline Inputs MakeInputs(int64_t rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Inputs in;
  in.hidden.resize(rows * kHead.hidden);
  for (uint16_t& b : in.hidden) b = kernels::FloatToBFloat16(normal(rng));
  in.ids.resize(rows);
  for (int32_t& id : in.ids) id = static_cast<int32_t>(rng() % kHead.vocab);
  in.ids[0] = -100;  // ignored
  return in;
}

// The request for `rows` rows with every per-row tensor in bytes.
inline v1::ScoreRequest BytesRequest(const Inputs& in, int64_t rows) {
  v1::ScoreRequest req;
  req.set_head(kHead.name);
  *req.mutable_hidden() = BFloat16TensorFromBits(in.hidden, {rows, kHead.hidden});
  *req.mutable_target_ids() = TensorOf(in.ids, {rows});
  req.set_entropy(true);
  req.set_top_k(5);
  return req;
}

// The same request naming region `region`: hidden at offset 0, ids right after it.
inline v1::ScoreRequest ShmRequest(const std::string& region, int64_t rows) {
  v1::ScoreRequest req;
  req.set_head(kHead.name);
  *req.mutable_hidden() =
      SharedMemoryTensor(region, 0, v1::DATA_TYPE_BFLOAT16, {rows, kHead.hidden});
  *req.mutable_target_ids() =
      SharedMemoryTensor(region, rows * kHead.hidden * 2, v1::DATA_TYPE_INT32, {rows});
  req.set_entropy(true);
  req.set_top_k(5);
  return req;
}

inline uint64_t BytesOf(int64_t rows) { return rows * kHead.hidden * 2 + rows * 4; }

inline void WriteInputs(const Inputs& in, SharedMemoryBuffer& shm) {
  auto* p = static_cast<char*>(shm.data());
  std::memcpy(p, in.hidden.data(), in.hidden.size() * 2);
  std::memcpy(p + in.hidden.size() * 2, in.ids.data(), in.ids.size() * 4);
}

inline void ExpectBitwiseEqual(const ScoreOutput& a, const ScoreOutput& b) {
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(Bits(a.target_logprobs), Bits(b.target_logprobs));
  EXPECT_EQ(Bits(a.entropy), Bits(b.entropy));
  EXPECT_EQ(a.top_k_ids, b.top_k_ids);
  EXPECT_EQ(Bits(a.top_k_logprobs), Bits(b.top_k_logprobs));
}

// A fresh object of `bytes` bytes registered through `client` under the fresh name Unique(what)
// (returned in *name); a failure is a gtest failure.
inline std::unique_ptr<SharedMemoryBuffer> RegisteredObject(Client& client, const std::string& what,
                                                            uint64_t bytes, std::string* name) {
  auto shm = SharedMemoryBuffer::Create("/" + Unique(what), bytes);
  EXPECT_TRUE(shm.ok()) << shm.status();
  if (!shm.ok()) return nullptr;
  *name = Unique(what);
  const absl::Status s = client.RegisterSharedMemory(*name, (*shm)->key(), 0, bytes);
  EXPECT_TRUE(s.ok()) << s;
  return *std::move(shm);
}

// RegisteredObject holding MakeInputs(rows, seed).
inline std::unique_ptr<SharedMemoryBuffer> RegisteredInputs(Client& client, const std::string& what,
                                                            int64_t rows, uint64_t seed,
                                                            std::string* name) {
  std::unique_ptr<SharedMemoryBuffer> shm = RegisteredObject(client, what, BytesOf(rows), name);
  if (shm != nullptr) WriteInputs(MakeInputs(rows, seed), *shm);
  return shm;
}

// `threads` threads call client.Score(request(t + 1)) `calls` times each, at once (thread t asks
// for the first t + 1 rows: an answer given to the wrong caller shows); gtest failures for calls
// that fail or answers that are not want[t]'s bits.
inline void ExpectConcurrentCallersGetTheirOwnAnswers(
    Client& client, const std::vector<ScoreOutput>& want,
    const std::function<v1::ScoreRequest(int64_t rows)>& request, int threads, int calls) {
  std::vector<int> wrong(threads, 0), failed(threads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < calls; ++i) {
        absl::StatusOr<ScoreOutput> got = client.Score(request(t + 1));
        if (!got.ok()) {
          ++failed[t];
        } else if (got->rows != t + 1 || Bits(got->entropy) != Bits(want[t].entropy) ||
                   got->top_k_ids != want[t].top_k_ids) {
          ++wrong[t];
        }
      }
    });
  }
  for (std::thread& th : workers) th.join();
  for (int t = 0; t < threads; ++t) {
    EXPECT_EQ(failed[t], 0) << "thread " << t;
    EXPECT_EQ(wrong[t], 0) << "thread " << t;
  }
}

}  // namespace logitserve::client::shm_test
