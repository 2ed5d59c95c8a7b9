// The paper's frontier by simulation (issue 15): the budget of
// kernels/budget put on the gpt-oss-120b architecture at the paper's three
// scales (120B / 241B / 667B on 16 / 32 / 64 H200s), solving the longest
// context with all four schedules on and with all off. docs/FRONTIER.md
// explains the method and the approximations; its table is
// FrontierTable(ComputeFrontier()) (tools/frontier:frontier_test keeps it
// so), and docs/frontier.png is FrontierPlot of the same rows.
//
// Thread safety: pure functions.
#ifndef PLATEAU_TOOLS_FRONTIER_FRONTIER_H_
#define PLATEAU_TOOLS_FRONTIER_FRONTIER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/chart/canvas.h"
#include "kernels/budget/n_max.h"
#include "kernels/model/config.h"

namespace plateau {

// The published gpt-oss-120b configuration (its config.json): hidden 2880,
// 36 layers, 128 experts top-4 with expert FFN 2880, 64 query and 8 KV
// heads of dimension 64, vocabulary 201,088.
struct GptOssArchitecture {
  int64_t hidden = 2880;
  int64_t layers = 36;
  int64_t experts = 128;
  int64_t top_k = 4;
  int64_t expert_ffn = 2880;
  int64_t heads = 64;
  int64_t kv_heads = 8;
  int64_t head_dim = 64;
  int64_t vocab = 201088;
};

// Parameters of the published architecture at a depth, biases and
// attention sinks included: 116,829,156,672 at its 36 layers.
int64_t PublishedParameters(int64_t layers);
// The depth whose published-architecture count is nearest `parameters`.
int64_t DepthForParameters(int64_t parameters);

// The same architecture as our model can express it (docs/MODEL.md: the
// attention width is the hidden size): 45 query heads and 9 KV heads of
// dimension 64 (2880 = 45 x 64), at the given depth.
ModelConfig FrontierModel(int64_t layers);

// One H200 as the budget sees it: 141 GB (143,771 MiB) less headroom for
// the CUDA context, NCCL's and cuBLAS' buffers and the allocator's
// fragmentation; a rank's share of the paper's 2 TB host per 8-GPU node.
inline constexpr int64_t kH200UsableBytes = int64_t{128} << 30;   // 128 GiB of 140.4 GiB
inline constexpr int64_t kHostBytesPerRank = int64_t{240'000'000'000};  // 1.92 TB / 8

struct FrontierScale {
  const char* name;             // "120B"
  int64_t paper_parameters;     // 120e9
  int64_t ranks;                // H200s
  int64_t paper_all_on;         // longest context the paper trains with the stack
  int64_t paper_all_off;        // FSDP2-best's last length before out of memory
  // The depth: the published one for 120B (gpt-oss-120b itself, 116.8B,
  // which the paper calls 120B); 0: DepthForParameters(paper_parameters).
  int64_t layers = 0;
};
const std::vector<FrontierScale>& PaperScales();

struct FrontierRow {
  FrontierScale scale;
  int64_t layers = 0;
  int64_t published_parameters = 0;  // PublishedParameters(layers)
  int64_t model_parameters = 0;      // ParameterCount(FrontierModel(layers))
  // All four schedules on (WhatIfNMax's "all on" row), one sequence over
  // every rank (B = 1: ring attention over P).
  NMaxAxis all_on;
  // All four off: standard EP, dense projection, full checkpoints and the
  // CPU-offload AdamW baseline, one sequence per rank (B = P), dispatch at
  // its balanced case.
  NMaxAxis all_off;
  // The same with standard EP's worst case (the admission guarantee).
  NMaxAxis all_off_worst_case;
  // The same with device AdamW (master and moments on the device).
  NMaxAxis all_off_device_adamw;
  // Where the memory goes: the all-on plan at the paper's longest context,
  // the all-off plan at the paper's FSDP2-best length.
  MemoryPlan all_on_at_paper;
  MemoryPlan all_off_at_paper;
};

// The options of the two stacks at a context length: all on as the
// what-if table sets them (WhatIfNMax: PipelinedLLEP c = 4096, Ring-DTP's
// defaults, SCO with every boundary that can leave within the host cap,
// OffloadStreamAdamW with 100M buckets (at most an eighth of the larger
// group) and 2 slots), one sequence over the P ranks; all off as
// FrontierRow::all_off.
absl::StatusOr<StepOptions> AllOnOptions(const FrontierScale& scale, int64_t layers, int64_t seq_len);
StepOptions AllOffOptions(const FrontierScale& scale, int64_t layers, int64_t seq_len);
FitCaps FrontierCaps();

absl::StatusOr<std::vector<FrontierRow>> ComputeFrontier();

// The Markdown tables of docs/FRONTIER.md: the frontier (one row per
// scale), then the per-rank plans by live set.
std::string FrontierTable(const std::vector<FrontierRow>& rows);

// "1M", "128K", "1.56M": tokens in units of 2^10 / 2^20.
std::string Tokens(int64_t tokens);

// The frontier chart: longest context (log scale) per scale, ours and the
// paper's, all on and all off.
chart::Canvas FrontierPlot(const std::vector<FrontierRow>& rows);

}  // namespace plateau

#endif  // PLATEAU_TOOLS_FRONTIER_FRONTIER_H_
