#include "worker/trainer.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/model/config.h"
#include "kernels/model/init.h"
#include "kernels/model/precision.h"
#include "kernels/model/reference.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/testing/local_world.h"
#include "worker/checkpoint_fence.h"
#include "worker/safetensors.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TmpDir(const std::string& name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

// Runs RunTraining on P rank threads; returns rank 0's per-step losses and
// the world's status.
struct TrainRun {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::vector<double> lrs;  // StepReport::lr
  std::vector<int64_t> validation_steps;
  std::vector<double> validation;  // StepReport::validation_loss on those steps
  absl::Status status;
};

TrainRun Train(const TrainerOptions& o, int P) {
  TrainRun run;
  run.status = RunLocalWorld(P, 256 << 20, FreshStoreDir("train"),
                             [&](int r, Backend& be, Communicator& world) {
                               return RunTraining(o, be, world, [&](const StepReport& rep) {
                                 if (r != 0) return;
                                 run.losses.push_back(rep.stats.loss);
                                 run.grad_norms.push_back(rep.stats.grad_norm);
                                 run.lrs.push_back(rep.lr);
                                 if (rep.has_validation) {
                                   run.validation_steps.push_back(rep.stats.step);
                                   run.validation.push_back(rep.validation_loss);
                                 }
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
void ExpectLearnsRecallIn200Steps(const TrainerOptions& o, const char* what) {
  ASSERT_EQ(o.steps, 200);
  TrainRun run = Train(o, 2);
  ASSERT_TRUE(run.status.ok()) << run.status;
  ASSERT_EQ(run.losses.size(), 200u);
  double tail = 0;
  for (int i = 180; i < 200; ++i) tail += run.losses[i] / 20;
  EXPECT_NEAR(run.losses[0], std::log(18.0), 0.15);
  EXPECT_LT(tail, std::log(8.0) - 0.3) << "first " << run.losses[0] << ", last-20 mean " << tail;
  std::printf("%s: first %.4f, last-20 mean %.4f\n", what, run.losses[0], tail);
}

// Only names CheckpointPath writes are checkpoints: "step-42" or
// "step-+50" were taken for steps 42 and 50, whose files would then be
// read as "step-00000042" and "step-00000050", which do not exist.
TEST(TrainerTest, TheNewestCheckpointIsAmongTheNamesTheTrainerWrites) {
  const std::string dir = TmpDir("newest");
  std::filesystem::create_directories(dir);
  for (const char* name : {"step-42.safetensors", "step-+50.safetensors", "step-00000007.safetensors",
                           "step-00000009.safetensors.partial", "step--0000001.safetensors"}) {
    std::ofstream(dir + "/" + name) << "x";
  }
  absl::StatusOr<int64_t> newest = NewestCheckpoint(dir);
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(*newest, 7);
  EXPECT_EQ(*NewestCheckpoint(dir + "/not_made_yet"), -1);
}

// A killed writer's "step-N.safetensors.tmp.PID" (a whole checkpoint's
// bytes) is removed when a run without the fence starts; a live writer's
// file and other names stay.
TEST(TrainerTest, AKilledWritersTemporaryIsRemovedAtTheNextStart) {
  TrainerOptions o = RecallOptions(1);
  o.step.layout.batch = 4;
  o.steps = 1;
  o.checkpoint_dir = TmpDir("abandoned");
  std::filesystem::create_directories(o.checkpoint_dir);
  // A pid that was a process and is no more: a child that exited, reaped.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const std::string dead = "step-00000003.safetensors.tmp." + std::to_string(child);
  const std::string live = "step-00000003.safetensors.tmp." + std::to_string(getpid());
  const std::string other = "notes.safetensors.tmp." + std::to_string(child);
  for (const std::string& name : {dead, live, other}) std::ofstream(o.checkpoint_dir + "/" + name) << "x";
  TrainRun run = Train(o, 1);
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_FALSE(std::filesystem::exists(o.checkpoint_dir + "/" + dead));
  EXPECT_TRUE(std::filesystem::exists(o.checkpoint_dir + "/" + live));
  EXPECT_TRUE(std::filesystem::exists(o.checkpoint_dir + "/" + other));
  EXPECT_TRUE(std::filesystem::exists(CheckpointPath(o.checkpoint_dir, 1)));
  absl::StatusOr<std::vector<std::string>> again = RemoveAbandonedCheckpointFiles(o.checkpoint_dir);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->empty());
  EXPECT_TRUE(RemoveAbandonedCheckpointFiles(o.checkpoint_dir + "/not_made_yet")->empty());
}

TEST(TrainerTest, LearnsAssociativeRecallIn200Steps) {
  ExpectLearnsRecallIn200Steps(RecallOptions(2), "fp32");
}

// The same job in bf16 mixed precision (bf16 working weights, activations
// and gradients; fp32 masters, moments, loss and reductions) learns the task
// by the same measure: the precision the GPU trains in does not cost the
// demo its learning, on the CPU's bf16 arithmetic (kernels/cpu_bf16_ops.h,
// the CUDA kernels' twin).
TEST(TrainerTest, LearnsAssociativeRecallIn200StepsInBf16) {
  TrainerOptions o = RecallOptions(2);
  o.step.precision = Precision::kBf16Mixed;
  ExpectLearnsRecallIn200Steps(o, "bf16");
}

// Stopping at a checkpoint and resuming in fresh objects continues the
// uninterrupted loss curve bit for bit (weights, AdamW state, step and data
// position all come back from the safetensors file).
// `fenced`: the resumed run's two parts write as the service's attempts 0
// and 1 of one job do (worker/checkpoint_fence.h: a partial file, then the
// commit under the fence), not straight to the final names.
void ExpectResumeReproducesTheUninterruptedRun(Precision precision, const std::string& name, bool fenced = false) {
  TrainerOptions o = RecallOptions(2);
  o.step.precision = precision;
  o.steps = 6;
  o.checkpoint_dir = TmpDir(name + "_straight");
  TrainRun straight = Train(o, 2);
  ASSERT_TRUE(straight.status.ok()) << straight.status;
  ASSERT_EQ(straight.losses.size(), 6u);

  o.checkpoint_dir = TmpDir(name + "_resumed");
  o.steps = 3;
  if (fenced) {
    o.fence_job = "job-7";
    o.fence_attempt = 0;
  }
  TrainRun first = Train(o, 2);
  ASSERT_TRUE(first.status.ok()) << first.status;
  o.steps = 6;
  if (fenced) o.fence_attempt = 1;
  TrainRun second = Train(o, 2);  // resumes from step-00000003
  ASSERT_TRUE(second.status.ok()) << second.status;
  ASSERT_EQ(first.losses.size(), 3u);
  ASSERT_EQ(second.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(first.losses[i], straight.losses[i]) << "step " << i + 1;
    EXPECT_EQ(second.losses[i], straight.losses[3 + i]) << "step " << i + 4;
  }
  // The final checkpoints are identical files' worth of state.
  std::ifstream a(CheckpointPath(TmpDir(name + "_straight"), 6), std::ios::binary);
  std::ifstream b(CheckpointPath(TmpDir(name + "_resumed"), 6), std::ios::binary);
  std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(sa.empty());
  EXPECT_EQ(sa, sb);
  if (fenced) {
    // Every partial file was committed or removed; the fence names attempt 1.
    for (const auto& e : std::filesystem::directory_iterator(TmpDir(name + "_resumed"))) {
      EXPECT_NE(e.path().filename().string().rfind(".partial-", 0), 0u) << e.path();
    }
    auto fence = ReadCheckpointFence(TmpDir(name + "_resumed"));
    ASSERT_TRUE(fence.ok()) << fence.status();
    EXPECT_EQ(fence->job, "job-7");
    EXPECT_EQ(fence->attempt, 1);
  }
}

// The same through the service's fenced commits (attempt 0 writes steps
// 1-3, attempt 1 resumes): every resume test above writes unfenced, and
// only multinode_test ran the fenced path.
TEST(TrainerTest, ResumeThroughFencedCommitsIsBitForBit) {
  ExpectResumeReproducesTheUninterruptedRun(Precision::kFp32, "ckpt_fenced", /*fenced=*/true);
}

TEST(TrainerTest, ResumeReproducesTheUninterruptedRunBitForBit) {
  ExpectResumeReproducesTheUninterruptedRun(Precision::kFp32, "ckpt_fp32");
}

// The "step-N.safetensors" files in `dir`, by step.
std::vector<int64_t> CheckpointSteps(const std::string& dir) {
  std::vector<int64_t> steps;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    if (name.size() == 25 && name.rfind("step-", 0) == 0 && name.substr(13) == ".safetensors" &&
        absl::SimpleAtoi(name.substr(5, 8), &step)) {
      steps.push_back(step);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Retention removes only the trainer's own names of steps before the one
// just written, keeping the keep_last newest, the newest always; other
// names, partial and temporary files, and a later step (not this run's to
// judge) stay. keep_last 0 keeps everything.
TEST(TrainerTest, RetentionRemovesOnlyOlderCheckpointsOfTheTrainersNames) {
  const std::string dir = TmpDir("retention_names");
  std::filesystem::create_directories(dir);
  for (int64_t step : {1, 2, 3, 4, 5, 9}) std::ofstream(CheckpointPath(dir, step)) << std::string(step * 10, 'x');
  const std::vector<std::string> others = {"step-3.safetensors", "step-00000002.safetensors.tmp.4242",
                                           ".partial-job-7-attempt-0-step-4.safetensors", "notes.txt",
                                           "step-00000001.safetensors.bak"};
  for (const std::string& name : others) std::ofstream(dir + "/" + name) << "x";

  absl::StatusOr<CheckpointRetention> none = RemoveOldCheckpoints(dir, 5, 0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->removed.empty());
  EXPECT_EQ(none->kept, (std::vector<int64_t>{5, 4, 3, 2, 1}));
  EXPECT_EQ(none->kept_bytes, 150);
  EXPECT_EQ(CheckpointSteps(dir), (std::vector<int64_t>{1, 2, 3, 4, 5, 9}));

  absl::StatusOr<CheckpointRetention> two = RemoveOldCheckpoints(dir, 5, 2);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->kept, (std::vector<int64_t>{5, 4}));
  EXPECT_EQ(two->kept_bytes, 90);
  EXPECT_EQ(two->removed, (std::vector<std::string>{"step-00000003.safetensors", "step-00000002.safetensors",
                                                    "step-00000001.safetensors"}));
  EXPECT_TRUE(two->failed.empty());
  EXPECT_EQ(CheckpointSteps(dir), (std::vector<int64_t>{4, 5, 9}));

  absl::StatusOr<CheckpointRetention> one = RemoveOldCheckpoints(dir, 5, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->kept, std::vector<int64_t>{5});
  EXPECT_EQ(one->removed, std::vector<std::string>{"step-00000004.safetensors"});
  EXPECT_EQ(CheckpointSteps(dir), (std::vector<int64_t>{5, 9}));
  for (const std::string& name : others) EXPECT_TRUE(std::filesystem::exists(dir + "/" + name)) << name;
}

// checkpoint.keep_last over three runs of one job (as its attempts): the
// first keeps every checkpoint (0), the second 2, the third 1. After every
// save exactly the keep_last newest stay, the one just written among them,
// and what an earlier run left beyond that (as a crash between a write and
// its removals would) goes at the next save. Each run resumes from the
// newest kept checkpoint, and the whole is the uninterrupted run to the
// bit. Each save is said on the job's log with its path, step, bytes and
// what it removed.
void ExpectKeepLastKeepsTheNewestAndResumesBitForBit(const std::string& name, bool fenced) {
  TrainerOptions o = RecallOptions(2);
  o.steps = 6;
  o.checkpoint_dir = TmpDir(name + "_straight");
  TrainRun straight = Train(o, 2);
  ASSERT_TRUE(straight.status.ok()) << straight.status;
  ASSERT_EQ(straight.losses.size(), 6u);

  const std::string dir = o.checkpoint_dir = TmpDir(name + "_kept");
  o.checkpoint_every = 1;
  if (fenced) o.fence_job = "job-8";
  absl::Mutex mu;  // both ranks say their resume, each on its thread
  std::vector<std::string> said;
  std::vector<std::vector<int64_t>> on_disk;  // the directory as each save's line is said
  o.say = [&](const std::string& line) {
    absl::MutexLock lock(&mu);
    if (line.rfind("resumed", 0) == 0) return;
    said.push_back(line);
    on_disk.push_back(CheckpointSteps(dir));
  };
  std::vector<double> losses;
  const struct {
    int64_t steps, keep_last;
    std::vector<std::vector<int64_t>> after_each_save;
  } runs[] = {{2, 0, {{1}, {1, 2}}}, {4, 2, {{2, 3}, {3, 4}}}, {6, 1, {{5}, {6}}}};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(absl::StrCat("run to step ", runs[i].steps, ", keep_last ", runs[i].keep_last));
    o.steps = runs[i].steps;
    o.checkpoint_keep_last = runs[i].keep_last;
    if (fenced) o.fence_attempt = i;
    said.clear();
    on_disk.clear();
    TrainRun run = Train(o, 2);
    ASSERT_TRUE(run.status.ok()) << run.status;
    ASSERT_EQ(run.losses.size(), 2u);
    losses.insert(losses.end(), run.losses.begin(), run.losses.end());
    EXPECT_EQ(on_disk, runs[i].after_each_save);
    ASSERT_EQ(said.size(), 2u);
    for (int k = 0; k < 2; ++k) {
      const int64_t step = runs[i].steps - 1 + k;
      EXPECT_THAT(said[k], AllOf(HasSubstr(absl::StrCat("checkpoint: wrote ", CheckpointPath(dir, step), " (step ",
                                                        step, " of ", runs[i].steps, ", ")),
                                 HasSubstr(absl::StrCat(" bytes (checkpoint.keep_last = ", runs[i].keep_last, ")"))));
    }
  }
  // What each line says it removed, and its bytes.
  EXPECT_THAT(said[0], HasSubstr("; removed step-00000004.safetensors, step-00000003.safetensors; keeping 1 "));
  const int64_t bytes = std::filesystem::file_size(CheckpointPath(dir, 6));
  EXPECT_EQ(said[1], absl::StrCat("checkpoint: wrote ", CheckpointPath(dir, 6), " (step 6 of 6, ", bytes,
                                  " bytes); removed step-00000005.safetensors; keeping 1 checkpoint(s), ", bytes,
                                  " bytes (checkpoint.keep_last = 1)"));
  EXPECT_EQ(losses, straight.losses);
  std::ifstream a(CheckpointPath(TmpDir(name + "_straight"), 6), std::ios::binary);
  std::ifstream b(CheckpointPath(dir, 6), std::ios::binary);
  std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(sa.empty());
  EXPECT_EQ(sa, sb);
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_NE(e.path().filename().string().rfind(".partial-", 0), 0u) << e.path();
  }
}

TEST(TrainerTest, KeepLastKeepsTheNewestCheckpointsAndResumesBitForBit) {
  ExpectKeepLastKeepsTheNewestAndResumesBitForBit("keep_last", /*fenced=*/false);
}

// The same through the service's fenced commits: retention runs after the
// commit, on the final names only.
TEST(TrainerTest, KeepLastThroughFencedCommitsKeepsTheNewestAndResumesBitForBit) {
  ExpectKeepLastKeepsTheNewestAndResumesBitForBit("keep_last_fenced", /*fenced=*/true);
}

// A negative keep_last is refused before anything trains, naming the field.
TEST(TrainerTest, ANegativeKeepLastIsRefusedNamingTheField) {
  TrainerOptions o = RecallOptions(1);
  o.step.layout.batch = 4;
  o.steps = 1;
  o.checkpoint_dir = TmpDir("keep_last_negative");
  o.checkpoint_keep_last = -1;
  TrainRun run = Train(o, 1);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument) << run.status;
  EXPECT_THAT(run.status.message(), HasSubstr("checkpoint.keep_last: expected >= 0"));
  EXPECT_TRUE(run.losses.empty());
  EXPECT_FALSE(std::filesystem::exists(o.checkpoint_dir));
}

// In bf16 the checkpoint holds the fp32 masters (the working weights are
// their rounding), so the resumed run is the uninterrupted one to the bit
// too. Also the trainer's bf16 path in the ASan pass of tools/test, which
// leaves out the 200-step learning runs.
TEST(TrainerTest, ResumeReproducesTheUninterruptedRunBitForBitInBf16) {
  ExpectResumeReproducesTheUninterruptedRun(Precision::kBf16Mixed, "ckpt_bf16");
}

// A warm-up + cosine schedule is a function of the step alone: a run
// stopped mid-warm-up (step 2 of W = 4) and again mid-decay (step 6), each
// time resumed in fresh objects from its checkpoint, runs every step at the
// same learning rate and with the same loss, to the bit, as the run that
// never stopped. Each step reports the rate it ran with.
TEST(TrainerTest, ScheduledLearningRateResumesBitForBit) {
  TrainerOptions o = RecallOptions(2);
  o.step.optimizer.schedule.decay = LrSchedule::Decay::kCosine;
  o.step.optimizer.schedule.warmup_steps = 4;
  o.step.optimizer.schedule.total_steps = 9;  // the job's steps, whatever o.steps a run stops at
  o.step.optimizer.schedule.min_lr = 6e-4;
  ASSERT_TRUE(ValidateLrSchedule(o.step.optimizer).ok());
  o.steps = 9;
  o.checkpoint_dir = TmpDir("ckpt_lr_straight");
  TrainRun straight = Train(o, 2);
  ASSERT_TRUE(straight.status.ok()) << straight.status;
  ASSERT_EQ(straight.losses.size(), 9u);
  for (int64_t s = 1; s <= 9; ++s) {
    EXPECT_EQ(straight.lrs[s - 1], LearningRateF(o.step.optimizer, s)) << "step " << s;
  }
  EXPECT_EQ(straight.lrs[0], 0.0);                    // warm-up from 0
  EXPECT_EQ(straight.lrs[4], o.step.optimizer.lr);    // step W + 1: the peak
  EXPECT_GT(straight.lrs[8], 6e-4);                   // the last: just above the floor

  o.checkpoint_dir = TmpDir("ckpt_lr_resumed");
  std::vector<double> losses, lrs;
  for (int64_t stop : {2, 6, 9}) {
    o.steps = stop;
    TrainRun part = Train(o, 2);
    ASSERT_TRUE(part.status.ok()) << part.status;
    losses.insert(losses.end(), part.losses.begin(), part.losses.end());
    lrs.insert(lrs.end(), part.lrs.begin(), part.lrs.end());
  }
  ASSERT_EQ(losses.size(), 9u);
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(losses[i], straight.losses[i]) << "step " << i + 1;
    EXPECT_EQ(lrs[i], straight.lrs[i]) << "step " << i + 1;
  }
  std::ifstream a(CheckpointPath(TmpDir("ckpt_lr_straight"), 9), std::ios::binary);
  std::ifstream b(CheckpointPath(TmpDir("ckpt_lr_resumed"), 9), std::ios::binary);
  std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(sa.empty());
  EXPECT_EQ(sa, sb);

  // The schedule changes the run: the constant default's losses differ from
  // step 2 on (step 1 ran at lr 0 here, so step 2 saw the initial weights).
  TrainerOptions c = RecallOptions(2);
  c.steps = 3;
  TrainRun constant = Train(c, 2);
  ASSERT_TRUE(constant.status.ok()) << constant.status;
  EXPECT_EQ(constant.losses[0], straight.losses[0]);  // same weights, same batch
  EXPECT_NE(constant.losses[1], straight.losses[1]);
  for (double lr : constant.lrs) EXPECT_EQ(lr, c.step.optimizer.lr);
}

// A resume under another learning-rate schedule is refused, naming the
// field and the next step's rate under either: a job of 4 cosine steps
// resumed as one of 8 would run step 5 back near the peak. With
// optimizer.reschedule_on_resume it goes on under the new schedule and says
// both rates. Under the constant default the job's steps shape no rate: a
// longer job resumes as before. Another lr is refused the same way.
TEST(TrainerTest, AResumeUnderAnotherScheduleIsRefusedUnlessAskedFor) {
  TrainerOptions o = RecallOptions(2);
  o.step.optimizer.schedule.decay = LrSchedule::Decay::kCosine;
  o.step.optimizer.schedule.min_lr = 6e-4;
  o.steps = o.step.optimizer.schedule.total_steps = 4;
  o.checkpoint_dir = TmpDir("ckpt_reschedule");
  ASSERT_TRUE(Train(o, 2).status.ok());
  TrainerOptions longer = o;
  longer.steps = longer.step.optimizer.schedule.total_steps = 8;
  TrainRun refused = Train(longer, 2);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kFailedPrecondition) << refused.status;
  EXPECT_THAT(
      refused.status.message(),
      AllOf(HasSubstr("steps: the job says 8, but its checkpoint"), HasSubstr("was trained under 4"),
            HasSubstr(absl::StrFormat("its step 5 runs at lr %.4g under the checkpoint's schedule, %.4g under "
                                      "this job's",
                                      LearningRate(o.step.optimizer, 5), LearningRate(longer.step.optimizer, 5))),
            HasSubstr("optimizer.reschedule_on_resume")));
  EXPECT_TRUE(refused.losses.empty());
  std::vector<std::string> said;
  absl::Mutex said_mu;  // both ranks say it, each on its thread
  longer.reschedule_on_resume = true;
  longer.say = [&](const std::string& line) {
    absl::MutexLock lock(&said_mu);
    said.push_back(line);
  };
  TrainRun taken = Train(longer, 2);
  ASSERT_TRUE(taken.status.ok()) << taken.status;
  ASSERT_EQ(taken.lrs.size(), 4u);  // steps 5 to 8
  EXPECT_EQ(taken.lrs[0], LearningRateF(longer.step.optimizer, 5));
  EXPECT_THAT(absl::StrJoin(said, "\n"), HasSubstr("optimizer.reschedule_on_resume: steps: the job says 8"));
  // Constant: the steps shape no rate.
  TrainerOptions flat = RecallOptions(2);
  flat.steps = flat.step.optimizer.schedule.total_steps = 2;
  flat.checkpoint_dir = TmpDir("ckpt_reschedule_flat");
  ASSERT_TRUE(Train(flat, 2).status.ok());
  flat.steps = flat.step.optimizer.schedule.total_steps = 3;
  TrainRun on = Train(flat, 2);
  ASSERT_TRUE(on.status.ok()) << on.status;
  EXPECT_EQ(on.losses.size(), 1u);
  // A warm-up both schedules are past changes no rate: resumed.
  flat.steps = flat.step.optimizer.schedule.total_steps = 4;
  flat.step.optimizer.schedule.warmup_steps = 2;
  TrainRun past_warmup = Train(flat, 2);
  ASSERT_TRUE(past_warmup.status.ok()) << past_warmup.status;
  EXPECT_EQ(past_warmup.losses.size(), 1u);
  flat.steps = flat.step.optimizer.schedule.total_steps = 5;
  flat.step.optimizer.lr *= 2;
  TrainRun other_lr = Train(flat, 2);
  EXPECT_EQ(other_lr.status.code(), absl::StatusCode::kFailedPrecondition) << other_lr.status;
  EXPECT_THAT(other_lr.status.message(), HasSubstr("optimizer.lr: the job says"));
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

// Rank 0 reads text file `a`, rank 1 `b`: every rank refuses before the
// first step, FAILED_PRECONDITION saying each of `ranks_say`; then a job
// trained on `a` and resumed on `b` is refused saying `resume_says`, and
// resumed on `a` trains on.
void ExpectOtherDataRefused(const std::string& a, const std::string& b, const std::string& name,
                            const std::vector<std::string>& ranks_say, const std::string& resume_says) {
  TrainerOptions o = RecallOptions(2);
  o.data.kind = DataOptions::Kind::kText;
  o.step.model.vocab_size = 256;
  o.step.layout.batch = 4;
  o.steps = 2;
  std::vector<absl::Status> ranks(2);
  absl::Status s = RunLocalWorld(2, 256 << 20, FreshStoreDir(name), [&](int r, Backend& be, Communicator& world) {
    TrainerOptions mine = o;
    mine.data.paths = {r == 0 ? a : b};
    ranks[r] = RunTraining(mine, be, world, [](const StepReport&) {});
    return ranks[r];
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ranks[r].code(), absl::StatusCode::kFailedPrecondition) << "rank " << r << ": " << ranks[r];
    for (const std::string& says : ranks_say) EXPECT_THAT(ranks[r].message(), HasSubstr(says)) << "rank " << r;
  }

  o.data.paths = {a};
  o.checkpoint_dir = TmpDir(name + "_ckpt");
  TrainRun first = Train(o, 2);
  ASSERT_TRUE(first.status.ok()) << first.status;
  o.data.paths = {b};
  o.steps = 4;
  TrainRun resumed = Train(o, 2);
  EXPECT_EQ(resumed.status.code(), absl::StatusCode::kFailedPrecondition) << resumed.status;
  EXPECT_THAT(resumed.status.message(), HasSubstr(resume_says));
  o.data.paths = {a};
  TrainRun again = Train(o, 2);
  EXPECT_TRUE(again.status.ok()) << again.status;
}

// Every rank reads its own copy of the text: a node whose copy is of another
// length would splice sequences elsewhere, silently. Refused on every rank
// before the first step, naming the field; and a resume on files of
// another length than its checkpoint's stream is refused the same way.
TEST(TrainerTest, RanksOrAResumeOnDataOfAnotherLengthAreRefused) {
  const auto write = [](const std::string& path, int reps) {
    std::ofstream f(path);
    for (int i = 0; i < reps; ++i) f << "the quick brown fox jumps over the lazy dog. ";
  };
  const std::string a = TmpDir("copy_a.txt"), b = TmpDir("copy_b.txt");
  write(a, 200);
  write(b, 201);
  ExpectOtherDataRefused(a, b, "copies", {"data.text.path: the ranks read different data"},
                         "was trained on a stream of 9000");
}

// The same of copies of one length with other contents (here one letter
// changed near the start, in the fingerprint's sample).
TEST(TrainerTest, RanksOrAResumeOnDataOfOtherContentsAreRefused) {
  const auto write = [](const std::string& path, char first) {
    std::ofstream f(path);
    f << first;
    for (int i = 0; i < 200; ++i) f << "the quick brown fox jumps over the lazy dog. ";
  };
  const std::string a = TmpDir("same_a.txt"), b = TmpDir("same_b.txt");
  write(a, 'T');
  write(b, 't');
  ExpectOtherDataRefused(a, b, "same_length",
                         {"data.text.path: the ranks read different data", "hold 9001 tokens each but differ"},
                         "are not the stream its checkpoint");
}

SafetensorsFile ReadCheckpoint(const std::string& dir, int64_t step) {
  absl::StatusOr<SafetensorsFile> f = ReadSafetensors(CheckpointPath(dir, step));
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *std::move(f) : SafetensorsFile{};
}

// Reads checkpoint `step` of `dir`, lets `edit` change it, writes it back.
void RewriteCheckpoint(const std::string& dir, int64_t step, const std::function<void(SafetensorsFile&)>& edit) {
  SafetensorsFile f = ReadCheckpoint(dir, step);
  edit(f);
  std::vector<TensorView> views;
  for (const auto& [name, t] : f.tensors) views.push_back({name, t.shape, t.data.data()});
  ASSERT_TRUE(WriteSafetensors(CheckpointPath(dir, step), views, f.metadata).ok());
}

// A checkpoint is resumed only by the model and stream it was trained
// with. Another model whose tensors have the same shapes (heads and
// kv_heads scaled together), a shallower one (the deeper file's first
// layers), another seq_len or held-out split (the data position counts
// other sequences) all loaded and trained on. Each is refused naming the
// field; a file from before the keys, by its extra tensors; a file whose
// metadata step disagrees with its name, or of another format, too.
TEST(TrainerTest, ACheckpointOfAnotherModelOrStreamIsRefusedNamingTheField) {
  TrainerOptions o = RecallOptions(1);
  o.step.layout.batch = 4;
  o.step.model.layers = 3;
  o.steps = 1;
  o.checkpoint_dir = TmpDir("identity_ckpt");
  ASSERT_TRUE(Train(o, 1).status.ok());
  o.steps = 2;
  const auto refused = [&](const std::function<void(TrainerOptions&)>& change, const std::string& says) {
    TrainerOptions other = o;
    change(other);
    TrainRun run = Train(other, 1);
    EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << says << ": " << run.status;
    EXPECT_THAT(run.status.message(), HasSubstr(says));
    EXPECT_TRUE(run.losses.empty()) << says;
  };
  refused([](TrainerOptions& t) { t.step.model.layers = 2; }, "model.layers: the job says 2, but its checkpoint");
  refused(
      [](TrainerOptions& t) {
        t.step.model.heads = 8;
        t.step.model.kv_heads = 4;
      },
      "model.heads: the job says 8");
  refused([](TrainerOptions& t) { t.step.model.top_k = 1; }, "model.top_k: the job says 1");
  refused([](TrainerOptions& t) { t.step.model.rope_theta = 500000.0f; }, "model.rope_theta: the job says 500000");
  refused([](TrainerOptions& t) { t.step.model.seq_len = 64; }, "model.seq_len: the job says 64");
  refused([](TrainerOptions& t) { t.data.held_out = 2; }, "data.held_out_sequences: the job says 2");

  // A checkpoint without the keys (written before them): a shallower model
  // is refused by the deeper file's extra tensors.
  RewriteCheckpoint(o.checkpoint_dir, 1, [](SafetensorsFile& f) {
    for (auto it = f.metadata.begin(); it != f.metadata.end();) {
      it = it->first.rfind("model.", 0) == 0 ? f.metadata.erase(it) : std::next(it);
    }
  });
  refused([](TrainerOptions& t) { t.step.model.layers = 2; }, "holds tensor 'layers.2.");

  // The metadata's step against the file's name; the format.
  RewriteCheckpoint(o.checkpoint_dir, 1, [](SafetensorsFile& f) { f.metadata["step"] = "50"; });
  TrainRun stepped = Train(o, 1);
  EXPECT_EQ(stepped.status.code(), absl::StatusCode::kDataLoss) << stepped.status;
  EXPECT_THAT(stepped.status.message(), HasSubstr("metadata step is 50, but the file's name says step 1"));
  RewriteCheckpoint(o.checkpoint_dir, 1, [](SafetensorsFile& f) {
    f.metadata["step"] = "1";
    f.metadata["format"] = "plateau-checkpoint-v2";
  });
  refused([](TrainerOptions&) {}, "metadata format is 'plateau-checkpoint-v2', expected 'plateau-checkpoint-v1'");

  // The same model and stream resume.
  RewriteCheckpoint(o.checkpoint_dir, 1, [](SafetensorsFile& f) { f.metadata["format"] = "plateau-checkpoint-v1"; });
  TrainRun resumed = Train(o, 1);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status;
  EXPECT_EQ(resumed.losses.size(), 1u);
}

TEST(TrainerTest, DataLargerThanTheVocabularyIsRefused) {
  TrainerOptions o = RecallOptions(1);
  o.step.model.vocab_size = 10;  // the task needs 18
  TrainRun run = Train(o, 1);
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status.message(), HasSubstr("model.vocab_size"));
}


