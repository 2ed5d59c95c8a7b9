#include "worker/data.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
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
  // Fewer training sequences than a batch (6 tokens: two of seq_len 2 + 1
  // for a batch of 3) would repeat sequences within every batch.
  s = OpenTokenShards({big}, 256, DataSlice{3, 2, 0, 1});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("6 tokens make 2 training sequences of seq_len + 1 = 3 tokens, fewer "
                                              "than layout.batch = 3"));
  EXPECT_TRUE(OpenTokenShards({big}, 256, DataSlice{2, 2, 0, 1}).ok());
  s = OpenTokenShards({big}, 256, DataSlice{1, 3, 0, 2});
  EXPECT_THAT(s.status().message(), HasSubstr("data.seq_len"));
}

// A data path that is not a regular file is the spec's to fix
// (FAILED_PRECONDITION, an invalid job, never restarted), naming what it
// is: a directory opened and read as an error, or as 2^63 bytes of text
// on ext4; a FIFO's open waited for a writer for ever.
TEST(DataFilesTest, APathThatIsNoRegularFileIsRefusedNamingWhatItIs) {
  const std::string dir = TmpPath("a_directory");
  std::filesystem::create_directories(dir);
  auto text = OpenByteText(dir, DataSlice{1, 4, 0, 1});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kFailedPrecondition) << text.status();
  EXPECT_THAT(text.status().message(), HasSubstr("a_directory: expected a regular file, found a directory"));
  auto shards = OpenTokenShards({dir}, 100, DataSlice{1, 4, 0, 1});
  EXPECT_EQ(shards.status().code(), absl::StatusCode::kFailedPrecondition) << shards.status();

  const std::string fifo = TmpPath("a_fifo");
  std::filesystem::remove(fifo);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  text = OpenByteText(fifo, DataSlice{1, 4, 0, 1});  // returns: no writer is needed
  EXPECT_EQ(text.status().code(), absl::StatusCode::kFailedPrecondition) << text.status();
  EXPECT_THAT(text.status().message(), HasSubstr("a_fifo: expected a regular file, found a FIFO"));

  // A Unix socket (Linux refuses its open with ENXIO). Under a short
  // directory of its own: a socket's path has at most 107 bytes.
  char dir_template[] = "/tmp/plateau_sock_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string socket_path = std::string(dir_template) + "/s";
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket_path.c_str());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  text = OpenByteText(socket_path, DataSlice{1, 4, 0, 1});
  close(fd);
  std::filesystem::remove_all(dir_template);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kFailedPrecondition) << text.status();
  EXPECT_THAT(text.status().message(), HasSubstr("expected a regular file, found a socket or a device"));
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

// The fingerprint's sample: the ends and 64 windows between, in order,
// disjoint, inside the stream; a short stream whole.
TEST(StreamFingerprintTest, TheSampleIsTheEndsAndWindowsBetween) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(FingerprintSample(10), (Ranges{{0, 10}}));
  EXPECT_EQ(FingerprintSample(2 * 4096 + 64 * 64), (Ranges{{0, 2 * 4096 + 64 * 64}}));
  for (int64_t tokens : {int64_t{2 * 4096 + 64 * 64 + 1}, int64_t{100000}, int64_t{1} << 40}) {
    const Ranges sample = FingerprintSample(tokens);
    ASSERT_EQ(sample.size(), 66u) << tokens;
    EXPECT_EQ(sample.front(), (std::pair<int64_t, int64_t>{0, 4096}));
    EXPECT_EQ(sample.back(), (std::pair<int64_t, int64_t>{tokens - 4096, 4096}));
    for (size_t i = 1; i < sample.size(); ++i) {
      EXPECT_GE(sample[i].first, sample[i - 1].first + sample[i - 1].second) << tokens << " range " << i;
    }
    // The windows spread over the middle: the last starts in its last 64th.
    EXPECT_GT(sample[64].first, tokens - 4096 - (tokens - 2 * 4096) / 64 - 64) << tokens;
  }
}

