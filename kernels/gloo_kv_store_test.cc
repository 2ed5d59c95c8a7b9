#include "kernels/gloo_kv_store.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace plateau
