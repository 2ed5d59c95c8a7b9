// Placement decisions on their own: placed (most free devices first, one
// worker per node), waiting for busy capacity, or unschedulable with a
// reason naming what is missing.
#include "server/placement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::Job JobOf(int ranks, int nodes, v1::Backend backend = v1::BACKEND_CPU, int64_t cap = 1 << 20) {
  v1::Job job;
  *job.mutable_spec() = DemoJobSpec(ranks, 5);
  job.mutable_spec()->mutable_layout()->set_nodes(nodes);
  job.mutable_spec()->set_backend(backend);
  job.mutable_spec()->set_device_memory_bytes(cap);
  return job;
}

WorkerSlots Worker(const std::string& id, int devices, int free, int64_t memory = 0,
                   v1::Backend backend = v1::BACKEND_CPU) {
  WorkerSlots w;
  w.id = id;
  w.caps.set_backend(backend);
  w.caps.set_devices(devices);
  w.caps.set_device_memory_bytes(memory);
  w.free_devices = free;
  return w;
}

TEST(PlacementTest, PlacesOneWorkerPerNodeMostFreeDevicesFirst) {
  const PlacementDecision d = Place(JobOf(4, 2), {Worker("a", 4, 2), Worker("b", 4, 4), Worker("c", 4, 3)});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kPlaced) << d.reason;
  EXPECT_THAT(d.nodes, ElementsAre("b", "c"));
}

TEST(PlacementTest, BusyCapacityThatCouldHostItIsWaitedFor) {
  const PlacementDecision d = Place(JobOf(2, 1), {Worker("a", 2, 1)});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kWaiting);
  EXPECT_THAT(d.reason, HasSubstr("waiting for 1 worker(s) with backend cpu, 2 free device(s)"));
  EXPECT_THAT(d.reason, HasSubstr("a (cpu, 1/2 free"));
}

TEST(PlacementTest, WhatNoWorkerCouldEverHostIsUnschedulableNamingWhy) {
  // More ranks per node than any worker has devices.
  PlacementDecision d = Place(JobOf(4, 1), {Worker("a", 2, 2)});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("a has 2 device(s)"));
  // A backend no worker has.
  d = Place(JobOf(2, 1, v1::BACKEND_CUDA), {Worker("a", 2, 2)});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("a has backend cpu"));
  // More nodes than workers that could host a node's share.
  d = Place(JobOf(4, 2), {Worker("a", 2, 2), Worker("b", 1, 1)});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("only 1 registered worker(s) can host it (a)"));
  // Devices smaller than the job's cap.
  d = Place(JobOf(2, 1, v1::BACKEND_CPU, int64_t{8} << 20), {Worker("a", 2, 2, int64_t{4} << 20)});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("a has 4 MiB per device"));
  // Nobody at all; the waiting text still says so.
  d = Place(JobOf(2, 1), {});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("no worker is registered"));
  EXPECT_THAT(d.waiting_reason, HasSubstr("no worker is registered"));
}

// Host memory is the node's: a worker that reports it must hold the job's
// per-rank need (its host cap, else its host plan) for each of the node's
// ranks. One that reports none (0) is not refused, nor is any worker for a
// job that needs none (the baseline schedules).
TEST(PlacementTest, AWorkerWithTooLittleHostMemoryForTheNodesRanksIsNotEligible) {
  auto with_host = [](WorkerSlots w, int64_t host) {
    w.caps.set_host_memory_bytes(host);
    return w;
  };
  const WorkerSlots small = with_host(Worker("a", 2, 2), int64_t{64} << 20);
  const WorkerSlots exact = with_host(Worker("b", 2, 2), int64_t{96} << 20);
  v1::Job job = JobOf(2, 1);  // 2 ranks on one node
  job.mutable_spec()->set_host_memory_bytes(int64_t{48} << 20);
  PlacementDecision d = Place(job, {small});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("and 48 MiB host memory per rank;"));
  EXPECT_THAT(d.reason, HasSubstr("a has 64 MiB host memory (2 rank(s) x 48 MiB needed)"));
  d = Place(job, {small, exact});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kPlaced) << d.reason;
  EXPECT_THAT(d.nodes, ElementsAre("b"));
  d = Place(job, {Worker("c", 2, 2)});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kPlaced) << d.reason;
  EXPECT_THAT(d.nodes, ElementsAre("c"));
  // One rank per node needs one rank's share: 64 MiB hosts it.
  v1::Job split = job;
  split.mutable_spec()->mutable_layout()->set_nodes(2);
  d = Place(split, {small, exact});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kPlaced) << d.reason;
  EXPECT_THAT(d.nodes, ElementsAre("a", "b"));

  // Without a cap, its host plan is the need (of a job without `auto`
  // settings: the demo's bucket pinned).
  job.mutable_spec()->set_host_memory_bytes(0);
  job.mutable_spec()->mutable_schedule()->mutable_offload_stream_adamw()->clear_bucket_params_auto();
  job.mutable_spec()->mutable_schedule()->mutable_offload_stream_adamw()->set_bucket_params(16384);
  job.mutable_plan()->set_host_total_bytes(int64_t{40} << 20);
  d = Place(job, {small});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("and 40 MiB (its host plan) host memory per rank;"));
  EXPECT_THAT(d.reason, HasSubstr("a has 64 MiB host memory (2 rank(s) x 40 MiB needed)"));
  // A job that needs no host memory goes anywhere, and its reason says
  // nothing of host memory.
  job.mutable_plan()->set_host_total_bytes(0);
  d = Place(job, {small});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kPlaced) << d.reason;
  d = Place(JobOf(4, 1), {small});
  EXPECT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, ::testing::Not(HasSubstr("host memory")));
}

// A job whose `auto` settings are chosen against the worker's memory (its
// cap is 0 there) is placed where some value of them fits, whatever the
// plan made for another worker says; where none fits, the worker is not
// eligible and the reason says so.
TEST(PlacementTest, AutoSettingsAreFittedToEachWorkersMemory) {
  v1::Job job = JobOf(2, 1, v1::BACKEND_CUDA, 0);  // the demo's bucket is `auto`
  auto plan = PlanJob(job.spec());
  ASSERT_TRUE(plan.ok()) << plan.status();
  *job.mutable_plan() = *plan;
  const int64_t total = plan->total_bytes();
  // A plan made against a larger worker: more than this one has, yet a
  // smaller bucket fits it.
  job.mutable_plan()->set_total_bytes(total + (int64_t{64} << 20));
  PlacementDecision d = Place(job, {Worker("a", 2, 2, total, v1::BACKEND_CUDA)});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kPlaced) << d.reason;
  // One with less than any bucket's plan: not eligible.
  d = Place(job, {Worker("b", 2, 2, total / 2, v1::BACKEND_CUDA)});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("b has "));
  EXPECT_THAT(d.reason, HasSubstr("where no value of the `auto` settings fits (device_memory_bytes: "));
  // Without `auto` settings the plan is the need, as before.
  job.mutable_spec()->mutable_schedule()->mutable_offload_stream_adamw()->clear_bucket_params_auto();
  job.mutable_spec()->mutable_schedule()->mutable_offload_stream_adamw()->set_bucket_params(16384);
  d = Place(job, {Worker("a", 2, 2, total, v1::BACKEND_CUDA)});
  ASSERT_EQ(d.kind, PlacementDecision::Kind::kUnschedulable);
  EXPECT_THAT(d.reason, HasSubstr("a has "));
}

}  // namespace
}  // namespace plateau
