#include "worker/data.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/model/config.h"
#include "kernels/model/init.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  if (dir != nullptr) return std::string(dir) + "/" + name;
  // Run by hand: a directory of this process's own, not a fixed /tmp path.
  const std::string own = "/tmp/plateau-test-" + std::to_string(getpid());
  std::filesystem::create_directories(own);
  return own + "/" + name;
}

std::vector<int32_t> Iota(int32_t n, int32_t mod) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = i % mod;
  return t;
}

TEST(TokenShardsTest, SequencesSpanFilesWithNextTokenTargets) {
  // 10 tokens in the first shard, 50 in the second: sequence 1 crosses.
  std::vector<int32_t> all = Iota(60, 1000);
  const std::string a = TmpPath("a.bin"), b = TmpPath("b.bin");
  ASSERT_TRUE(WriteTokenShard(a, {all.begin(), all.begin() + 10}).ok());
  ASSERT_TRUE(WriteTokenShard(b, {all.begin() + 10, all.end()}).ok());
  auto src = OpenTokenShards({a, b}, 1000, DataSlice{2, 8, 0, 1});
  ASSERT_TRUE(src.ok()) << src.status();
  Batch batch;
  ASSERT_TRUE((*src)->Next(&batch).ok());
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(batch.tokens[i], i);
    EXPECT_EQ(batch.targets[i], i + 1);  // sequence i covers [8i, 8i+8]
  }
  EXPECT_EQ((*src)->position(), 2u);
}

TEST(TokenShardsTest, RankSlicesTileTheGlobalBatchAndWrap) {
  const std::string path = TmpPath("c.bin");
  ASSERT_TRUE(WriteTokenShard(path, Iota(41, 50)).ok());  // 5 sequences of 8
  auto whole = OpenTokenShards({path}, 50, DataSlice{3, 8, 0, 1});
  ASSERT_TRUE(whole.ok());
  Batch w;
  for (int step = 0; step < 3; ++step) {  // 9 sequences: wraps after 5
    ASSERT_TRUE((*whole)->Next(&w).ok());
    for (int r = 0; r < 4; ++r) {
      auto part = OpenTokenShards({path}, 50, DataSlice{3, 8, r, 4});
      ASSERT_TRUE(part.ok());
      (*part)->Seek(3 * step);
      Batch p;
      ASSERT_TRUE((*part)->Next(&p).ok());
      for (int b = 0; b < 3; ++b) {
        for (int t = 0; t < 2; ++t) {
          EXPECT_EQ(p.tokens[b * 2 + t], w.tokens[b * 8 + r * 2 + t]);
          EXPECT_EQ(p.targets[b * 2 + t], w.targets[b * 8 + r * 2 + t]);
        }
      }
    }
  }
  // Sequence 5 wrapped to sequence 0.
  EXPECT_EQ(w.tokens[0 * 8], 8 * ((6 % 5)));
}

TEST(TokenShardsTest, BadFilesAreRefusedByName) {
  const std::string bad = TmpPath("bad.bin");
  { std::ofstream(bad) << "not a shard at all"; }
  auto s = OpenTokenShards({bad}, 100, DataSlice{1, 4, 0, 1});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("bad.bin"));

  const std::string trunc = TmpPath("trunc.bin");
  ASSERT_TRUE(WriteTokenShard(trunc, Iota(100, 100)).ok());
  std::FILE* f = std::fopen(trunc.c_str(), "r+");
  ASSERT_EQ(ftruncate(fileno(f), 1024 + 50), 0);
  std::fclose(f);
  s = OpenTokenShards({trunc}, 100, DataSlice{1, 4, 0, 1});
  EXPECT_THAT(s.status().message(), HasSubstr("header says 100 tokens"));

  s = OpenTokenShards({TmpPath("missing.bin")}, 100, DataSlice{1, 4, 0, 1});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);

  const std::string big = TmpPath("big.bin");
  ASSERT_TRUE(WriteTokenShard(big, {1, 2, 300, 4, 5, 6}).ok());
  auto src = OpenTokenShards({big}, 256, DataSlice{1, 4, 0, 1});
  ASSERT_TRUE(src.ok());
  Batch b;
  absl::Status st = (*src)->Next(&b);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(st.message(), HasSubstr("token 300"));

  s = OpenTokenShards({big}, 256, DataSlice{1, 6, 0, 1});
  EXPECT_THAT(s.status().message(), HasSubstr("fewer than one sequence"));
  s = OpenTokenShards({big}, 256, DataSlice{1, 3, 0, 2});
  EXPECT_THAT(s.status().message(), HasSubstr("data.seq_len"));
}

