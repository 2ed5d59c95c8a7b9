#include "kernels/kv_store.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A fresh directory under the test's private temporary directory.
std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kv_", name,
                                 "_", ::getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

std::unique_ptr<FileStore> MakeStore(const std::string& name) {
  auto store = FileStore::Create(FreshDir(name));
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(store).value();
}

TEST(FileStoreTest, SetThenGetAndOverwrite) {
  auto store = MakeStore("set_get");
  ASSERT_TRUE(store->Set("job1/world/rank_0", "addr0").ok());
  auto v = store->Get("job1/world/rank_0", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "addr0");
  ASSERT_TRUE(store->Set("job1/world/rank_0", "addr0-v2").ok());
  v = store->Get("job1/world/rank_0", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "addr0-v2");
}

TEST(FileStoreTest, BinaryAndEmptyValues) {
  auto store = MakeStore("binary");
  std::string binary("a\0b\xff\n", 5);
  std::string big(100000, 'x');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(store->Set("bin", binary).ok());
  ASSERT_TRUE(store->Set("empty", "").ok());
  ASSERT_TRUE(store->Set("big", big).ok());
  EXPECT_EQ(store->Get("bin", absl::ZeroDuration()).value(), binary);
  EXPECT_EQ(store->Get("empty", absl::ZeroDuration()).value(), "");
  EXPECT_EQ(store->Get("big", absl::ZeroDuration()).value(), big);
}

TEST(FileStoreTest, EscapedKeysDoNotCollide) {
  auto store = MakeStore("escape");
  // "/" must not create subdirectories nor clash with its escaped spelling;
  // long keys that share a prefix keep distinct files.
  const std::string long_a = std::string(300, 'p') + "a";
  const std::string long_b = std::string(300, 'p') + "b";
  const std::vector<std::string> keys = {"a/b", "a%2Fb", "..", ".", "",
                                         "sp ace", long_a, long_b};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(store->Set(keys[i], absl::StrCat("v", i)).ok()) << keys[i];
  }
  std::set<std::string> paths;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto v = store->Get(keys[i], absl::ZeroDuration());
    ASSERT_TRUE(v.ok()) << keys[i] << ": " << v.status();
    EXPECT_EQ(*v, absl::StrCat("v", i)) << keys[i];
    paths.insert(store->PathOf(keys[i]));
    EXPECT_LT(std::filesystem::path(store->PathOf(keys[i]))
                  .filename()
                  .string()
                  .size(),
              255u);
  }
  EXPECT_EQ(paths.size(), keys.size());
  // Only the published files remain: no temporaries, no subdirectories.
  int files = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(store->directory())) {
    EXPECT_TRUE(entry.is_regular_file()) << entry.path();
    EXPECT_THAT(entry.path().filename().string(), StartsWith("k_"));
    ++files;
  }
  EXPECT_EQ(files, static_cast<int>(keys.size()));
}

TEST(FileStoreTest, GetWaitsForAKeySetLater) {
  auto store = MakeStore("wait");
  const absl::Time start = absl::Now();
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(150));
    EXPECT_TRUE(store->Set("late", "here").ok());
  });
  auto v = store->Get("late", absl::Seconds(10));
  const absl::Duration waited = absl::Now() - start;
  writer.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "here");
  EXPECT_GE(waited, absl::Milliseconds(150));
  EXPECT_LT(waited, absl::Seconds(5));
}

TEST(FileStoreTest, TimeoutNamesTheKey) {
  auto store = MakeStore("timeout");
  const absl::Time start = absl::Now();
  auto v = store->Get("job9/world/rank_3", absl::Milliseconds(80));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(v.status().message(), HasSubstr("'job9/world/rank_3'"));
  EXPECT_GE(waited, absl::Milliseconds(80));
  EXPECT_LT(waited, absl::Seconds(5));
}

TEST(FileStoreTest, CheckDoesNotWait) {
  auto store = MakeStore("check");
  auto c = store->Check({"x", "y"});
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(*c);
  ASSERT_TRUE(store->Set("x", "1").ok());
  EXPECT_FALSE(store->Check({"x", "y"}).value());
  ASSERT_TRUE(store->Set("y", "2").ok());
  EXPECT_TRUE(store->Check({"x", "y"}).value());
  EXPECT_TRUE(store->Check({}).value());
}

TEST(FileStoreTest, CreateValidatesTheDirectory) {
  auto empty = FileStore::Create("");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("directory"));

  const std::string file = FreshDir("a_file");
  ASSERT_TRUE(FileStore::Create(file).ok());  // make the parent
  const std::string not_dir = file + "/plain";
  FILE* f = fopen(not_dir.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fclose(f);
  auto bad = FileStore::Create(not_dir);
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr(not_dir));
}

