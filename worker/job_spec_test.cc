#include "worker/job_spec.h"

#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

v1::JobSpec Good() { return DemoJobSpec(2, 10); }

TEST(JobSpecTest, DemoSpecIsValidAndMapsOntoTheDemoJob) {
  auto t = ToTrainerOptions(Good());
  ASSERT_TRUE(t.ok()) << t.status();
  const TrainerOptions want = RecallDemoJob(2);
  EXPECT_EQ(t->step.model.hidden, want.step.model.hidden);
  EXPECT_EQ(t->step.model.vocab_size, want.step.model.vocab_size);
  EXPECT_EQ(t->step.model.seq_len, want.step.model.seq_len);
  EXPECT_EQ(t->step.layout.ranks, 2);
  EXPECT_EQ(t->step.layout.batch, want.step.layout.batch);
  EXPECT_FLOAT_EQ(t->step.optimizer.lr, want.step.optimizer.lr);
  EXPECT_FLOAT_EQ(t->step.optimizer.beta2, want.step.optimizer.beta2);
  EXPECT_EQ(t->data.kind, DataOptions::Kind::kRecall);
  EXPECT_EQ(t->data.recall.pairs, want.data.recall.pairs);
  EXPECT_EQ(t->steps, 10);
  auto b = ToBackendOptions(Good());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->kind, BackendKind::kCpu);
  EXPECT_EQ(b->device_memory_bytes, int64_t{256} << 20);
}

// tools/demo submits this file; it must stay the demo job of RecallDemoJob.
TEST(JobSpecTest, DemoJobFileIsTheDemoJob) {
  std::ifstream in("tools/demo_job.txtpb");
  ASSERT_TRUE(in) << "tools/demo_job.txtpb missing from runfiles";
  std::stringstream text;
  text << in.rdbuf();
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text.str(), &spec));
  v1::JobSpec want = DemoJobSpec(2, 200);
  EXPECT_EQ(spec.SerializeAsString(), want.SerializeAsString())
      << "file:\n" << spec.DebugString() << "want:\n" << want.DebugString();
}

TEST(JobSpecTest, PlanNamesEveryLiveSetAndMatchesTheStep) {
  auto plan = PlanJob(Good());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->live_sets_size(), kNumLiveSets);
  EXPECT_EQ(plan->live_sets(0).live_set(), "weights");
  auto t = ToTrainerOptions(Good());
  auto direct = PlanMemory(t->step);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(plan->total_bytes(), direct->total());
  EXPECT_TRUE(plan->fits());
  EXPECT_EQ(plan->tokens_per_rank(), 32 * 32 / 2);
}

TEST(JobSpecTest, AdmitRefusesACapBelowTheLaunchStateNamingLiveSets) {
  v1::JobSpec s = Good();
  s.set_device_memory_bytes(4096);
  auto plan = AdmitJob(s);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), HasSubstr("device_memory_bytes"));
  EXPECT_THAT(plan.status().message(), HasSubstr("weights="));
  // PlanJob alone still plans it (plateauctl plan shows why it does not fit).
  auto p = PlanJob(s);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->fits());
}

TEST(JobSpecTest, AdmitAcceptsAPlanOverTheCapOnlyInDispatchWithANote) {
  v1::JobSpec s = Good();
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok());
  int64_t dispatch = 0;
  for (const auto& ls : plan->live_sets()) if (ls.live_set() == "dispatch") dispatch = ls.bytes();
  s.set_device_memory_bytes(plan->total_bytes() - dispatch / 2);
  auto admitted = AdmitJob(s);
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_FALSE(admitted->fits());
  EXPECT_THAT(admitted->notes(admitted->notes_size() - 1), HasSubstr("dispatch"));
}