// ---------------------------------------------------------------------------
// The optimizer and the checkpoint against docs/MODEL.md ("Initialisation",
// "The optimizer", "Checkpoints"), computed here from the page's formulas.

// A weight at initialisation: float(s * z), or 1 for norm weights.
std::vector<float> DocumentedInit(const WeightSpec& w, uint64_t seed) {
  std::vector<float> out(w.numel());
  const uint64_t key = WeightKey(seed, w.name);
  for (int64_t i = 0; i < w.numel(); ++i) {
    out[i] = w.init_std == 0.0f
                 ? 1.0f
                 : static_cast<float>(static_cast<double>(w.init_std) * StandardNormal(key, i));
  }
  return out;
}

// The per-step scalars of AdamW at step t.
struct AdamWScalars {
  float step_size, bc2, decay, eps;
};
AdamWScalars Scalars(const OptimizerConfig& o, int64_t t) {
  return {static_cast<float>(static_cast<double>(o.lr) / (1.0 - std::pow(static_cast<double>(o.beta1), t))),
          static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(o.beta2), t))),
          1.0f - o.lr * o.weight_decay, o.eps};
}

// p after one update, from the moments after it (as the checkpoint holds
// them), and how far an evaluation of it may be off: a few fp32 roundings of
// |p| and of the Adam step, whether or not the compiler fuses operations.
float Updated(float p, float m, float v, const AdamWScalars& s) {
  return p * s.decay - s.step_size * m / (std::sqrt(v) / s.bc2 + s.eps);
}
float Tolerance(float p, float m, float v, const AdamWScalars& s) {
  return 4 * FLT_EPSILON * (std::abs(p) + std::abs(s.step_size * m / (std::sqrt(v) / s.bc2 + s.eps)));
}

