// Fuzz-style test of the spec parsers and the validator, in process: a few
// thousand inputs from a fixed seed (tests/spec_fuzz.h) through the wire
// and text-format parsers, ValidateJobSpec, PlanJob and AdmitJob. No input
// may crash or hang them, every refusal names a field of JobSpec, and every
// accepted spec re-validates after the service's round trips.
//
// PLATEAU_FUZZ_ITERATIONS and PLATEAU_FUZZ_SEED override the defaults for a
// longer or a different run; the seed of a failure is in its message.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/spec_fuzz.h"

namespace plateau {
namespace {

using spec_fuzz::SpecMutator;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t out = 0;
  return v != nullptr && absl::SimpleAtoi(v, &out) ? out : fallback;
}

// Aborts the test, printing the input, when one check runs longer than
// `limit`: a hang would otherwise only show as the test's timeout, without
// the input that caused it.
class Watchdog {
 public:
  explicit Watchdog(absl::Duration limit) : limit_(limit), thread_([this] { Run(); }) {}
  ~Watchdog() {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Arm(std::string what) {
    absl::MutexLock l(&mu_);
    what_ = std::move(what);
    since_ = absl::Now();
    armed_ = true;
  }
  void Disarm() {
    absl::MutexLock l(&mu_);
    armed_ = false;
  }

 private:
  void Run() {
    absl::MutexLock l(&mu_);
    while (!stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
      if (armed_ && absl::Now() - since_ > limit_) {
        std::fprintf(stderr, "HANG: one check ran over %s on input: %s\n",
                     absl::FormatDuration(limit_).c_str(), what_.c_str());
        std::abort();
      }
    }
  }

  const absl::Duration limit_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time since_ ABSL_GUARDED_BY(mu_);
  std::string what_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

TEST(SpecFuzzTest, NoInputCrashesHangsOrIsAcceptedInvalid) {
  // proto3's wire parser logs every non-UTF-8 string it refuses; the
  // inputs are full of them.
  google::protobuf::SetLogHandler(nullptr);
  const int64_t iterations = EnvInt("PLATEAU_FUZZ_ITERATIONS", 5000);
  const uint64_t seed = static_cast<uint64_t>(EnvInt("PLATEAU_FUZZ_SEED", 20261202));
  SpecMutator mutator(seed);
  // Under ASan a check takes ~10x longer; a real hang takes forever.
  Watchdog watchdog(absl::Seconds(20));
  std::map<std::string, int> seen;  // kind and verdict -> count
  absl::Duration slowest;
  const absl::Time start = absl::Now();
  int failures = 0;
  for (int64_t i = 0; i < iterations && failures < 10; ++i) {
    SpecMutator::Input in = mutator.Next();
    std::string input_text;
    if (in.kind == SpecMutator::Kind::kFieldValues) {
      google::protobuf::TextFormat::PrintToString(in.spec, &input_text);
    } else {
      input_text = absl::CHexEscape(in.bytes.substr(0, 2048));
    }
    const std::string where = absl::StrCat("seed ", seed, " iteration ", i, " (", spec_fuzz::KindName(in.kind),
                                           ": ", in.what, ")\n", input_text);
    watchdog.Arm(where);
    const absl::Time t0 = absl::Now();
    std::string broke;
    bool accepted = false;
    if (in.kind == SpecMutator::Kind::kFieldValues) {
      broke = spec_fuzz::CheckSpec(in.spec, &accepted);
    } else {
      int n = 0;
      broke = spec_fuzz::CheckBytes(in.bytes, &n);
      accepted = n > 0;
    }
    const absl::Duration took = absl::Now() - t0;
    watchdog.Disarm();
    slowest = std::max(slowest, took);
    // Each check is a few validations of a small spec: bounded well under
    // a second even on a loaded machine (sanitizers add ~10x).
    EXPECT_LT(took, absl::Seconds(5)) << where;
    if (!broke.empty()) {
      ++failures;
      ADD_FAILURE() << broke << "\n  input: " << where;
    }
    ++seen[absl::StrCat(spec_fuzz::KindName(in.kind), accepted ? " accepted" : " refused")];
  }
  std::string summary;
  for (const auto& [k, n] : seen) absl::StrAppend(&summary, "  ", k, ": ", n, "\n");
  std::printf("%lld inputs in %s (slowest check %s):\n%s", static_cast<long long>(iterations),
              absl::FormatDuration(absl::Now() - start).c_str(), absl::FormatDuration(slowest).c_str(),
              summary.c_str());
  // The fuzzing must reach both sides of the validator to mean anything.
  EXPECT_GT(seen["field values accepted"], iterations / 100) << summary;
  EXPECT_GT(seen["field values refused"], iterations / 10) << summary;
}

// The check itself can fail: a refusal that does not name a field, and an
// accepted spec whose plan does not add up, are reported.
TEST(SpecFuzzTest, TheInvariantsCatchWhatTheyCheck) {
  EXPECT_TRUE(spec_fuzz::NamesAField("model.heads: expected a divisor"));
  EXPECT_TRUE(spec_fuzz::NamesAField("data.shards.paths[3]: expected an absolute path"));
  EXPECT_TRUE(spec_fuzz::NamesAField("schedule.ring_dtp.strip: expected 0 to 18"));
  EXPECT_FALSE(spec_fuzz::NamesAField("projection.ring_dtp.strip: expected >= 1"));
  EXPECT_FALSE(spec_fuzz::NamesAField("model.heads.x: expected"));
  EXPECT_FALSE(spec_fuzz::NamesAField("steps[1]: expected"));
  EXPECT_FALSE(spec_fuzz::NamesAField("no field here"));
  for (const v1::JobSpec& s : spec_fuzz::ValidSeeds()) {
    bool accepted = false;
    EXPECT_EQ(spec_fuzz::CheckSpec(s, &accepted), "") << s.DebugString();
    EXPECT_TRUE(accepted) << s.DebugString();
  }
}

}  // namespace
}  // namespace plateau
