#include "server/service/worker_pool.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace logitserve {
namespace {

TEST(WorkerPoolTest, RunsEveryTaskBeforeStopReturns) {
  std::atomic<int> done{0};
  WorkerPool pool(2, 1000);
  for (int i = 0; i < 500; ++i) ASSERT_TRUE(pool.TrySubmit([&] { done.fetch_add(1); }));
  pool.Stop();
  EXPECT_EQ(done.load(), 500);
  EXPECT_FALSE(pool.TrySubmit([] {}));
}

TEST(WorkerPoolTest, RejectsWhenTheQueueIsFull) {
  absl::Notification started, release;
  WorkerPool pool(1, 2);
  ASSERT_TRUE(pool.TrySubmit([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();  // the worker is busy; the queue is empty
  EXPECT_TRUE(pool.TrySubmit([] {}));
  EXPECT_TRUE(pool.TrySubmit([] {}));
  EXPECT_FALSE(pool.TrySubmit([] {}));  // two waiting: full
  release.Notify();
  pool.Stop();
}

}  // namespace
}  // namespace logitserve