// What the trainer compares across ranks and against a checkpoint: equal
// for the same tokens however stored, different for other tokens of the
// same length in the sample or for shards in another order.
TEST(StreamFingerprintTest, SameTokensAgreeOtherContentsDiffer) {
  std::vector<int32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % 251);
  const std::string shard = TmpPath("fp.bin"), text = TmpPath("fp.txt");
  ASSERT_TRUE(WriteTokenShard(shard, tokens).ok());
  {
    std::ofstream f(text, std::ios::binary);
    for (int32_t t : tokens) f.put(static_cast<char>(t));
  }
  const auto fingerprint = [](absl::StatusOr<std::unique_ptr<DataSource>> src) -> uint64_t {
    EXPECT_TRUE(src.ok()) << src.status();
    return src.ok() ? (*src)->stream_fingerprint() : 0;
  };
  const uint64_t base = fingerprint(OpenTokenShards({shard}, 256, DataSlice{1, 8, 0, 1}));
  EXPECT_NE(base, 0u);
  // The same stream: as bytes of text (uint8 against the shard's uint16),
  // on another rank, with a held-out split (the whole stream is hashed).
  EXPECT_EQ(fingerprint(OpenByteText(text, DataSlice{1, 8, 0, 1})), base);
  EXPECT_EQ(fingerprint(OpenTokenShards({shard}, 256, DataSlice{2, 8, 1, 2, 3})), base);

  // One token changed in the first 4,096, in the last, in the first
  // window (which starts at 4,096): each another fingerprint.
  for (size_t at : {size_t{17}, tokens.size() - 1, size_t{4096 + 5}}) {
    std::vector<int32_t> other = tokens;
    other[at] = (other[at] + 1) % 251;
    const std::string path = TmpPath("fp_other.bin");
    ASSERT_TRUE(WriteTokenShard(path, other).ok());
    EXPECT_NE(fingerprint(OpenTokenShards({path}, 256, DataSlice{1, 8, 0, 1})), base) << "token " << at;
  }
  // Between two windows (4,160 .. 4,280 here) no change is seen: the
  // sample's documented limit.
  {
    std::vector<int32_t> other = tokens;
    other[4200] = (other[4200] + 1) % 251;
    const std::string path = TmpPath("fp_unsampled.bin");
    ASSERT_TRUE(WriteTokenShard(path, other).ok());
    EXPECT_EQ(fingerprint(OpenTokenShards({path}, 256, DataSlice{1, 8, 0, 1})), base);
  }
  // Two shards in either order: one length, two streams.
  const std::string a = TmpPath("fp_a.bin"), b = TmpPath("fp_b.bin");
  ASSERT_TRUE(WriteTokenShard(a, {tokens.begin(), tokens.begin() + 9000}).ok());
  ASSERT_TRUE(WriteTokenShard(b, {tokens.begin() + 9000, tokens.end()}).ok());
  EXPECT_EQ(fingerprint(OpenTokenShards({a, b}, 256, DataSlice{1, 8, 0, 1})), base);
  EXPECT_NE(fingerprint(OpenTokenShards({b, a}, 256, DataSlice{1, 8, 0, 1})), base);
  // A generated source has none.
  EXPECT_EQ(fingerprint(OpenAssociativeRecall(RecallTask{}, DataSlice{1, 64, 0, 1})), 0u);
}

// Every sequence a source yields from `batches` global batches (P = 1):
// each as its T tokens followed by its T targets.
std::vector<std::vector<int32_t>> Sequences(DataSource& src, int64_t batches, int64_t B, int64_t T) {
  std::vector<std::vector<int32_t>> out;
  Batch batch;
  for (int64_t i = 0; i < batches; ++i) {
    EXPECT_TRUE(src.Next(&batch).ok());
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int32_t> seq(batch.tokens.begin() + b * T, batch.tokens.begin() + (b + 1) * T);
      seq.insert(seq.end(), batch.targets.begin() + b * T, batch.targets.begin() + (b + 1) * T);
      out.push_back(std::move(seq));
    }
  }
  return out;
}