// Counts the elements that fail a check and keeps the first failure.
struct Mismatches {
  int64_t count = 0;
  std::string first;
  void Check(bool ok, const std::string& name, int64_t i, const std::string& what) {
    if (ok) return;
    if (count++ == 0) first = absl::StrCat(name, "[", i, "]: ", what);
  }
};

// Two runs of two steps that differ only in the weight decay λ. Step 1's
// gradient is that of the initial weights in both, so the moments agree bit
// for bit and step 1's weights are the initial weights times (1 - ηλ) —
// before the Adam step, not after it — minus the same Adam step; the moments
// are m = (1-β1)·g, v = (1-β2)·g² of the clipped gradient, whose norm is the
// clipping coefficient times the reported norm. Step 2 checks the bias
// corrections at t = 2 the same way. The betas, ε and the clipping norm are
// not the defaults, so a constant that does not reach the optimizer fails too.
TEST(TrainerTest, WeightDecayIsDecoupledAdamWAsDocumented) {
  TrainerOptions o = RecallOptions(2);
  o.steps = 2;
  o.checkpoint_every = 1;
  OptimizerConfig& opt = o.step.optimizer;
  opt.beta1 = 0.8f;
  opt.beta2 = 0.99f;
  opt.eps = 1e-7f;
  opt.max_grad_norm = 0.25f;
  o.checkpoint_dir = TmpDir("decay_off");
  TrainRun off = Train(o, 2);
  const OptimizerConfig no_decay = opt;
  opt.weight_decay = 0.5f;
  o.checkpoint_dir = TmpDir("decay_on");
  TrainRun on = Train(o, 2);
  ASSERT_TRUE(off.status.ok()) << off.status;
  ASSERT_TRUE(on.status.ok()) << on.status;
  ASSERT_EQ(on.losses.size(), 2u);
  ASSERT_EQ(off.losses.size(), 2u);
  EXPECT_EQ(on.losses[0], off.losses[0]);  // the initial weights' loss
  EXPECT_NE(on.losses[1], off.losses[1]);
  EXPECT_EQ(on.grad_norms[0], off.grad_norms[0]);
  const double n = on.grad_norms[0];
  ASSERT_GT(n, opt.max_grad_norm) << "step 1 must clip for this test to check the clipping";

  const SafetensorsFile off1 = ReadCheckpoint(TmpDir("decay_off"), 1);
  const SafetensorsFile on1 = ReadCheckpoint(TmpDir("decay_on"), 1);
  const SafetensorsFile on2 = ReadCheckpoint(TmpDir("decay_on"), 2);
  const std::vector<WeightSpec> weights = ModelWeights(o.step.model);
  for (const SafetensorsFile* f : {&off1, &on1, &on2}) {
    for (const WeightSpec& w : weights) {
      for (const std::string& name : {w.name, "optimizer.m." + w.name, "optimizer.v." + w.name}) {
        ASSERT_TRUE(f->tensors.count(name)) << name;
        ASSERT_EQ(f->tensors.at(name).shape, w.shape) << name;
      }
    }
  }
  const AdamWScalars s1 = Scalars(opt, 1), s1_off = Scalars(no_decay, 1), s2 = Scalars(opt, 2);
  const float b1 = opt.beta1, b2 = opt.beta2;
  Mismatches moments, second_moment, undecayed, decayed, step2;
  int64_t total = 0, changed = 0;
  double clipped_sq = 0;
  for (const WeightSpec& w : weights) {
    const std::vector<float> p0 = DocumentedInit(w, o.step.seed);
    const std::vector<float>& p_off = off1.tensors.at(w.name).data;
    const std::vector<float>& m_off = off1.tensors.at("optimizer.m." + w.name).data;
    const std::vector<float>& v_off = off1.tensors.at("optimizer.v." + w.name).data;
    const std::vector<float>& p1 = on1.tensors.at(w.name).data;
    const std::vector<float>& m1 = on1.tensors.at("optimizer.m." + w.name).data;
    const std::vector<float>& v1 = on1.tensors.at("optimizer.v." + w.name).data;
    const std::vector<float>& p2 = on2.tensors.at(w.name).data;
    const std::vector<float>& m2 = on2.tensors.at("optimizer.m." + w.name).data;
    const std::vector<float>& v2 = on2.tensors.at("optimizer.v." + w.name).data;
    for (int64_t i = 0; i < w.numel(); ++i) {
      moments.Check(m1[i] == m_off[i] && v1[i] == v_off[i], w.name, i,
                    absl::StrCat("moments ", m1[i], ", ", v1[i], " with decay, ", m_off[i], ", ",
                                 v_off[i], " without"));
      const double g = m1[i] / (1.0 - b1);  // the clipped gradient
      clipped_sq += g * g;
      second_moment.Check(std::abs(v1[i] - (1.0 - b2) * g * g) <= 1e-5 * v1[i] + 1e-30, w.name, i,
                          absl::StrCat("v ", v1[i], ", (1-b2)(m/(1-b1))^2 ", (1.0 - b2) * g * g));
      const float want_off = Updated(p0[i], m1[i], v1[i], s1_off);
      undecayed.Check(std::abs(p_off[i] - want_off) <= Tolerance(p0[i], m1[i], v1[i], s1_off), w.name,
                      i, absl::StrCat("without decay ", p_off[i], ", expected ", want_off));
      const float want = Updated(p0[i], m1[i], v1[i], s1);
      decayed.Check(std::abs(p1[i] - want) <= Tolerance(p0[i], m1[i], v1[i], s1), w.name, i,
                    absl::StrCat("with decay ", p1[i], ", expected ", want, " (from ", p0[i], ")"));
      const float want2 = Updated(p1[i], m2[i], v2[i], s2);
      step2.Check(std::abs(p2[i] - want2) <= Tolerance(p1[i], m2[i], v2[i], s2), w.name, i,
                  absl::StrCat("step 2 ", p2[i], ", expected ", want2, " (from ", p1[i], ")"));
      changed += p1[i] != p_off[i];
      ++total;
    }
  }
  EXPECT_EQ(moments.count, 0) << "the decay changed step 1's gradient: " << moments.first;
  EXPECT_EQ(second_moment.count, 0) << second_moment.first;
  EXPECT_EQ(undecayed.count, 0) << undecayed.first;
  EXPECT_EQ(decayed.count, 0) << decayed.first;
  EXPECT_EQ(step2.count, 0) << step2.first;
  EXPECT_GT(changed, total * 99 / 100) << "the decay changed " << changed << " of " << total;
  const float clip = std::min(1.0f, opt.max_grad_norm / (static_cast<float>(n) + 1e-6f));
  EXPECT_NEAR(std::sqrt(clipped_sq), clip * n, 1e-5 * clip * n);
}

