// CopyPool (server/backend/cuda/copy_pool.h), which needs no GPU (label unit: runs on CI machines
// too): every share of a run runs exactly once, share 0 on the calling thread, Run returns only
// after every share has, runs wider than the pool put the extra shares on the caller, and the
// pool serves run after run. CopyPool::Copy and SplitCopy copy every byte exactly, whatever the
// split.
#include "server/backend/cuda/copy_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
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

// Sizes around the share boundaries (one byte, fewer bytes than threads, not a multiple of the
// thread count, several shares of 1 MiB) on the pool, on a null pool and with one thread.
TEST(CopyPool, CopyCopiesEveryByte) {
  CopyPool pool(3);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{3}, size_t{4097}, size_t{(3 << 20) + 5}}) {
    for (size_t threads : {size_t{1}, size_t{4}, size_t{8}}) {
      for (CopyPool* p : {&pool, static_cast<CopyPool*>(nullptr)}) {
        SCOPED_TRACE(std::to_string(bytes) + " bytes, " + std::to_string(threads) +
                     (p == nullptr ? " threads, no pool" : " threads"));
        std::vector<uint8_t> src(bytes + 2), dst(bytes + 2, 0xee);
        for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
        CopyPool::Copy(p, dst.data() + 1, src.data() + 1, bytes, threads, size_t{1} << 20);
        EXPECT_EQ(dst.front(), 0xee);  // nothing outside [dst + 1, dst + 1 + bytes) is written
        EXPECT_EQ(dst.back(), 0xee);
        EXPECT_TRUE(std::equal(src.begin() + 1, src.end() - 1, dst.begin() + 1));
      }
    }
  }
}

// SplitCopy over several copies: shares cut across copy boundaries.
TEST(CopyPool, SplitCopyCutsAcrossCopies) {
  std::vector<uint8_t> a(1000), b(7), c(2500);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(200 + i);
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint8_t>(i * 3);
  for (size_t n : {size_t{1}, size_t{2}, size_t{3}, size_t{5}, size_t{64}}) {
    SCOPED_TRACE(n);
    std::vector<uint8_t> da(a.size()), db(b.size()), dc(c.size());
    const SplitCopy split(
        {HostCopy{da.data(), a.data(), a.size()}, HostCopy{db.data(), b.data(), b.size()},
         HostCopy{dc.data(), c.data(), c.size()}},
        n);
    for (size_t i = 0; i < n; ++i) split.Run(i);
    EXPECT_EQ(da, a);
    EXPECT_EQ(db, b);
    EXPECT_EQ(dc, c);
  }
}

}  // namespace
}  // namespace logitserve::cuda_internal
