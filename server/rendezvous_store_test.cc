#include "server/rendezvous_store.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/test_db.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<JobStore> OpenStore(const std::string& path) {
  auto store = JobStore::Open(path);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(store).value();
}

TEST(RendezvousStoreTest, SetThenGetAndContains) {
  auto db = OpenStore(TempDb("set_get"));
  absl::Mutex mu;
  bool stop = false;
  RendezvousStore kv(db.get());
  absl::MutexLock lock(&mu);
  ASSERT_TRUE(kv.Set("job-1/attempt-0/rank-0", "addr0").ok());
  auto v = kv.Get(mu, "job-1/attempt-0/rank-0", absl::ZeroDuration(), &stop);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "addr0");
  EXPECT_TRUE(kv.Contains({"job-1/attempt-0/rank-0"}));
  EXPECT_FALSE(kv.Contains({"job-1/attempt-0/rank-0", "job-1/attempt-0/rank-1"}));
  auto missing = kv.Get(mu, "job-1/attempt-0/rank-1", absl::ZeroDuration(), &stop);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("job-1/attempt-0/rank-1"));
}

TEST(RendezvousStoreTest, BoundsNameTheField) {
  EXPECT_THAT(std::string(RendezvousStore::CheckKey("").message()), HasSubstr("key:"));
  EXPECT_THAT(std::string(RendezvousStore::CheckKey(std::string(RendezvousStore::kMaxKey + 1, 'k')).message()),
              HasSubstr("key:"));
  EXPECT_TRUE(RendezvousStore::CheckKey(std::string(RendezvousStore::kMaxKey, 'k')).ok());
  EXPECT_THAT(std::string(RendezvousStore::CheckValue(std::string(RendezvousStore::kMaxValue + 1, 'v')).message()),
              HasSubstr("value:"));
  EXPECT_TRUE(RendezvousStore::CheckValue("").ok());
}

// A Get that waits is woken by a Set from another thread (the mutex is
// released while it waits), long before its timeout.
TEST(RendezvousStoreTest, GetWaitsForASet) {
  auto db = OpenStore(TempDb("wait"));
  absl::Mutex mu;
  bool stop = false;
  RendezvousStore kv(db.get());
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(kv.Set("k", "v").ok());
  });
  const absl::Time begin = absl::Now();
  absl::StatusOr<std::string> v;
  {
    absl::MutexLock lock(&mu);
    v = kv.Get(mu, "k", absl::Seconds(5), &stop);
  }
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
  EXPECT_LT(absl::Now() - begin, absl::Seconds(4));
}

TEST(RendezvousStoreTest, GetGivesUpAfterItsWaitOrAtStop) {
  auto db = OpenStore(TempDb("timeout"));
  absl::Mutex mu;
  bool stop = false;
  RendezvousStore kv(db.get());
  {
    absl::MutexLock lock(&mu);
    const absl::Time begin = absl::Now();
    EXPECT_EQ(kv.Get(mu, "k", absl::Milliseconds(50), &stop).status().code(), absl::StatusCode::kNotFound);
    EXPECT_GE(absl::Now() - begin, absl::Milliseconds(40));
  }
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(50));
    absl::MutexLock lock(&mu);
    stop = true;
  });
  const absl::Time begin = absl::Now();
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(kv.Get(mu, "k", absl::Seconds(5), &stop).status().code(), absl::StatusCode::kNotFound);
  }
  stopper.join();
  EXPECT_LT(absl::Now() - begin, absl::Seconds(4));
}

// An attempt's end deletes its keys and only its keys: not another
// attempt's (attempt-1 is not a prefix of attempt-10's keys), not another
// job's; and the deletion reaches the database.
TEST(RendezvousStoreTest, DeleteAttemptRemovesOnlyThatAttemptsKeys) {
  const std::string path = TempDb("prefix");
  absl::Mutex mu;
  bool stop = false;
  {
    auto db = OpenStore(path);
    RendezvousStore kv(db.get());
    absl::MutexLock lock(&mu);
    for (const char* k : {"job-1/attempt-1/rank-0", "job-1/attempt-1/rank-1", "job-1/attempt-10/rank-0",
                          "job-10/attempt-1/rank-0", "job-1/attempt-2/rank-0", "other/key"}) {
      ASSERT_TRUE(kv.Set(k, "v").ok());
    }
    EXPECT_EQ(AttemptPrefix("job-1", 1), "job-1/attempt-1");
    ASSERT_TRUE(kv.DeleteAttempt("job-1", 1).ok());
    EXPECT_FALSE(kv.Contains({"job-1/attempt-1/rank-0"}));
    EXPECT_FALSE(kv.Contains({"job-1/attempt-1/rank-1"}));
    EXPECT_TRUE(kv.Contains({"job-1/attempt-10/rank-0", "job-10/attempt-1/rank-0", "job-1/attempt-2/rank-0",
                             "other/key"}));
    EXPECT_EQ(kv.size(), 4u);
  }
  // What a restarted coordinator loads: the same four keys.
  auto db = OpenStore(path);
  RendezvousStore kv(db.get());
  absl::MutexLock lock(&mu);
  ASSERT_TRUE(kv.Load().ok());
  EXPECT_EQ(kv.size(), 4u);
  EXPECT_FALSE(kv.Contains({"job-1/attempt-1/rank-0"}));
  auto v = kv.Get(mu, "job-1/attempt-10/rank-0", absl::ZeroDuration(), &stop);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
}