// The metadata is exactly the documented one: the two seeds recorded apart.
TEST(TrainerTest, CheckpointMetadataAsDocumented) {
  TrainerOptions o = RecallOptions(1);
  o.step.layout.batch = 4;
  o.steps = 1;
  o.step.seed = 5;
  o.data.recall.seed = 9;
  o.checkpoint_dir = TmpDir("ckpt_metadata");
  TrainRun run = Train(o, 1);
  ASSERT_TRUE(run.status.ok()) << run.status;
  const SafetensorsFile f = ReadCheckpoint(o.checkpoint_dir, 1);
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"step", "1"},
                                                            {"data_position", "4"},
                                                            {"seed", "5"},
                                                            {"data_seed", "9"},
                                                            {"data_tokens", "0"},
                                                            {"data_fingerprint", "0000000000000000"},
                                                            {"format", "plateau-checkpoint-v1"},
                                                            {"model.vocab_size", "18"},
                                                            {"model.hidden", "64"},
                                                            {"model.layers", "2"},
                                                            {"model.heads", "4"},
                                                            {"model.kv_heads", "2"},
                                                            {"model.experts", "4"},
                                                            {"model.top_k", "2"},
                                                            {"model.expert_ffn", "128"},
                                                            {"model.seq_len", "32"},
                                                            {"model.rope_theta", "10000"},
                                                            {"data.recall.num_keys", "8"},
                                                            {"data.recall.num_values", "8"},
                                                            {"data.recall.pairs", "4"},
                                                            {"data.recall.queries", "4"},
                                                            {"optimizer.lr", "0.006"},
                                                            {"optimizer.lr_decay", "constant"},
                                                            {"optimizer.warmup_steps", "0"},
                                                            {"optimizer.min_lr", "0"},
                                                            {"steps", "-"},
                                                            {"model.norm_eps", "1e-05"},
                                                            {"data.held_out_sequences", "0"}}));
  EXPECT_EQ(f.tensors.size(), 3 * ModelWeights(o.step.model).size());
}