TEST(ByteTextTest, EveryByteIsAToken) {
  const std::string path = TmpPath("t.txt");
  { std::ofstream(path) << "hello, world"; }
  auto src = OpenByteText(path, DataSlice{1, 4, 1, 2});
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ((*src)->vocab_size(), 256);
  Batch b;
  ASSERT_TRUE((*src)->Next(&b).ok());
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{'l', 'l'}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{'l', 'o'}));
}

TEST(AssociativeRecallTest, AnswersAreTheValuesOfEarlierKeys) {
  RecallTask task;
  auto src = OpenAssociativeRecall(task, DataSlice{4, 64, 0, 1});
  ASSERT_TRUE(src.ok()) << src.status();
  Batch b;
  ASSERT_TRUE((*src)->Next(&b).ok());
  for (int s = 0; s < 4; ++s) {
    std::map<int32_t, int32_t> kv;
    int answers = 0;
    for (int t = 0; t < 64; ++t) {
      int32_t tok = b.tokens[s * 64 + t], tgt = b.targets[s * 64 + t];
      ASSERT_GE(tok, 0);
      ASSERT_LT(tok, task.vocab_size());
      if (t > 0 && b.tokens[s * 64 + t - 1] == 1) {  // key after QUERY
        ASSERT_TRUE(kv.count(tok)) << "query for a key never shown";
        EXPECT_EQ(tgt, kv[tok]);
        ++answers;
      } else {
        EXPECT_EQ(tgt, kIgnoreIndex);
        if (tok >= 2 && tok < 2 + task.num_keys && t + 1 < 64) kv[tok] = b.tokens[s * 64 + t + 1];
      }
    }
    EXPECT_EQ(answers, task.queries);
    EXPECT_EQ(kv.size(), static_cast<size_t>(task.pairs));
  }
}

TEST(AssociativeRecallTest, DeterministicAndSliceable) {
  RecallTask task;
  task.seed = 7;
  auto whole = OpenAssociativeRecall(task, DataSlice{2, 64, 0, 1});
  auto again = OpenAssociativeRecall(task, DataSlice{2, 64, 0, 1});
  auto half = OpenAssociativeRecall(task, DataSlice{2, 64, 1, 2});
  ASSERT_TRUE(whole.ok() && again.ok() && half.ok());
  Batch w, a, h;
  (*whole)->Seek(10);
  (*again)->Seek(10);
  (*half)->Seek(10);
  ASSERT_TRUE((*whole)->Next(&w).ok());
  ASSERT_TRUE((*again)->Next(&a).ok());
  ASSERT_TRUE((*half)->Next(&h).ok());
  EXPECT_EQ(w.tokens, a.tokens);
  EXPECT_EQ(w.targets, a.targets);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 32; ++t) EXPECT_EQ(h.tokens[b * 32 + t], w.tokens[b * 64 + 32 + t]);
  Batch next;
  ASSERT_TRUE((*whole)->Next(&next).ok());
  EXPECT_NE(next.tokens, w.tokens);
}

