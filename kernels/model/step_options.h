// The options of the training step: the model, its layout over the ranks,
// the optimizer and the schedule chosen at each schedule point. Plain data,
// read by the step (kernels/step/step.h) and by the budget
// (kernels/budget/budget.h), which plans them without a backend.
#ifndef PLATEAU_KERNELS_MODEL_STEP_OPTIONS_H_
#define PLATEAU_KERNELS_MODEL_STEP_OPTIONS_H_

#include <cstdint>
#include <optional>

#include "kernels/model/config.h"
#include "kernels/model/precision.h"

namespace plateau {

// Ring-DTP's circulation modes (kernels/projection/ring_dtp.h): the batch
// travels (activations) or the vocabulary shards do (weights). Here, with
// the options, so that the model's folder needs nothing from above it.
enum class RingDtpMode { kActivations, kWeights };

// The learning rate of each step (kernels/optimizer/lr_schedule.h,
// docs/MODEL.md "Learning-rate schedule"): linear warm-up from 0 over
// warmup_steps, then constant, or cosine or linear decay from lr to min_lr
// at total_steps. The default (constant, no warm-up) is lr at every step.
struct LrSchedule {
  enum class Decay { kConstant, kCosine, kLinear };
  Decay decay = Decay::kConstant;
  int64_t warmup_steps = 0;  // W, 0 <= W <= total_steps (a new job's < total_steps: step W + 1 runs at lr)
  int64_t total_steps = 0;   // T: the job's steps (the decay ends there)
  double min_lr = 0.0;       // the floor, absolute; 0 <= min_lr <= lr
};

struct OptimizerConfig {
  float lr = 1e-3f;  // the peak: every step's under the default schedule
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float max_grad_norm = 1.0f;  // 0 turns clipping off
  LrSchedule schedule;
};

// Which schedule computes the vocabulary projection and cross-entropy.
struct ProjectionOptions {
  enum class Kind { kDense, kRingDtp };
  Kind kind = Kind::kDense;
  // Ring-DTP (kernels/projection/ring_dtp.h): the circulation mode (unset:
  // RingDtp::ChooseMode picks the smaller traveller), the strip width S, the
  // token rows per strip tile, and the rows per activation-mode pass (0: the
  // whole batch in one pass).
  std::optional<RingDtpMode> mode;
  int64_t strip = 1024;
  int64_t row_tile = 2048;
  int64_t chunk_rows = 0;
};

// Expert dispatch (kernels/dispatch/): the options of LLEP and
// PipelinedLLEP (DESIGN.md §1.1), validated by kernels/dispatch/llep_plan.h
// (errors name the field as a user types it,
// "schedule.pipelined_llep.chunk_tokens").
// LLEP's least-loaded assignment (llep_plan.h, AssignLlep).
struct LlepOptions {
  // Per-rank capacity C = max(1, floor(alpha * T / P)) routes, T the routes
  // of the layer (of the chunk, in PipelinedLLEP). The reference code's
  // max_tokens_factor, and its default. > 0; below 1 the ranks' capacities
  // do not cover T and the overflow is forced onto the least-loaded ranks.
  double alpha = 1.1;
  // Smallest piece of an expert's routes that is moved to a helper rank (a
  // helper's GEMM on fewer rows would cost more than it saves). The
  // reference's min_tokens_per_gemm, and its default. >= 1. It also bounds
  // how many experts a rank can borrow: at most routes / min_piece
  // (llep_plan.h).
  int64_t min_piece = 1024;
  // Below this imbalance (max over ranks of the routes to its own experts,
  // over their mean) the layer runs as plain expert parallelism: nothing is
  // moved. The reference's MOE_ADAPTIVE_LPT_ROUTING_RATIO. >= 1; 1 balances
  // every layer (max/mean is never below 1).
  double lambda = 1.0;
  // The most experts one rank may borrow in one layer call (one chunk, in
  // PipelinedLLEP); 0: no cap beyond min(E - E_p, routes / min_piece). The
  // borrowed weights and their gradients are 2 x 3HF floats per borrowed
  // expert of the dispatch live set, which dominate its bound at large H F;
  // a cap sizes them for B = max_borrowed instead of the worst case.
  // Overflow that no rank with borrowing room can take stays on its home
  // rank (AssignLlep, llep_plan.h). >= 0.
  int64_t max_borrowed = 0;
};

// Which of a source rank's tokens a PipelinedLLEP chunk takes.
enum class ChunkMembership {
  // Chunk j of K takes tokens j, j+K, j+2K, ...: spreads similar neighbouring
  // routes over the chunks (the paper's default).
  kStrided,
  // Chunk j takes the block [floor(j N / K), floor((j+1) N / K)): the same
  // chunk sizes as strided, for comparison.
  kContiguous,
};

struct PipelinedLlepOptions {
  // c: the most tokens one source rank sends in one chunk, so a rank
  // receives at most P c k rows per chunk whatever the routing (Eq. 1).
  // K = ceil(max_p N_p / c) chunks (at small N, K = 1). >= 1.
  int64_t chunk_tokens = 4096;
  ChunkMembership membership = ChunkMembership::kStrided;
  // The assignment run on each chunk's loads.
  LlepOptions balance;
};

// Which schedule dispatches the routes to the experts.
struct DispatchOptions {
  enum class Kind {
    kStandardEp,    // kernels/dispatch/standard_ep.h (the baseline)
    kLlep,          // kernels/dispatch/llep.h (the compute-balancing baseline)
    kPipelinedLlep  // kernels/dispatch/pipelined_llep.h (bounded receive buffers)
  };
  Kind kind = Kind::kStandardEp;
  LlepOptions llep;
  PipelinedLlepOptions pipelined;
};

// Where the layer boundaries wait for the backward's recomputation.
struct CheckpointOptions {
  enum class Kind {
    kFull,  // every boundary on the device (kernels/checkpoints/full_checkpoints.h)
    kSco    // the earliest boundaries in a capped host pool (kernels/checkpoints/sco.h)
  };
  Kind kind = Kind::kFull;
  // SCO: beta, the host bytes per rank the checkpoints may take (the pool
  // holds as many whole boundaries as fit, then whole attention records
  // under keep_attention; kernels/checkpoints/checkpoints_plan.h).
  int64_t host_budget_bytes = 0;
  // Keep each layer's attention output o and log-sum-exp (fp32, as the
  // backward reads them) from the forward to the backward, so that the
  // backward's recompute of the layer skips attention's forward: at long
  // context the step's largest cost repeated (2 of the 11 units of
  // attention work a layer executes: docs/SCHEDULES.md "Keeping attention's
  // output"). Costs L records of N x (heads d + heads) x 4 bytes in
  // kCheckpoints, held as the boundaries are (all on the device, or SCO's
  // slots, device storage and host pool: PlanScoPools); the values are the
  // recompute's bit for bit. Off by default: the paper recomputes.
  bool keep_attention = false;
};

// Where the optimizer state lives and how it is updated
// (kernels/optimizer/).
struct OptimizerPlacementOptions {
  enum class Kind {
    kDevice,        // master, m and v on the device (device_adamw.h)
    kCpuOffload,    // on the host, updated there (cpu_offload_adamw.h; the baseline)
    kOffloadStream  // on the host, streamed through device slots (offload_stream_adamw.h)
  };
  Kind kind = Kind::kDevice;
  // OffloadStreamAdamW: parameters per bucket, and staging slots (1 to 3).
  int64_t bucket_params = 100'000'000;
  int64_t staging_slots = 2;
};

struct StepOptions {
  ModelConfig model;
  // fp32 (what the CPU backend computes) or bf16 mixed (kernels/model/
  // precision.h): the budget plans either; TrainingStep::Create refuses a
  // precision its backend does not compute.
  Precision precision = Precision::kFp32;
  // Under bf16, the arithmetic of attention (precision.h): kAuto takes the
  // tensor cores on CUDA where their kernels exist. No effect in fp32.
  Bf16Attention bf16_attention = Bf16Attention::kAuto;
  // Under bf16 with the tensor cores on an H100/H200: whether their
  // kernels may run on wgmma (ModelKernelsOptions::tc_wgmma; false keeps
  // them on mma.sync, what an A100 runs). The CPU ignores it.
  bool attention_wgmma = true;
  LayoutConfig layout;
  OptimizerConfig optimizer;
  ProjectionOptions projection;
  DispatchOptions dispatch;
  CheckpointOptions checkpoints;
  OptimizerPlacementOptions optimizer_placement;
  uint64_t seed = 1;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_STEP_OPTIONS_H_
