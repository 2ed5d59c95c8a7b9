#include "kernels/gloo_kv_store.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<KeyValueStore> MakeStore(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/gloo_kv_",
                                 name, "_", ::getpid());
  std::filesystem::remove_all(dir);
  auto store = FileStore::Create(dir);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::shared_ptr<KeyValueStore>(std::move(store).value());
}

TEST(GlooStoreAdapterTest, SetGetThroughAPrefixStore) {
  auto kv = MakeStore("prefix");
  GlooStoreAdapter adapter(kv, absl::Seconds(5));
  gloo::rendezvous::PrefixStore prefixed("job1/world", adapter);
  const std::vector<char> data = {'a', '\0', 'b'};
  prefixed.set("0", data);
  EXPECT_EQ(prefixed.get("0"), data);
  // The prefix is part of the key the KeyValueStore sees.
  auto raw = kv->Get("job1/world/0", absl::ZeroDuration());
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(*raw, std::string("a\0b", 3));
}

TEST(GlooStoreAdapterTest, WaitReturnsOnceEveryKeyIsSet) {
  auto kv = MakeStore("wait");
  GlooStoreAdapter adapter(kv, absl::Seconds(5));
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_TRUE(kv->Set("a", "1").ok());
    EXPECT_TRUE(kv->Set("b", "2").ok());
  });
  EXPECT_NO_THROW(adapter.wait({"a", "b"}, std::chrono::seconds(5)));
  writer.join();
  EXPECT_TRUE(kv->Check({"a", "b"}).value());
}

TEST(GlooStoreAdapterTest, TimeoutThrowsTheStatusNamingTheKey) {
  auto kv = MakeStore("timeout");
  GlooStoreAdapter adapter(kv, absl::Milliseconds(50));
  ASSERT_TRUE(kv->Set("present", "x").ok());
  try {
    adapter.wait({"present", "absent"}, std::chrono::milliseconds(50));
    FAIL() << "wait did not throw";
  } catch (const KeyValueStoreError& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(e.status().message(), HasSubstr("'absent'"));
  }
  try {
    adapter.get("also_absent");
    FAIL() << "get did not throw";
  } catch (const gloo::IoException& e) {  // what Gloo's callers expect
    EXPECT_THAT(e.what(), HasSubstr("'also_absent'"));
  }
}

// Gloo's connectFullMesh waits for one peer's key after another, each wait
// with the full timeout. The adapter gives them one deadline, set when it is
// made: a key that arrives late uses up the time, and the next wait gets only
// what is left (before: a fresh timeout each, 1.6 s here at the least).
TEST(GlooStoreAdapterTest, SuccessiveWaitsShareOneDeadline) {
  auto kv = MakeStore("deadline");
  const absl::Duration timeout = absl::Seconds(1);
  const absl::Time start = absl::Now();
  GlooStoreAdapter adapter(kv, timeout);
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(600));
    EXPECT_TRUE(kv->Set("early", "1").ok());
  });
  EXPECT_NO_THROW(adapter.wait({"early"}, std::chrono::milliseconds(1000)));
  writer.join();
  try {
    adapter.wait({"never"}, std::chrono::milliseconds(1000));
    FAIL() << "wait did not throw";
  } catch (const KeyValueStoreError& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(e.status().message(), HasSubstr("'never'"));
    EXPECT_THAT(e.status().message(), HasSubstr("the rendezvous's 1s ran out"));
  }
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));
  // Past the deadline a get of a key that is set still answers; one that is
  // not fails at once.
  EXPECT_EQ(adapter.get("early"), std::vector<char>{'1'});
  const absl::Time late = absl::Now();
  EXPECT_THROW(adapter.get("never"), KeyValueStoreError);
  EXPECT_LT(absl::Now() - late, absl::Milliseconds(300));
}

}  // namespace
}  // namespace plateau