// The data position counts sequences of one recall stream: resuming it
// with another data seed would train on neither the old run's data nor a
// fresh run's. Refused before any step, naming the field and both seeds;
// the checkpoint is left as it was, and the original seed resumes.
TEST(TrainerTest, ResumingWithAnotherDataSeedIsRefused) {
  TrainerOptions o = RecallOptions(1);
  o.step.layout.batch = 4;
  o.steps = 1;
  o.data.recall.seed = 9;
  o.checkpoint_dir = TmpDir("ckpt_data_seed");
  ASSERT_TRUE(Train(o, 1).status.ok());
  std::ifstream saved(CheckpointPath(o.checkpoint_dir, 1), std::ios::binary);
  const std::string before((std::istreambuf_iterator<char>(saved)), {});

  o.steps = 2;
  o.data.recall.seed = 10;
  TrainRun other = Train(o, 1);
  EXPECT_EQ(other.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.status.message(),
              AllOf(HasSubstr("data.recall.seed"), HasSubstr("says 10"), HasSubstr("data seed 9")));
  EXPECT_TRUE(other.losses.empty());
  std::ifstream after(CheckpointPath(o.checkpoint_dir, 1), std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(after)), {}), before);

  // The task's shape too: 6 pairs of the same keys and values are
  // another task at the same position.
  o.data.recall.seed = 9;
  o.data.recall.pairs = 6;
  TrainRun other_pairs = Train(o, 1);
  EXPECT_EQ(other_pairs.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other_pairs.status.message(), HasSubstr("data.recall.pairs: the job says 6, but its checkpoint"));
  o.data.recall.pairs = 4;
  TrainRun same = Train(o, 1);
  ASSERT_TRUE(same.status.ok()) << same.status;
  EXPECT_EQ(same.losses.size(), 1u);
}