TEST(FileStoreTest, ConcurrentWritersNeverExposeATornValue) {
  auto store = MakeStore("torn");
  constexpr int kWriters = 4;
  constexpr int kSize = 64 * 1024;
  std::vector<std::string> values;
  for (int w = 0; w < kWriters; ++w) {
    values.push_back(std::string(kSize, static_cast<char>('a' + w)));
  }
  ASSERT_TRUE(store->Set("k", values[0]).ok());
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < 50 && !stop.load(); ++i) {
        EXPECT_TRUE(store->Set("k", values[w]).ok());
      }
    });
  }
  int reads = 0;
  for (; reads < 300; ++reads) {
    auto v = store->Get("k", absl::Seconds(1));
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(v->size(), static_cast<size_t>(kSize));
    ASSERT_EQ(std::count(v->begin(), v->end(), (*v)[0]), kSize)
        << "a reader saw a mix of two writes";
  }
  stop.store(true);
  for (auto& t : writers) t.join();
}

TEST(FileStoreTest, TwoProcessesShareOneDirectory) {
  const std::string dir = FreshDir("two_procs");
  ASSERT_TRUE(FileStore::Create(dir).ok());
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child answers the parent's ping through its own FileStore.
    auto store = FileStore::Create(dir);
    if (!store.ok()) ::_exit(2);
    auto ping = (*store)->Get("ping", absl::Seconds(20));
    if (!ping.ok()) ::_exit(3);
    if (!(*store)->Set("pong", *ping + "/pong").ok()) ::_exit(4);
    ::_exit(0);
  }
  auto store = FileStore::Create(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Set("ping", absl::StrCat("from ", ::getpid())).ok());
  auto pong = (*store)->Get("pong", absl::Seconds(20));
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);
  ASSERT_TRUE(pong.ok()) << pong.status();
  EXPECT_EQ(*pong, absl::StrCat("from ", ::getpid(), "/pong"));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// On a shared file system two hosts' writers can pick the same temporary
// name (before: t_<pid>_<thread hash>_<counter>, the same for the first Set
// of two ranks with equal pids). A name that is taken is another writer's
// temporary: Set leaves it alone and takes another name (before: the
// O_EXCL create failed and so did the rank's rendezvous, UNAVAILABLE).
TEST(FileStoreTest, ATakenTemporaryNameIsLeftAloneAndAnotherTaken) {
  auto store = MakeStore("taken");
  const std::vector<std::string> names = {"t_taken", "t_taken", "t_free"};
  size_t next = 0;
  store->SetTemporaryNamesForTesting([&] { return names[std::min(next++, names.size() - 1)]; });
  const std::string theirs = absl::StrCat(store->directory(), "/t_taken");
  {
    std::ofstream out(theirs, std::ios::binary);
    out << "another writer's value";
  }
  ASSERT_TRUE(store->Set("k", "mine").ok());
  EXPECT_EQ(next, 3u);
  auto v = store->Get("k", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "mine");
  EXPECT_EQ(ReadFile(theirs), "another writer's value");
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(store->directory(), "/t_free")));
}

// Names that stay taken end the tries: UNAVAILABLE naming the key.
TEST(FileStoreTest, TemporaryNamesAlwaysTakenFailTheSet) {
  auto store = MakeStore("always_taken");
  store->SetTemporaryNamesForTesting([] { return std::string("t_taken"); });
  { std::ofstream out(absl::StrCat(store->directory(), "/t_taken")); }
  absl::Status s = store->Set("k", "mine");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("(setting key 'k')"));
  EXPECT_TRUE(std::filesystem::exists(absl::StrCat(store->directory(), "/t_taken")));
}

// t_<host>_<pid>_<64 random bits>_<counter>: the random bits differ from
// name to name, even in one thread.
TEST(FileStoreTest, TemporaryNamesCarryTheHostThePidAndRandomBits) {
  const std::string a = FileStore::TemporaryName(), b = FileStore::TemporaryName();
  const std::string pid = absl::StrCat("_", ::getpid(), "_");
  for (const std::string& name : {a, b}) {
    EXPECT_THAT(name, ::testing::MatchesRegex("t_[-A-Za-z0-9]+_[0-9]+_[0-9a-f]{16}_[0-9]+")) << name;
    EXPECT_THAT(name, HasSubstr(pid));
  }
  const auto random_bits = [](const std::string& name) {
    const size_t end = name.rfind('_');
    return name.substr(end - 16, 16);
  };
  EXPECT_NE(random_bits(a), random_bits(b));
}

}  // namespace
}  // namespace plateau
