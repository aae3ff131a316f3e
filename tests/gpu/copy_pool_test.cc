// CopyPool (server/backend/cuda/copy_pool.h), which needs no GPU (label unit: runs on CI machines
// too): every share of a run runs exactly once, share 0 on the calling thread, Run returns only
// after every share has, runs wider than the pool put the extra shares on the caller, and the
// pool serves run after run.
#include "server/backend/cuda/copy_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace logitserve::cuda_internal {
namespace {

TEST(CopyPool, EveryShareRunsOnceAndRunWaitsForAll) {
  CopyPool pool(3);
  for (size_t n : {size_t{1}, size_t{2}, size_t{4}, size_t{7}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    for (int round = 0; round < 20; ++round) {
      std::vector<std::atomic<int>> ran(n);
      std::vector<std::thread::id> by(n);
      std::atomic<int> finished{0};
      pool.Run(n, [&](size_t i) {
        // The pool's shares take longer than the caller's: Run must still wait for them.
        if (i != 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
        by[i] = std::this_thread::get_id();
        ran[i].fetch_add(1);
        finished.fetch_add(1);
      });
      EXPECT_EQ(finished.load(), static_cast<int>(n));
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(ran[i].load(), 1) << "share " << i;
      EXPECT_EQ(by[0], std::this_thread::get_id());
      // Shares past the pool's three threads (n = 7: shares 4-6) run on the caller too.
      for (size_t i = 4; i < n; ++i) EXPECT_EQ(by[i], std::this_thread::get_id()) << i;
      for (size_t i = 1; i < std::min<size_t>(n, 4); ++i) {
        EXPECT_NE(by[i], std::this_thread::get_id()) << "share " << i;
      }
    }
  }
}

TEST(CopyPool, EmptyPoolRunsEverythingOnTheCaller) {
  CopyPool pool(0);
  std::vector<int> ran(3, 0);
  pool.Run(3, [&](size_t i) { ++ran[i]; });
  EXPECT_EQ(ran, std::vector<int>({1, 1, 1}));
  pool.Run(0, [&](size_t) { ADD_FAILURE() << "nothing to run"; });
}

}  // namespace
}  // namespace logitserve::cuda_internal