// A job's keys of every attempt go together (a job whose attempt is not
// known, a deleted one); job-1/ never takes job-10's.
TEST(RendezvousStoreTest, DeleteJobRemovesEveryAttemptOfThatJobOnly) {
  auto db = OpenStore(TempDb("job_prefix"));
  RendezvousStore kv(db.get());
  absl::Mutex mu;
  absl::MutexLock lock(&mu);
  for (const char* k :
       {"job-1/attempt-0/rank-0", "job-1/attempt-3/rank-1", "job-10/attempt-0/rank-0", "job-12/attempt-1/rank-0"}) {
    ASSERT_TRUE(kv.Set(k, "v").ok());
  }
  ASSERT_TRUE(kv.DeleteJob("job-1").ok());
  EXPECT_FALSE(kv.Contains({"job-1/attempt-0/rank-0"}));
  EXPECT_FALSE(kv.Contains({"job-1/attempt-3/rank-1"}));
  EXPECT_TRUE(kv.Contains({"job-10/attempt-0/rank-0", "job-12/attempt-1/rank-0"}));
  EXPECT_EQ(kv.size(), 2u);
  EXPECT_TRUE(db->KvAll()->count("job-10/attempt-0/rank-0"));
  EXPECT_FALSE(db->KvAll()->count("job-1/attempt-3/rank-1"));
}

// Which ranks of an attempt have begun to meet: kept across a restart,
// gone with the attempt; an unnamed rank counts as any; an attempt whose
// keys carry no mark at all (an older coordinator's) counts as met by all.
TEST(RendezvousStoreTest, TheRanksThatMetAreKeptUntilTheAttemptEnds) {
  const std::string path = TempDb("met");
  {
    auto db = OpenStore(path);
    RendezvousStore kv(db.get());
    EXPECT_FALSE(kv.AnyMet("job-1", 0, {0, 1}));
    ASSERT_TRUE(kv.MarkMet("job-1", 0, 3).ok());
    ASSERT_TRUE(kv.MarkMet("job-1", 0, 3).ok());  // once
    EXPECT_EQ(kv.size(), 1u);
    EXPECT_FALSE(kv.AnyMet("job-1", 0, {0, 1}));
    EXPECT_TRUE(kv.AnyMet("job-1", 0, {2, 3}));
    EXPECT_FALSE(kv.AnyMet("job-1", 1, {3})) << "another attempt's";
    EXPECT_TRUE(RendezvousStore::IsOwnKey("job-1/attempt-0/.met/3"));
    EXPECT_FALSE(RendezvousStore::IsOwnKey("job-1/attempt-0/world/.met/3"));
    EXPECT_FALSE(RendezvousStore::IsOwnKey("job-1/attempt-0/.metric"));
  }
  auto db = OpenStore(path);
  RendezvousStore kv(db.get());
  ASSERT_TRUE(kv.Load().ok());
  EXPECT_TRUE(kv.AnyMet("job-1", 0, {3})) << "lost at a restart";
  ASSERT_TRUE(kv.MarkMet("job-2", 0, std::nullopt).ok());
  EXPECT_TRUE(kv.AnyMet("job-2", 0, {5}));
  // Keys with no mark at all: every rank counts as met.
  ASSERT_TRUE(kv.Set("job-3/attempt-0/world/0", "addr").ok());
  EXPECT_TRUE(kv.AnyMet("job-3", 0, {1}));
  ASSERT_TRUE(kv.DeleteAttempt("job-1", 0).ok());
  EXPECT_FALSE(kv.AnyMet("job-1", 0, {3}));
}

}  // namespace
}  // namespace plateau
