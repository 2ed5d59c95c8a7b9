#include "worker/trainer.h"

#include <cmath>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

std::string TmpDir(const std::string& name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

// Runs RunTraining on P rank threads; returns rank 0's per-step losses and
// the world's status.
struct TrainRun {
  std::vector<double> losses;
  absl::Status status;
};

TrainRun Train(const TrainerOptions& o, int P) {
  TrainRun run;
  run.status = RunLocalWorld(P, 256 << 20, FreshStoreDir("train"),
                             [&](int r, Backend& be, Communicator& world) {
                               return RunTraining(o, be, world, [&](const StepReport& rep) {
                                 if (r == 0) run.losses.push_back(rep.stats.loss);
                               });
                             });
  return run;
}

TrainerOptions RecallOptions(int P) { return RecallDemoJob(P); }

// 200 steps on the associative-recall task. Only the answers are targets, so
// a model that ignores the context can at best spread its bet over the
// values: loss ln(8) = 2.08. The start is ~ln(vocab = 18) = 2.89. Ending
// clearly below ln(8) (by 0.3 nats, averaged over the last 20 steps) means
// the model retrieves values from the context — it has learned the task,
// not just the answer format.
TEST(TrainerTest, LearnsAssociativeRecallIn200Steps) {
  TrainerOptions o = RecallOptions(2);
  ASSERT_EQ(o.steps, 200);
  TrainRun run = Train(o, 2);
  ASSERT_TRUE(run.status.ok()) << run.status;
  ASSERT_EQ(run.losses.size(), 200u);
  double tail = 0;
  for (int i = 180; i < 200; ++i) tail += run.losses[i] / 20;
  EXPECT_NEAR(run.losses[0], std::log(18.0), 0.15);
  EXPECT_LT(tail, std::log(8.0) - 0.3) << "first " << run.losses[0] << ", last-20 mean " << tail;
}

// Stopping at a checkpoint and resuming in fresh objects continues the
// uninterrupted loss curve bit for bit (weights, AdamW state, step and data
// position all come back from the safetensors file).
TEST(TrainerTest, ResumeReproducesTheUninterruptedRunBitForBit) {
  TrainerOptions o = RecallOptions(2);
  o.steps = 6;
  o.checkpoint_dir = TmpDir("ckpt_straight");
  TrainRun straight = Train(o, 2);
  ASSERT_TRUE(straight.status.ok()) << straight.status;
  ASSERT_EQ(straight.losses.size(), 6u);

  o.checkpoint_dir = TmpDir("ckpt_resumed");
  o.steps = 3;
  TrainRun first = Train(o, 2);
  ASSERT_TRUE(first.status.ok()) << first.status;
  o.steps = 6;
  TrainRun second = Train(o, 2);  // resumes from step-00000003
  ASSERT_TRUE(second.status.ok()) << second.status;
  ASSERT_EQ(first.losses.size(), 3u);
  ASSERT_EQ(second.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(first.losses[i], straight.losses[i]) << "step " << i + 1;
    EXPECT_EQ(second.losses[i], straight.losses[3 + i]) << "step " << i + 4;
  }
  // The final checkpoints are identical files' worth of state.
  std::ifstream a(CheckpointPath(TmpDir("ckpt_straight"), 6), std::ios::binary);
  std::ifstream b(CheckpointPath(TmpDir("ckpt_resumed"), 6), std::ios::binary);
  std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(sa.empty());
  EXPECT_EQ(sa, sb);
}

TEST(TrainerTest, TrainsOnByteLevelText) {
  const std::string path = TmpDir("corpus.txt");
  {
    std::ofstream f(path);
    for (int i = 0; i < 200; ++i) f << "the quick brown fox jumps over the lazy dog. ";
  }
  TrainerOptions o = RecallOptions(2);
  o.data.kind = DataOptions::Kind::kText;
  o.data.paths = {path};
  o.step.model.vocab_size = 256;
  o.step.layout.batch = 4;
  o.steps = 20;
  TrainRun run = Train(o, 2);
  ASSERT_TRUE(run.status.ok()) << run.status;
  ASSERT_EQ(run.losses.size(), 20u);
  EXPECT_LT(run.losses.back(), run.losses.front() - 1.0);  // a repetitive text is easy
}

TEST(TrainerTest, DataLargerThanTheVocabularyIsRefused) {
  TrainerOptions o = RecallOptions(1);
  o.step.model.vocab_size = 10;  // the task needs 18
  TrainRun run = Train(o, 1);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status.message(), HasSubstr("model.vocab_size"));
}

}  // namespace
}  // namespace plateau
