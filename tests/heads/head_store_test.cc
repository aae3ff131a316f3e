// HeadStore: add / find / list, versioned replacement, and concurrent use.
#include "server/heads/head_store.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace logitserve {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<const PreparedHead> Head(const std::string& name, uint64_t version = 1) {
  auto weights = std::make_shared<HeadWeights>();
  weights->name = name;
  weights->vocab_size = 1;
  weights->hidden_size = 1;
  weights->weight.assign(4, 0);
  weights->version = version;
  return std::make_shared<PreparedHead>(std::move(weights));
}

std::vector<std::string> Names(const HeadStore& store) {
  std::vector<std::string> names;
  for (const auto& head : store.List()) names.push_back(head->weights().name);
  return names;
}

TEST(HeadStoreTest, AddFindList) {
  HeadStore store;
  EXPECT_EQ(store.size(), 0u);
  EXPECT_TRUE(store.List().empty());
  ASSERT_TRUE(store.Add(Head("reference")).ok());
  ASSERT_TRUE(store.Add(Head("policy")).ok());
  ASSERT_TRUE(store.Add(Head("Policy-2")).ok());
  EXPECT_EQ(store.size(), 3u);
  EXPECT_EQ(Names(store), (std::vector<std::string>{"Policy-2", "policy", "reference"}));
  ASSERT_NE(store.Find("policy"), nullptr);
  EXPECT_EQ(store.Find("policy")->weights().name, "policy");
  EXPECT_EQ(store.Find("polic"), nullptr);
  EXPECT_EQ(store.Find(""), nullptr);
}

TEST(HeadStoreTest, AddRejectsDuplicatesNullAndBadNames) {
  HeadStore store;
  ASSERT_TRUE(store.Add(Head("policy", 4)).ok());
  const auto kept = store.Find("policy");
  absl::Status s = store.Add(Head("policy", 5));
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(s.message()), HasSubstr("head \"policy\" already exists (version 4)"));
  EXPECT_EQ(store.Find("policy"), kept);
  EXPECT_EQ(store.Add(nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Add(Head("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Add(Head("a/b")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.size(), 1u);
}

TEST(HeadStoreTest, ReplaceSwapsAtomicallyAndKeepsInFlightHeadsAlive) {
  HeadStore store;
  auto first = store.Replace(Head("policy", 1));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, nullptr);  // nothing to replace

  std::shared_ptr<const PreparedHead> in_flight = store.Find("policy");
  auto previous = store.Replace(Head("policy", 2));
  ASSERT_TRUE(previous.ok()) << previous.status();
  EXPECT_EQ(*previous, in_flight);
  EXPECT_EQ(in_flight->weights().version, 1u);  // the old weights are still usable
  EXPECT_EQ(store.Find("policy")->weights().version, 2u);

  for (uint64_t stale : {1, 2}) {
    auto rejected = store.Replace(Head("policy", stale));
    EXPECT_EQ(rejected.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(rejected.status().message()),
                HasSubstr(absl::StrCat("cannot replace version 2 with version ", stale)));
  }
  EXPECT_EQ(store.Find("policy")->weights().version, 2u);
  EXPECT_EQ(store.Replace(nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HeadStoreTest, ConcurrentAddFindListReplace) {
  constexpr int kThreads = 4;
  constexpr int kHeadsPerThread = 200;
  HeadStore store;
  ASSERT_TRUE(store.Add(Head("shared", 1)).ok());
  std::atomic<int> replaced{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kHeadsPerThread; ++i) {
        const std::string name = absl::StrCat("h", t, "_", i);
        EXPECT_TRUE(store.Add(Head(name)).ok());
        EXPECT_NE(store.Find(name), nullptr);
        EXPECT_NE(store.Find("shared"), nullptr);
        // Versions from every thread race; exactly the increasing ones win.
        if (store.Replace(Head("shared", 2 + i * kThreads + t)).ok()) ++replaced;
        if (i % 50 == 0) {
          EXPECT_GE(store.List().size(), 1u);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(store.size(), 1u + kThreads * kHeadsPerThread);
  EXPECT_EQ(store.Find("shared")->weights().version, 1u + kThreads * kHeadsPerThread);
  EXPECT_GE(replaced.load(), 1);
  const std::vector<std::string> names = Names(store);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
}

}  // namespace
}  // namespace logitserve
