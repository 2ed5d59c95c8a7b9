#include "kernels/phase_clock.h"

#include <memory>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "kernels/cpu_stream.h"

namespace plateau {
namespace {

std::unique_ptr<Backend> Cpu() {
  BackendOptions o;
  o.device_memory_bytes = 1 << 20;
  auto be = CreateCpuBackend(o);
  EXPECT_TRUE(be.ok()) << be.status();
  return std::move(*be);
}

// Holds `stream` until `go` is notified.
void Hold(Stream& stream, absl::Notification& go) {
  dynamic_cast<CpuStream&>(stream).Enqueue([&go] {
    go.WaitForNotification();
    return absl::OkStatus();
  });
}

void Sleep(Stream& stream, absl::Duration d) {
  dynamic_cast<CpuStream&>(stream).Enqueue([d] {
    absl::SleepFor(d);
    return absl::OkStatus();
  });
}

// The phases are timed where their work runs, not where the host issues it:
// the host issues the streams' phases below while both are held, then lets
// them go, so they run long after they were issued however slowly the host
// issued them. The phases are held to lower bounds only, with margins of
// 50 ms and more: a sleep lasts at least its time, and a loaded machine can
// only lengthen the work.
TEST(PhaseClockTest, APhaseLastsUntilItsLastStreamPassesTheBoundary) {
  auto be = Cpu();
  auto compute = be->CreateStream("compute");
  auto comm = be->CreateStream("comm");
  ASSERT_TRUE(compute.ok() && comm.ok());
  auto clock = PhaseClock::Create(*be, {compute->get(), comm->get()});
  ASSERT_TRUE(clock.ok()) << clock.status();
  PhaseClock& c = **clock;

  absl::Notification go;
  Hold(**compute, go);
  Hold(**comm, go);
  ASSERT_TRUE(c.Start().ok());
  c.EndPhase(StepPhase::kEmbedding, 0);
  // Forward 0: the compute stream works 200 ms (the comm stream is idle).
  Sleep(**compute, absl::Milliseconds(200));
  c.EndPhase(StepPhase::kForward, 0);
  // Forward 1: the comm stream works 500 ms from the release, so the
  // boundary passes ~300 ms after forward 0's, although compute is idle for
  // all of it.
  Sleep(**comm, absl::Milliseconds(500));
  c.EndPhase(StepPhase::kForward, 1);
  // Everything above was issued with both streams held (a clock on the host
  // would see ~0 for both forwards); now they run.
  go.Notify();
  // The host waits for the comm stream, then 100 ms more: the streams are
  // idle, so the boundary passes when the host records it.
  ASSERT_TRUE((*comm)->Synchronize().ok());
  absl::SleepFor(absl::Milliseconds(100));
  c.EndPhase(StepPhase::kProjectionForward, 0);

  auto phases = c.Read();
  ASSERT_TRUE(phases.ok()) << phases.status();
  ASSERT_EQ(phases->size(), 4u);
  const StepPhase kinds[] = {StepPhase::kEmbedding, StepPhase::kForward, StepPhase::kForward,
                             StepPhase::kProjectionForward};
  const int64_t indices[] = {0, 0, 1, 0};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ((*phases)[i].kind, kinds[i]) << i;
    EXPECT_EQ((*phases)[i].index, indices[i]) << i;
    EXPECT_GE((*phases)[i].seconds, 0.0) << i;
  }
  EXPECT_GE((*phases)[1].seconds, 0.15);  // 200 ms, less the streams' start skew
  EXPECT_GE((*phases)[2].seconds, 0.1);   // 500 - 200 ms, less a late compute
  EXPECT_GE((*phases)[3].seconds, 0.1);   // the host's own 100 ms
  const PhaseTimes sum = SumByKind(*phases);
  EXPECT_DOUBLE_EQ(sum.forward, (*phases)[1].seconds + (*phases)[2].seconds);
  EXPECT_DOUBLE_EQ(sum.projection, (*phases)[3].seconds);
  // 600 ms from the release, less the streams' start skew: the start passes
  // when the later of the two stream threads wakes, while the comm stream's
  // 500 ms may have begun on the earlier one (CI once measured 0.598).
  EXPECT_GE(sum.total(), 0.55);