struct Case {
  std::string field;  // the error must name it
  std::function<void(v1::JobSpec&)> mutate;
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

TEST(JobSpecTest, EveryMalformedFieldIsRefusedNamingIt) {
  using S = v1::JobSpec;
  const std::vector<Case> cases = {
      {"name", [](S& s) { s.set_name(std::string(300, 'x')); }},
      {"model", [](S& s) { s.clear_model(); }},
      {"model.vocab_size", [](S& s) { s.mutable_model()->set_vocab_size(1); }},
      {"model.vocab_size", [](S& s) { s.mutable_model()->set_vocab_size(10); }},  // < recall's 18
      {"model.hidden", [](S& s) { s.mutable_model()->set_hidden(0); }},
      {"model.hidden", [](S& s) { s.mutable_model()->set_hidden(int64_t{1} << 40); }},
      {"model.layers", [](S& s) { s.mutable_model()->set_layers(-1); }},
      {"model.heads", [](S& s) { s.mutable_model()->set_heads(5); }},
      {"model.heads", [](S& s) { s.mutable_model()->set_heads(0); }},
      {"model.kv_heads", [](S& s) { s.mutable_model()->set_kv_heads(3); }},
      {"model.experts", [](S& s) { s.mutable_model()->set_experts(0); }},
      {"model.experts", [](S& s) { s.mutable_model()->set_experts(3); }},  // not a multiple of ranks
      {"model.top_k", [](S& s) { s.mutable_model()->set_top_k(5); }},
      {"model.top_k", [](S& s) { s.mutable_model()->set_top_k(0); }},
      {"model.expert_ffn", [](S& s) { s.mutable_model()->set_expert_ffn(0); }},
      {"model.seq_len", [](S& s) { s.mutable_model()->set_seq_len(0); }},
      {"model.seq_len", [](S& s) { s.mutable_model()->set_seq_len(33); }},  // not a multiple of ranks
      {"model.seq_len", [](S& s) { s.mutable_model()->set_seq_len(16); }},  // too short for recall
      {"model.rope_theta", [](S& s) { s.mutable_model()->set_rope_theta(0.5f); }},
      {"model.norm_eps", [](S& s) { s.mutable_model()->set_norm_eps(0); }},
      {"model.init_std", [](S& s) { s.mutable_model()->set_init_std(NAN); }},
      {"model", [](S& s) {  // too large to plan
         s.mutable_model()->set_vocab_size(int64_t{1} << 31);
         s.mutable_model()->set_seq_len(int64_t{1} << 20);
         s.mutable_layout()->set_batch(int64_t{1} << 20);
       }},
      {"layout", [](S& s) { s.clear_layout(); }},
      {"layout.ranks", [](S& s) { s.mutable_layout()->set_ranks(0); }},
      {"layout.ranks", [](S& s) { s.mutable_layout()->set_ranks(1 << 20); }},
      {"layout.nodes", [](S& s) { s.mutable_layout()->set_nodes(3); }},
      {"layout.nodes", [](S& s) { s.mutable_layout()->set_nodes(-1); }},
      {"layout.batch", [](S& s) { s.mutable_layout()->set_batch(0); }},
      {"optimizer", [](S& s) { s.clear_optimizer(); }},
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->set_lr(0); }},
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->set_lr(INFINITY); }},
      {"optimizer.beta1", [](S& s) { s.mutable_optimizer()->set_beta1(1.0f); }},
      {"optimizer.beta2", [](S& s) { s.mutable_optimizer()->set_beta2(-0.1f); }},
      {"optimizer.eps", [](S& s) { s.mutable_optimizer()->set_eps(0); }},
      {"optimizer.weight_decay", [](S& s) { s.mutable_optimizer()->set_weight_decay(-1); }},
      {"optimizer.max_grad_norm", [](S& s) { s.mutable_optimizer()->set_max_grad_norm(NAN); }},
      {"data", [](S& s) { s.clear_data(); }},
      {"data.recall.num_keys", [](S& s) { s.mutable_data()->mutable_recall()->set_num_keys(0); }},
      {"data.recall.num_values", [](S& s) { s.mutable_data()->mutable_recall()->set_num_values(0); }},
      {"data.recall.pairs", [](S& s) { s.mutable_data()->mutable_recall()->set_pairs(9); }},
      {"data.recall.queries", [](S& s) { s.mutable_data()->mutable_recall()->set_queries(5); }},
      {"data.text.path", [](S& s) { s.mutable_data()->mutable_text()->set_path(""); }},
      {"data.text.path", [](S& s) {
         s.mutable_data()->mutable_text()->set_path("relative.txt");
         s.mutable_model()->set_vocab_size(256);
       }},
      {"model.vocab_size", [](S& s) { s.mutable_data()->mutable_text()->set_path("/etc/hostname"); }},
      {"data.shards.paths", [](S& s) { s.mutable_data()->mutable_shards(); }},
      {"data.shards.paths[1]", [](S& s) {
         s.mutable_data()->mutable_shards()->add_paths("/a.bin");
         s.mutable_data()->mutable_shards()->add_paths("b.bin");
       }},
      {"steps", [](S& s) { s.set_steps(0); }},
      {"steps", [](S& s) { s.set_steps(-5); }},
      {"checkpoint.directory", [](S& s) { s.mutable_checkpoint()->set_directory("ckpt"); }},
      {"checkpoint.directory", [](S& s) { s.mutable_checkpoint()->set_every(10); }},
      {"checkpoint.every", [](S& s) {
         s.mutable_checkpoint()->set_directory("/tmp/x");
         s.mutable_checkpoint()->set_every(-1);
       }},
      {"max_restarts", [](S& s) { s.set_max_restarts(-1); }},
      {"max_restarts", [](S& s) { s.set_max_restarts(1000); }},
      {"backend", [](S& s) { s.set_backend(v1::BACKEND_UNSPECIFIED); }},
      {"backend", [](S& s) { s.set_backend(static_cast<v1::Backend>(7)); }},
      {"device_memory_bytes", [](S& s) { s.set_device_memory_bytes(0); }},
      {"device_memory_bytes", [](S& s) {
         s.set_backend(v1::BACKEND_CUDA);
         s.set_device_memory_bytes(-1);
       }},
      {"schedule.pipelined_llep", [](S& s) { s.mutable_schedule()->mutable_pipelined_llep(); },
       absl::StatusCode::kUnimplemented},
      {"schedule.ring_dtp.strip", [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_strip(-1); }},
      {"schedule.ring_dtp.chunk_rows",
       [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_chunk_rows(-5); }},
      {"schedule.ring_dtp.mode", [](S& s) {
         s.mutable_schedule()->mutable_ring_dtp()->set_mode(
             static_cast<v1::RingDtpProjection::Mode>(9));
       }},
      {"schedule.sco", [](S& s) { s.mutable_schedule()->mutable_sco(); }, absl::StatusCode::kUnimplemented},
      {"schedule.offload_stream_adamw",
       [](S& s) { s.mutable_schedule()->mutable_offload_stream_adamw(); }, absl::StatusCode::kUnimplemented},
  };
  for (const Case& c : cases) {
    v1::JobSpec s = Good();
    c.mutate(s);
    absl::Status st = ValidateJobSpec(s);
    EXPECT_EQ(st.code(), c.code) << c.field << ": " << st;
    EXPECT_THAT(st.message(), HasSubstr(c.field + ":")) << st;
    // The plan and admission refuse it the same way, and never crash.
    EXPECT_EQ(PlanJob(s).status().code(), c.code) << c.field;
    EXPECT_EQ(AdmitJob(s).status().code(), c.code) << c.field;
  }
}

TEST(JobSpecTest, RingDtpBecomesTheStepsProjection) {
  v1::JobSpec s = Good();
  auto* r = s.mutable_schedule()->mutable_ring_dtp();
  r->set_mode(v1::RingDtpProjection::MODE_WEIGHTS);
  r->set_strip(8);
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->step.projection.kind, ProjectionOptions::Kind::kRingDtp);
  ASSERT_TRUE(t->step.projection.mode.has_value());
  EXPECT_EQ(*t->step.projection.mode, RingDtpMode::kWeights);
  EXPECT_EQ(t->step.projection.strip, 8);
  r->set_mode(v1::RingDtpProjection::MODE_UNSPECIFIED);
  r->set_strip(0);
  t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->step.projection.mode.has_value());  // the smaller traveller
  EXPECT_GT(t->step.projection.strip, 0);
}

}  // namespace
}  // namespace plateau