// docs/MODEL.md, "Data": the recall generator written out from the page.
void DocumentedRecall(const RecallTask& t, int64_t T, uint64_t i, std::vector<int32_t>* x,
                      std::vector<int32_t>* y) {
  const int64_t K = t.num_keys, W = t.num_values, np = t.pairs, nq = t.queries;
  uint64_t c = Mix64(t.seed) ^ Mix64(i * 0x9e3779b97f4a7c15ULL + 1);
  auto next = [&c](uint64_t n) {
    const uint64_t r = Mix64(c) % n;
    c = c + 1;
    return static_cast<int64_t>(r);
  };
  std::vector<int32_t> keys(K), vals(np);
  for (int64_t j = 0; j < K; ++j) keys[j] = static_cast<int32_t>(2 + j);
  for (int64_t j = 0; j < np; ++j) std::swap(keys[j], keys[j + next(K - j)]);
  for (int64_t j = 0; j < np; ++j) vals[j] = static_cast<int32_t>(K + 2 + next(W));
  x->assign(T, 0);
  y->assign(T, kIgnoreIndex);
  const int64_t R = T - 3 * nq;
  for (int64_t j = 0; j < np; ++j) {
    const int64_t a = j * (R / np);
    (*x)[a] = keys[j];
    (*x)[a + 1] = vals[j];
  }
  std::vector<int64_t> asked(np);
  for (int64_t j = 0; j < np; ++j) asked[j] = j;
  for (int64_t q = 0; q < nq; ++q) {
    std::swap(asked[q], asked[q + next(np - q)]);
    const int64_t a = R + 3 * q;
    (*x)[a] = 1;
    (*x)[a + 1] = keys[asked[q]];
    (*x)[a + 2] = vals[asked[q]];
    (*y)[a + 1] = vals[asked[q]];
  }
}

// The generator is the page's, for the default data seed 1 and another,
// tasks of several shapes, and batches after the first; a different data
// seed gives a different stream.
TEST(AssociativeRecallTest, FollowsTheDocumentedGenerator) {
  EXPECT_EQ(RecallTask{}.seed, 1u);  // the documented default
  RecallTask small;
  small.num_keys = 8;
  small.num_values = 8;
  small.pairs = 4;
  small.queries = 4;
  RecallTask odd;
  odd.num_keys = 5;
  odd.num_values = 3;
  odd.pairs = 5;
  odd.queries = 2;
  for (RecallTask task : {RecallTask{}, small, odd}) {
    for (uint64_t seed : {uint64_t{1}, uint64_t{0xfeedbeef12345678}}) {
      task.seed = seed;
      const int64_t B = 3, T = 37;
      auto src = OpenAssociativeRecall(task, DataSlice{B, T, 0, 1});
      ASSERT_TRUE(src.ok()) << src.status();
      Batch b;
      std::vector<int32_t> x, y;
      for (int step = 0; step < 2; ++step) {
        ASSERT_TRUE((*src)->Next(&b).ok());
        for (int64_t r = 0; r < B; ++r) {
          DocumentedRecall(task, T, step * B + r, &x, &y);
          EXPECT_EQ(std::vector<int32_t>(b.tokens.begin() + r * T, b.tokens.begin() + (r + 1) * T), x)
              << "seed " << seed << ", sequence " << step * B + r;
          EXPECT_EQ(std::vector<int32_t>(b.targets.begin() + r * T, b.targets.begin() + (r + 1) * T), y)
              << "seed " << seed << ", sequence " << step * B + r;
        }
      }
    }
  }
  RecallTask a, other;
  other.seed = 2;
  auto sa = OpenAssociativeRecall(a, DataSlice{4, 64, 0, 1});
  auto so = OpenAssociativeRecall(other, DataSlice{4, 64, 0, 1});
  ASSERT_TRUE(sa.ok() && so.ok());
  Batch ba, bo;
  ASSERT_TRUE((*sa)->Next(&ba).ok() && (*so)->Next(&bo).ok());
  EXPECT_NE(ba.tokens, bo.tokens);
}

TEST(AssociativeRecallTest, RefusesImpossibleTasks) {
  RecallTask task;
  task.pairs = 20;  // > num_keys
  EXPECT_THAT(OpenAssociativeRecall(task, DataSlice{1, 64, 0, 1}).status().message(),
              HasSubstr("data.recall.pairs"));
  task = {};
  EXPECT_THAT(OpenAssociativeRecall(task, DataSlice{1, 20, 0, 1}).status().message(),
              HasSubstr("too short"));
}

}  // namespace
}  // namespace plateau