  // A new reading starts from nothing.
  ASSERT_TRUE(c.Start().ok());
  c.EndPhase(StepPhase::kOptimizer, 0);
  phases = c.Read();
  ASSERT_TRUE(phases.ok()) << phases.status();
  ASSERT_EQ(phases->size(), 1u);
  EXPECT_EQ((*phases)[0].kind, StepPhase::kOptimizer);
}

// As on a GPU, a point recorded on an idle stream has run when Record
// returns: its time is the host's at the call, not the stream thread's
// wake-up after it.
TEST(PhaseClockTest, APointOnAnIdleStreamHasRunAtRecord) {
  auto be = Cpu();
  auto stream = be->CreateStream("compute");
  auto a = be->CreateTimingEvent();
  auto b = be->CreateTimingEvent();
  ASSERT_TRUE(stream.ok() && a.ok() && b.ok());
  ASSERT_TRUE((*stream)->Record(**a).ok());
  EXPECT_TRUE((*a)->Done());
  ASSERT_TRUE((*a)->SecondsSince(**a).ok()) << "no Synchronize needed";
  // Behind work, it has not.
  Sleep(**stream, absl::Milliseconds(50));
  ASSERT_TRUE((*stream)->Record(**b).ok());
  EXPECT_EQ((*b)->SecondsSince(**a).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*b)->Synchronize().ok());
  auto took = (*b)->SecondsSince(**a);
  ASSERT_TRUE(took.ok()) << took.status();
  EXPECT_GE(*took, 0.05);
}

TEST(PhaseClockTest, SumByKindPutsEveryPhaseInItsGroup) {
  const std::vector<TimedPhase> phases = {{StepPhase::kEmbedding, 0, 1},
                                          {StepPhase::kForward, 0, 2},
                                          {StepPhase::kForward, 1, 4},
                                          {StepPhase::kProjectionForward, 0, 8},
                                          {StepPhase::kProjectionBackward, 0, 16},
                                          {StepPhase::kRecompute, 1, 32},
                                          {StepPhase::kBackward, 1, 64},
                                          {StepPhase::kGradReduce, 0, 128},
                                          {StepPhase::kGradNorm, 0, 256},
                                          {StepPhase::kOptimizerBucket, 0, 512},
                                          {StepPhase::kOptimizer, 0, 1024}};
  const PhaseTimes t = SumByKind(phases);
  EXPECT_EQ(t.embedding, 1);
  EXPECT_EQ(t.forward, 6);
  EXPECT_EQ(t.projection, 24);
  EXPECT_EQ(t.recompute, 32);
  EXPECT_EQ(t.backward, 64);
  EXPECT_EQ(t.grad_reduce, 128);
  EXPECT_EQ(t.grad_norm, 256);
  EXPECT_EQ(t.optimizer, 1536);
  EXPECT_EQ(t.total(), 2047);
}

TEST(PhaseClockTest, MisuseIsAStatusNotACrash) {
  auto be = Cpu();
  auto compute = be->CreateStream("compute");
  ASSERT_TRUE(compute.ok());
  EXPECT_EQ(PhaseClock::Create(*be, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PhaseClock::Create(*be, {nullptr}).status().code(), absl::StatusCode::kInvalidArgument);

  auto clock = PhaseClock::Create(*be, {compute->get()});
  ASSERT_TRUE(clock.ok());
  EXPECT_EQ((*clock)->Read().status().code(), absl::StatusCode::kFailedPrecondition);
  (*clock)->EndPhase(StepPhase::kEmbedding, 0);  // before Start: kept as the error
  ASSERT_TRUE((*clock)->Start().ok());           // ... which Start clears
  ASSERT_TRUE((*clock)->Read().ok());

  // Plain events do not time; a timing event never recorded has no time.
  auto plain = be->CreateEvent();
  auto timed = be->CreateTimingEvent();
  auto other = be->CreateTimingEvent();
  ASSERT_TRUE(plain.ok() && timed.ok() && other.ok());
  ASSERT_TRUE((*compute)->Record(**plain).ok());
  ASSERT_TRUE((*compute)->Record(**timed).ok());
  ASSERT_TRUE((*compute)->Synchronize().ok());
  EXPECT_EQ((*timed)->SecondsSince(**plain).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*plain)->SecondsSince(**timed).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*timed)->SecondsSince(**other).status().code(), absl::StatusCode::kFailedPrecondition);
  auto same = (*timed)->SecondsSince(**timed);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(*same, 0.0);
}

}  // namespace
}  // namespace plateau