// A directory whose newest checkpoint is past the job's steps is another,
// longer job's: resuming there would end the job at once, "finished"
// having trained nothing. Refused naming the file; a checkpoint within the
// steps is resumed from, and the loop says which.
TEST(TrainerTest, ACheckpointPastTheJobsStepsIsRefusedAndAResumeIsSaid) {
  TrainerOptions o = RecallOptions(1);
  o.step.layout.batch = 4;
  o.steps = 3;
  o.checkpoint_dir = TmpDir("ckpt_past_the_end");
  ASSERT_TRUE(Train(o, 1).status.ok());
  const std::string third = CheckpointPath(o.checkpoint_dir, 3);
  std::vector<std::string> said;
  o.say = [&](const std::string& line) { said.push_back(line); };
  o.steps = 2;
  TrainRun shorter = Train(o, 1);
  EXPECT_EQ(shorter.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(shorter.status.message(), AllOf(HasSubstr("checkpoint.directory=" + o.checkpoint_dir +
                                                        ": its newest checkpoint, " + third +
                                                        ", is past this job's steps (2)"),
                                              HasSubstr("a directory of its own")));
  EXPECT_TRUE(shorter.losses.empty());
  EXPECT_TRUE(said.empty());
  o.steps = 5;
  TrainRun longer = Train(o, 1);
  ASSERT_TRUE(longer.status.ok()) << longer.status;
  EXPECT_EQ(longer.losses.size(), 2u);
  EXPECT_THAT(said, ::testing::ElementsAre("resumed from " + third + " (step 3 of 5)",
                                           HasSubstr("checkpoint: wrote " + CheckpointPath(o.checkpoint_dir, 5))));
}

// The ranks list the checkpoint directory each for itself. Where their
// hosts see it differently (an NFS client's cached listing), or one cannot
// list it, no rank resumes: every rank fails, naming what each saw, rather
// than train on a mix of two steps' states with nothing failing. Retryable
// (UNAVAILABLE), since a later attempt may see one directory.
TEST(TrainerTest, RanksThatSeeDifferentNewestCheckpointsDoNotResume) {
  TrainerOptions o = RecallOptions(2);
  o.step.layout.batch = 4;
  o.steps = 2;
  o.checkpoint_every = 1;
  o.checkpoint_dir = TmpDir("ckpt_views_full");
  ASSERT_TRUE(Train(o, 2).status.ok());
  const std::string stale = TmpDir("ckpt_views_stale");
  std::filesystem::create_directories(stale);
  std::filesystem::copy_file(CheckpointPath(o.checkpoint_dir, 1), CheckpointPath(stale, 1));
  // A directory this rank cannot list (as root, no permission stops it: a
  // name longer than the file system takes).
  const std::string unlistable = TmpDir(std::string(300, 'x'));
  o.steps = 4;
  for (const auto& [rank1_dir, rank0_saw, rank1_saw] :
       {std::tuple<std::string, std::string, std::string>{stale, "this rank found step 2; another found step 1",
                                                          "this rank found step 1; another found step 2"},
        {unlistable, "this rank found step 2; another could not list it", "cannot list it to resume: "}}) {
    SCOPED_TRACE(rank1_dir);
    std::vector<absl::Status> ranks(2);
    std::vector<int> steps(2, 0);
    const absl::Status world =
        RunLocalWorld(2, 256 << 20, FreshStoreDir("views"), [&](int r, Backend& be, Communicator& comm) {
          TrainerOptions mine = o;
          if (r == 1) mine.checkpoint_dir = rank1_dir;
          ranks[r] = RunTraining(mine, be, comm, [&](const StepReport&) { ++steps[r]; });
          return ranks[r];
        });
    EXPECT_FALSE(world.ok());
    for (int r = 0; r < 2; ++r) EXPECT_EQ(steps[r], 0) << "rank " << r << " trained";
    EXPECT_EQ(ranks[0].code(), absl::StatusCode::kUnavailable) << ranks[0];
    // A name too long is the job's setting (FAILED_PRECONDITION, not
    // retried); a stale listing may pass (UNAVAILABLE).
    EXPECT_EQ(ranks[1].code(),
              rank1_dir == unlistable ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kUnavailable)
        << ranks[1];
    EXPECT_THAT(ranks[0].message(), AllOf(HasSubstr("the ranks see different newest checkpoints"), HasSubstr(rank0_saw),
                                          HasSubstr("not resumed")));
    EXPECT_THAT(ranks[1].message(), HasSubstr(rank1_saw));
  }
}

// Rank 0 that cannot make the checkpoint directory (a file is in the way)
// still takes part in the checkpoint's gathers, so rank 1 finishes; rank 0
// reports the directory and why, and no checkpoint appears.
TEST(TrainerTest, ACheckpointDirectoryThatCannotBeMadeFailsRankZeroWithoutAHang) {
  TrainerOptions o = RecallOptions(2);
  o.steps = 1;
  const std::string blocker = TmpDir("ckpt_blocker");
  { std::ofstream(blocker) << "a file, not a directory"; }
  o.checkpoint_dir = blocker + "/ckpt";
  TrainRun run = Train(o, 2);
  // The job's setting, not a crash to restart: FAILED_PRECONDITION.
  EXPECT_EQ(run.status.code(), absl::StatusCode::kFailedPrecondition) << run.status;
  EXPECT_THAT(run.status.message(),
              HasSubstr("checkpoint.directory=" + o.checkpoint_dir + ": cannot create it: "));
  EXPECT_EQ(run.losses.size(), 1u);
  EXPECT_FALSE(std::filesystem::exists(o.checkpoint_dir));
}

// The validation loss over the held-out sequences (2 batches), forward only.
// Step 1 runs at lr 0 (a warm-up), so its validation sees the initial
// weights on any rank count: P = 1 and P = 2 agree to fp32 rounding (2e-6)
// and both equal the naive double reference of the same batches to 1e-5
// (the step's own loss tolerance, step_test); after step 3 each equals the
// reference with its own checkpoint's weights. Validating changes nothing
// about training: the losses are those of a run without it, to the bit.
TEST(TrainerTest, ValidationLossMatchesTheReferenceOnAnyRankCount) {
  auto options = [](int P, const std::string& dir, bool validate) {
    TrainerOptions o = RecallOptions(P);
    o.steps = 3;
    o.step.optimizer.schedule.warmup_steps = 2;
    o.step.optimizer.schedule.total_steps = 3;
    // Held out either way (the recall split changes which sequences train).
    o.data.held_out = 2 * o.step.layout.batch;
    if (validate) o.validation_every = 1;
    o.checkpoint_dir = TmpDir(dir);
    o.checkpoint_every = 1;
    return o;
  };
  TrainRun one = Train(options(1, "val_p1", true), 1);
  TrainRun two = Train(options(2, "val_p2", true), 2);
  TrainRun plain = Train(options(2, "val_none", false), 2);
  for (const TrainRun* r : {&one, &two, &plain}) ASSERT_TRUE(r->status.ok()) << r->status;
  EXPECT_EQ(one.validation_steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(two.validation_steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(plain.validation_steps.empty());
  EXPECT_EQ(two.losses, plain.losses);

  // The reference: the same held-out batches (read at P = 1), in double.
  const TrainerOptions o = options(1, "unused", true);
  const ModelConfig& m = o.step.model;
  const int64_t B = o.step.layout.batch;
  auto held = OpenAssociativeRecall(o.data.recall, DataSlice{B, m.seq_len, 0, 1, o.data.held_out, true});
  ASSERT_TRUE(held.ok()) << held.status();
  std::vector<Batch> batches(2);
  for (Batch& b : batches) ASSERT_TRUE((*held)->Next(&b).ok());
  auto reference = [&](const Tensors<double>& w) {
    double sum = 0;
    int64_t valid = 0;
    for (const Batch& b : batches) {
      Tensors<double> grads;
      const double loss = ReferenceLossAndGrads(m, w, b.tokens, b.targets, B, &grads);
      int64_t n = 0;
      for (int32_t t : b.targets) n += t != kIgnoreIndex;
      sum += loss * static_cast<double>(n);
      valid += n;
    }
    return sum / static_cast<double>(valid);
  };
  auto weights_at = [&](const std::string& dir, int64_t step) {
    const SafetensorsFile f = ReadCheckpoint(TmpDir(dir), step);
    Tensors<double> w;
    for (const WeightSpec& spec : ModelWeights(m)) {
      const std::vector<float>& t = f.tensors.at(spec.name).data;
      w.emplace_back(t.begin(), t.end());
    }
    return w;
  };
  // Step 1 moved no weight (lr 0): both runs' weights after it are the
  // initial ones, the same on 1 and 2 ranks.
  const Tensors<double> w1 = weights_at("val_p2", 1);
  EXPECT_EQ(w1, weights_at("val_p1", 1));
  const double initial = reference(w1);
  EXPECT_NEAR(one.validation[0], two.validation[0], 2e-6 * initial);
  EXPECT_NEAR(one.validation[0], initial, 1e-5 * initial);
  EXPECT_NEAR(two.validation[0], initial, 1e-5 * initial);
  const double after_one = reference(weights_at("val_p1", 3)), after_two = reference(weights_at("val_p2", 3));
  EXPECT_NEAR(one.validation[2], after_one, 1e-5 * after_one);
  EXPECT_NEAR(two.validation[2], after_two, 1e-5 * after_two);
  EXPECT_LT(two.validation[2], two.validation[0]) << "it trains";
}

}  // namespace
}  // namespace plateau
