#include "worker/trainer_options.h"

namespace plateau {

TrainerOptions RecallDemoJob(int64_t ranks) {
  TrainerOptions o;
  RecallTask& task = o.data.recall;
  task.num_keys = 8;
  task.num_values = 8;
  task.pairs = 4;
  task.queries = 4;
  ModelConfig& m = o.step.model;
  m.vocab_size = task.vocab_size();
  m.hidden = 64;
  m.layers = 2;
  m.heads = 4;
  m.kv_heads = 2;
  m.experts = 4;
  m.top_k = 2;
  m.expert_ffn = 128;
  m.seq_len = 32;
  o.step.layout = {ranks, 32};
  o.step.optimizer.lr = 6e-3f;
  // SCO: the host pool takes what it can of the boundaries (with 2 layers,
  // h_0: kernels/checkpoints/checkpoints_plan.h).
  o.step.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.step.checkpoints.host_budget_bytes = int64_t{1} << 20;
  // PipelinedLLEP: 4 chunks of 128 tokens per rank and layer at 2 ranks
  // (N = 512), spilling pieces of 32 routes or more; its dispatch buffers are
  // launch-sized, so the demo's dispatch peak is its bound whatever the
  // router learns.
  o.step.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.step.dispatch.pipelined.chunk_tokens = 128;
  o.step.dispatch.pipelined.balance.min_piece = 32;
  // OffloadStreamAdamW: master and moments on the host, 16,384-parameter
  // buckets through two device slots.
  o.step.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  o.step.optimizer_placement.bucket_params = 16384;
  o.step.optimizer_placement.staging_slots = 2;
  o.steps = 200;
  return o;
}

double AttentionFlopsPerStep(const ModelConfig& m, int64_t batch) {
  // Causal attention: QK^T and PV are 4 T^2 d flops per head forward,
  // half of them masked; backward is twice the forward.
  return 6.0 * m.layers * batch * static_cast<double>(m.seq_len) * m.seq_len * m.heads *
         m.head_dim();
}

double ProjectionFlopsPerStep(const ModelConfig& m, int64_t batch) {
  return 6.0 * static_cast<double>(m.vocab_size) * m.hidden * static_cast<double>(batch) *
         m.seq_len;
}

double ModelFlopsPerStep(const ModelConfig& m, int64_t batch) {
  const double tokens = static_cast<double>(batch) * m.seq_len;
  // The embedding is a table lookup and the norms' weights scale elementwise
  // (2 H a layer and the final H): no matrix products.
  const double matmul_params =
      static_cast<double>(ActiveParameterCount(m) - m.vocab_size * m.hidden - (2 * m.layers + 1) * m.hidden);
  return 6.0 * matmul_params * tokens + AttentionFlopsPerStep(m, batch);
}

}  // namespace plateau