// A token stream's held-out split is its last held_out * T + 1 tokens: with
// every token its own position, the training stream (over two epochs) never
// reads a position the split reads, the split is the same sequences every
// time it is read from the start, wraps after them, and its rank slices
// tile it. Shards and text are the same stream underneath; both are run.
TEST(HeldOutSplitTest, TokenStreamsHoldOutTheirTailDisjointly) {
  const std::string shard = TmpPath("held.bin"), text = TmpPath("held.txt");
  ASSERT_TRUE(WriteTokenShard(shard, Iota(100, 1000)).ok());
  {
    std::ofstream f(text, std::ios::binary);
    for (int i = 0; i < 100; ++i) f.put(static_cast<char>(i));
  }
  constexpr int64_t T = 8, kHeld = 3;
  for (bool is_text : {false, true}) {
    SCOPED_TRACE(is_text ? "text" : "shards");
    auto open = [&](int64_t B, int64_t p, int64_t P, int64_t held, bool validation) {
      DataSlice slice{B, T, p, P, held, validation};
      return is_text ? OpenByteText(text, slice) : OpenTokenShards({shard}, 1000, slice);
    };
    auto train = open(1, 0, 1, kHeld, false);
    auto held = open(1, 0, 1, kHeld, true);
    ASSERT_TRUE(train.ok()) << train.status();
    ASSERT_TRUE(held.ok()) << held.status();
    std::set<int32_t> train_positions, held_positions;
    // 100 tokens, 25 + 1 held out: tokens [0, 75) train, 9 sequences an epoch.
    for (const auto& seq : Sequences(**train, 18, 1, T)) train_positions.insert(seq.begin(), seq.end());
    EXPECT_EQ(*train_positions.rbegin(), 72);  // sequence 8's last target
    const auto split = Sequences(**held, kHeld, 1, T);
    for (const auto& seq : split) held_positions.insert(seq.begin(), seq.end());
    EXPECT_EQ(*held_positions.begin(), 75);
    EXPECT_EQ(*held_positions.rbegin(), 99);
    for (int32_t t : held_positions) EXPECT_EQ(train_positions.count(t), 0u) << "position " << t << " in both";
    EXPECT_EQ(Sequences(**held, 1, 1, T)[0], split[0]) << "wraps after held_out sequences";
    (*held)->Seek(0);
    EXPECT_EQ(Sequences(**held, kHeld, 1, T), split) << "the same split each time";
    // Two ranks' slices of a batch of 3 held-out sequences tile the split.
    auto r0 = open(kHeld, 0, 2, kHeld, true), r1 = open(kHeld, 1, 2, kHeld, true);
    ASSERT_TRUE(r0.ok() && r1.ok());
    Batch b0, b1;
    ASSERT_TRUE((*r0)->Next(&b0).ok());
    ASSERT_TRUE((*r1)->Next(&b1).ok());
    for (int64_t b = 0; b < kHeld; ++b) {
      for (int64_t i = 0; i < T / 2; ++i) {
        EXPECT_EQ(b0.tokens[b * T / 2 + i], split[b][i]);
        EXPECT_EQ(b1.tokens[b * T / 2 + i], split[b][T / 2 + i]);
        EXPECT_EQ(b1.targets[b * T / 2 + i], split[b][T + T / 2 + i]);
      }
    }
    // Holding out more than leaves one training sequence is refused, naming the field.
    auto greedy = open(1, 0, 1, 12, false);
    EXPECT_EQ(greedy.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(greedy.status().message(), HasSubstr("data.held_out_sequences: 12 sequences hold out 97"));
  }
}

// The recall task splits its sequences by content: no held-out sequence is
// among 4000 training ones, the split repeats after held_out sequences and
// is the same each time, and without a split the stream is unchanged (the
// documented generator's test above pins it).
TEST(HeldOutSplitTest, RecallHoldsOutAClassOfSequencesDisjointly) {
  RecallTask task;
  task.num_keys = 4;  // a small space of sequences, so that a bad split would show
  task.num_values = 2;
  task.pairs = 2;
  task.queries = 1;
  constexpr int64_t T = 16, kHeld = 8;
  auto train = OpenAssociativeRecall(task, DataSlice{4, T, 0, 1, kHeld, false});
  auto held = OpenAssociativeRecall(task, DataSlice{4, T, 0, 1, kHeld, true});
  auto plain = OpenAssociativeRecall(task, DataSlice{4, T, 0, 1});
  ASSERT_TRUE(train.ok() && held.ok() && plain.ok());
  const auto training = Sequences(**train, 1000, 4, T);
  const std::set<std::vector<int32_t>> train_set(training.begin(), training.end());
  const auto split = Sequences(**held, kHeld / 4, 4, T);
  for (const auto& seq : split) EXPECT_EQ(train_set.count(seq), 0u) << "a held-out sequence is trained on";
  // The space is small (4*3 key orders x 4 values x 2 queries): the
  // training stream covers many distinct sequences, and a plain stream
  // (no split) contains held-out ones, so the check above can fail.
  EXPECT_GT(train_set.size(), 20u);
  const auto unsplit = Sequences(**plain, 1000, 4, T);
  const std::set<std::vector<int32_t>> split_set(split.begin(), split.end());
  int in_split = 0;
  for (const auto& seq : unsplit) in_split += split_set.count(seq);
  EXPECT_GT(in_split, 0);
  EXPECT_EQ(Sequences(**held, kHeld / 4, 4, T), split) << "wraps after held_out sequences";
  (*held)->Seek(0);
  EXPECT_EQ(Sequences(**held, kHeld / 4, 4, T), split);
}

// A task with a single distinct sequence has only one class: the split
// that lacks it is refused when opened, naming the field, instead of
// drawing forever (a rank that spins while it heartbeats).
TEST(HeldOutSplitTest, RecallTooSmallToSplitIsRefusedNotASpin) {
  RecallTask task;
  task.num_keys = 1;
  task.num_values = 1;
  task.pairs = 1;
  task.queries = 1;
  constexpr int64_t T = 8;
  auto train = OpenAssociativeRecall(task, DataSlice{1, T, 0, 1, 1, false});
  auto held = OpenAssociativeRecall(task, DataSlice{1, T, 0, 1, 1, true});
  ASSERT_NE(train.ok(), held.ok()) << "one sequence is of exactly one class";
  const absl::Status refused = train.ok() ? held.status() : train.status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("data.held_out_sequences"));
  EXPECT_THAT(refused.message(), HasSubstr("too few distinct sequences"));
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
