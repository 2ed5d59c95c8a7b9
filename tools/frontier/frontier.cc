#include "tools/frontier/frontier.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/budget/budget.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

// Searched well past the paper's 1M so that the solver, not the limit, ends
// the all-on search (the limit would be reported as such).
constexpr int64_t kMaxSeqLen = int64_t{1} << 27;

NMaxLimits Limits() {
  NMaxLimits limits;
  limits.max_batch = int64_t{1} << 20;
  limits.max_seq_len = kMaxSeqLen;
  return limits;
}

StepOptions BaseOptions(const FrontierScale& s, int64_t layers, int64_t seq_len = 64 * 1024) {
  StepOptions o;
  o.model = FrontierModel(layers);
  o.precision = Precision::kBf16Mixed;
  o.layout = {s.ranks, 1};
  o.model.seq_len = seq_len;  // 64K: where the searches start (a multiple of every P here)
  return o;
}

// The four baselines; the optimizer is the CPU-offload one (the
// baseline OffloadStreamAdamW replaces, DESIGN.md 1.4).
StepOptions AllOff(StepOptions o) {
  o.dispatch.kind = DispatchOptions::Kind::kStandardEp;
  o.projection.kind = ProjectionOptions::Kind::kDense;
  o.checkpoints.kind = CheckpointOptions::Kind::kFull;
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kCpuOffload;
  // One sequence per rank, as FSDP2 without context parallelism holds it:
  // N = B T / P = T.
  o.layout.batch = o.layout.ranks;
  return o;
}

std::string Thousands(int64_t v) {
  std::string digits = absl::StrCat(v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

std::string Billions(int64_t v) { return absl::StrFormat("%.1fB", v / 1e9); }

std::string Ratio(int64_t ours, int64_t paper) {
  return absl::StrFormat("%.2fx", static_cast<double>(ours) / static_cast<double>(paper));
}

// A context cell: the length, and what ended the search.
std::string Context(const NMaxAxis& a) {
  if (a.seq_len == 0) return "nothing fits";
  const std::string bound = a.limit == "device_memory_bytes" ? "device"
                            : a.limit == "host_memory_bytes" ? "host"
                                                             : a.limit;
  return absl::StrCat(Tokens(a.seq_len), " (", bound, ")");
}

}  // namespace

int64_t PublishedParameters(int64_t layers) {
  const GptOssArchitecture a;
  const int64_t H = a.hidden, F = a.expert_ffn;
  const int64_t q = a.heads * a.head_dim, kv = a.kv_heads * a.head_dim;
  // q, k, v, o projections with biases, and one attention sink per head.
  const int64_t attention = (H * q + q) + 2 * (H * kv + kv) + (q * H + H) + a.heads;
  const int64_t router = H * a.experts + a.experts;
  // Per expert: the fused gate/up projection [H, 2F] and the down
  // projection [F, H], each with its bias.
  const int64_t experts = a.experts * ((H * 2 * F + 2 * F) + (F * H + H));
  const int64_t norms = 2 * H;
  // Untied embedding and unembedding, and the final norm.
  return layers * (attention + router + experts + norms) + 2 * a.vocab * H + H;
}

int64_t DepthForParameters(int64_t parameters) {
  const int64_t outside = PublishedParameters(0), per_layer = PublishedParameters(1) - outside;
  return std::max<int64_t>(1, std::llround(static_cast<double>(parameters - outside) / per_layer));
}

ModelConfig FrontierModel(int64_t layers) {
  const GptOssArchitecture a;
  ModelConfig m;
  m.vocab_size = a.vocab;
  m.hidden = a.hidden;
  m.layers = layers;
  m.heads = a.hidden / a.head_dim;  // 45: the published head dimension, width = hidden
  m.kv_heads = 9;                   // a divisor of 45 nearest the published 8
  m.experts = a.experts;
  m.top_k = a.top_k;
  m.expert_ffn = a.expert_ffn;
  m.seq_len = 4096;
  return m;
}

const std::vector<FrontierScale>& PaperScales() {
  static const std::vector<FrontierScale> kScales = {
      {"120B", 120'000'000'000, 16, int64_t{1} << 20, int64_t{128} << 10, GptOssArchitecture{}.layers},
      {"241B", 241'000'000'000, 32, int64_t{1} << 20, int64_t{32} << 10},
      {"667B", 667'000'000'000, 64, int64_t{1} << 20, int64_t{64} << 10},
  };
  return kScales;
}

FitCaps FrontierCaps() { return {kH200UsableBytes, kHostBytesPerRank}; }

StepOptions AllOffOptions(const FrontierScale& scale, int64_t layers, int64_t seq_len) {
  return AllOff(BaseOptions(scale, layers, seq_len));
}

absl::StatusOr<StepOptions> AllOnOptions(const FrontierScale& scale, int64_t layers, int64_t seq_len) {
  StepOptions o = BaseOptions(scale, layers, seq_len);
  o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.dispatch.pipelined = PipelinedLlepOptions{};
  o.projection = ProjectionOptions{};
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.projection.strip = std::min<int64_t>(o.projection.strip, o.model.vocab_size);
  o.optimizer_placement = OptimizerPlacementOptions{};
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  const ParamLayout layout = LayoutOf(o);
  const int64_t group = std::max(layout.shard_numel(), layout.owned_numel_per_rank());
  o.optimizer_placement.bucket_params = std::min(o.optimizer_placement.bucket_params, (group + 7) / 8);
  o.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.checkpoints.host_budget_bytes = 0;
  PLATEAU_ASSIGN_OR_RETURN(MemoryPlan others, PlanMemory(o, layout));
  const int64_t every = (layers - 1) * TokensPerRank(o.model, o.layout) * o.model.hidden *
                        ElementBytesOf(o.precision).working;
  o.checkpoints.host_budget_bytes = std::max<int64_t>(0, std::min(every, kHostBytesPerRank - others.host_total()));
  return o;
}

absl::StatusOr<std::vector<FrontierRow>> ComputeFrontier() {
  std::vector<FrontierRow> rows;
  const FitCaps caps{kH200UsableBytes, kHostBytesPerRank};
  FitCaps balanced = caps;
  balanced.balanced_dispatch = true;
  for (const FrontierScale& s : PaperScales()) {
    FrontierRow r;
    r.scale = s;
    r.layers = s.layers > 0 ? s.layers : DepthForParameters(s.paper_parameters);
    r.published_parameters = PublishedParameters(r.layers);
    r.model_parameters = ParameterCount(FrontierModel(r.layers));
    const StepOptions base = BaseOptions(s, r.layers);
    // All on: the what-if table's row, with its settings (PipelinedLLEP
    // c = 4096, Ring-DTP's defaults, SCO with every boundary that can leave
    // within the host cap, OffloadStreamAdamW with 100M buckets, 2 slots).
    PLATEAU_ASSIGN_OR_RETURN(std::vector<WhatIfRow> what_if, WhatIfNMax(base, caps, Limits()));
    auto all_on = std::find_if(what_if.begin(), what_if.end(), [](const WhatIfRow& w) { return w.schedules == "all on"; });
    if (all_on == what_if.end()) return absl::InternalError("WhatIfNMax has no 'all on' row");
    r.all_on = all_on->n_max.context;
    const StepOptions off = AllOff(base);
    PLATEAU_ASSIGN_OR_RETURN(NMax n, SolveNMax(off, balanced, Limits()));
    r.all_off = n.context;
    PLATEAU_ASSIGN_OR_RETURN(n, SolveNMax(off, caps, Limits()));
    r.all_off_worst_case = n.context;
    StepOptions device_adamw = off;
    device_adamw.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kDevice;
    PLATEAU_ASSIGN_OR_RETURN(n, SolveNMax(device_adamw, balanced, Limits()));
    r.all_off_device_adamw = n.context;
    PLATEAU_ASSIGN_OR_RETURN(StepOptions on, AllOnOptions(s, r.layers, s.paper_all_on));
    PLATEAU_ASSIGN_OR_RETURN(r.all_on_at_paper, PlanMemory(on));
    PLATEAU_ASSIGN_OR_RETURN(r.all_off_at_paper, PlanMemory(AllOffOptions(s, r.layers, s.paper_all_off)));
    rows.push_back(std::move(r));
  }
  return rows;
}

std::string Tokens(int64_t tokens) {
  constexpr int64_t kK = 1024, kM = kK * kK;
  if (tokens >= kM) {
    return tokens % kM == 0 ? absl::StrCat(tokens / kM, "M") : absl::StrFormat("%.2fM", tokens / double(kM));
  }
  if (tokens >= kK) {
    return tokens % kK == 0 ? absl::StrCat(tokens / kK, "K") : absl::StrFormat("%.1fK", tokens / double(kK));
  }
  return absl::StrCat(tokens);
}

std::string FrontierTable(const std::vector<FrontierRow>& rows) {
  std::string t =
      "| scale | H200s | depth | Θ published / ours | all on: ours | paper | ours / paper | all off: ours | "
      "paper (FSDP2-best) | ours / paper | all off, worst-case routing | all off, device AdamW |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const FrontierRow& r : rows) {
    absl::StrAppend(&t, "| ", r.scale.name, " | ", r.scale.ranks, " | ", r.layers, " | ",
                    Billions(r.published_parameters), " / ", Billions(r.model_parameters), " | ",
                    Context(r.all_on), " | ", Tokens(r.scale.paper_all_on), " | ",
                    Ratio(r.all_on.seq_len, r.scale.paper_all_on), " | ", Context(r.all_off), " | ",
                    Tokens(r.scale.paper_all_off), " | ", Ratio(r.all_off.seq_len, r.scale.paper_all_off), " | ",
                    Context(r.all_off_worst_case), " | ", Context(r.all_off_device_adamw), " |\n");
  }
  absl::StrAppend(&t, "\nExact lengths (tokens): ");
  for (size_t i = 0; i < rows.size(); ++i) {
    const FrontierRow& r = rows[i];
    absl::StrAppend(&t, i ? "; " : "", r.scale.name, " all on ", Thousands(r.all_on.seq_len), ", all off ",
                    Thousands(r.all_off.seq_len), ", worst case ", Thousands(r.all_off_worst_case.seq_len));
  }
  absl::StrAppend(&t, ".\n\nPer-rank plans by live set (GiB): all on at the paper's longest context, all off at "
                      "FSDP2-best's last length.\n\n");
  absl::StrAppend(&t, "| scale | stack | context | weights | grads | optimizer | activations | checkpoints | projection | "
                      "dispatch | device total (cap 128) | host total |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  auto gib = [](int64_t b) { return absl::StrFormat("%.2f", b / double(int64_t{1} << 30)); };
  for (const FrontierRow& r : rows) {
    for (bool on : {true, false}) {
      const MemoryPlan& p = on ? r.all_on_at_paper : r.all_off_at_paper;
      auto at = [&](LiveSet s) { return gib(p.bytes[static_cast<int>(s)]); };
      const int64_t device = on ? p.total() : DeviceBytesAgainstCap(p, {0, 0, true});
      absl::StrAppend(&t, "| ", r.scale.name, " | ", on ? "all on" : "all off", " | ",
                      Tokens(on ? r.scale.paper_all_on : r.scale.paper_all_off), " | ", at(LiveSet::kWeights), " | ",
                      at(LiveSet::kGrads), " | ", at(LiveSet::kOptimizer), " | ", at(LiveSet::kActivations), " | ",
                      at(LiveSet::kCheckpoints), " | ", at(LiveSet::kProjection), " | ",
                      on ? at(LiveSet::kDispatch) : absl::StrCat(gib(p.dispatch_balanced_bytes), " (balanced)"), " | ",
                      gib(device), device > kH200UsableBytes ? " (over)" : "", " | ", gib(p.host_total()), " |\n");
    }
  }
  return t;
}

// ---------------------------------------------------------------------------
// The chart.

namespace {

using chart::Canvas;
using chart::Point;
using chart::Rgb;

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{225, 225, 225}, kAxis{90, 90, 90};
constexpr Rgb kOn{31, 90, 180}, kOff{200, 50, 40}, kWorst{235, 140, 30};

struct Series {
  const char* label;
  std::vector<int64_t> values;
  Rgb colour;
  bool dashed;
  double width;
};

}  // namespace

Canvas FrontierPlot(const std::vector<FrontierRow>& rows) {
  const int W = 960, H = 600, left = 96, right = 300, top = 64, bottom = 84;
  Canvas c(W, H, kWhite);
  std::vector<Series> series = {
      {"all on, ours", {}, kOn, false, 3},
      {"all on, paper", {}, kOn, true, 2},
      {"all off, ours", {}, kOff, false, 3},
      {"all off, paper (FSDP2-best)", {}, kOff, true, 2},
      {"all off, ours, worst routing", {}, kWorst, true, 1},
  };
  for (const FrontierRow& r : rows) {
    series[0].values.push_back(r.all_on.seq_len);
    series[1].values.push_back(r.scale.paper_all_on);
    series[2].values.push_back(r.all_off.seq_len);
    series[3].values.push_back(r.scale.paper_all_off);
    series[4].values.push_back(r.all_off_worst_case.seq_len);
  }
  // log2 axis from the power of two below the smallest value to the one
  // above the largest (and even powers for the labels).
  int lo = 40, hi = 0;
  for (const Series& s : series) {
    for (int64_t v : s.values) {
      if (v <= 0) continue;
      lo = std::min(lo, static_cast<int>(std::floor(std::log2(static_cast<double>(v)))));
      hi = std::max(hi, static_cast<int>(std::ceil(std::log2(static_cast<double>(v)))));
    }
  }
  if (hi <= lo) hi = lo + 2;
  lo -= lo % 2;
  hi += hi % 2;
  const double plot_w = W - left - right, plot_h = H - top - bottom;
  auto y_of = [&](double log2v) { return top + plot_h * (hi - log2v) / (hi - lo); };
  auto x_of = [&](size_t i) {
    return left + plot_w * (rows.size() < 2 ? 0.5 : 0.08 + 0.84 * i / (rows.size() - 1.0));
  };
  c.Text(left, 18, "Longest context that fits, per scale (bf16 mixed, H200: 128 GiB usable, 240 GB host)", kBlack, 1);
  c.Text(left, 34, "gpt-oss architecture at 120B / 241B / 667B; lines: ours (budget), dashed: the paper", kAxis, 1);
  for (int p = lo; p <= hi; ++p) {
    const double y = y_of(p);
    c.Line({double(left), y}, {double(W - right), y}, kGrid, 1);
    if (p % 2 == 0) {
      const std::string label = Tokens(int64_t{1} << p);
      c.Text(left - 10 - Canvas::TextWidth(label, 2), static_cast<int>(y) - 7, label, kBlack, 2);
    }
  }
  c.Line({double(left), double(top)}, {double(left), double(H - bottom)}, kAxis, 2);
  c.Line({double(left), double(H - bottom)}, {double(W - right), double(H - bottom)}, kAxis, 2);
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string a = absl::StrCat(rows[i].scale.name, ", L=", rows[i].layers);
    const std::string b = absl::StrCat(rows[i].scale.ranks, " H200s");
    const int x = static_cast<int>(x_of(i));
    c.Text(x - Canvas::TextWidth(a, 2) / 2, H - bottom + 12, a, kBlack, 2);
    c.Text(x - Canvas::TextWidth(b, 2) / 2, H - bottom + 34, b, kAxis, 2);
  }
  c.Text(12, top - 12, "tokens", kBlack, 1);
  int legend_y = top + 10;
  for (const Series& s : series) {
    std::vector<Point> pts;
    for (size_t i = 0; i < s.values.size(); ++i) {
      if (s.values[i] > 0) pts.push_back({x_of(i), y_of(std::log2(static_cast<double>(s.values[i])))});
    }
    for (size_t i = 1; i < pts.size(); ++i) {
      if (s.dashed) {
        c.DashedLine(pts[i - 1], pts[i], s.colour, s.width, 10, 6);
      } else {
        c.Line(pts[i - 1], pts[i], s.colour, s.width);
      }
    }
    for (const Point& p : pts) {
      const int r = s.dashed ? 3 : 5;
      c.FillRect(static_cast<int>(p.x) - r, static_cast<int>(p.y) - r, static_cast<int>(p.x) + r + 1,
                 static_cast<int>(p.y) + r + 1, s.colour);
    }
    const double lx = W - right + 20;
    if (s.dashed) {
      c.DashedLine({lx, legend_y + 7.0}, {lx + 36, legend_y + 7.0}, s.colour, s.width, 10, 6);
    } else {
      c.Line({lx, legend_y + 7.0}, {lx + 36, legend_y + 7.0}, s.colour, s.width);
    }
    c.Text(static_cast<int>(lx) + 44, legend_y, s.label, kBlack, 1);
    legend_y += 24;
  }
  c.Text(W - right + 20, legend_y + 16, "all on: every schedule,", kAxis, 1);
  c.Text(W - right + 20, legend_y + 28, "  one sequence over P ranks;", kAxis, 1);
  c.Text(W - right + 20, legend_y + 44, "all off: the baselines +", kAxis, 1);
  c.Text(W - right + 20, legend_y + 56, "  CPU-offload AdamW, one", kAxis, 1);
  c.Text(W - right + 20, legend_y + 68, "  sequence per rank;", kAxis, 1);
  c.Text(W - right + 20, legend_y + 84, "paper all on: its longest", kAxis, 1);
  c.Text(W - right + 20, legend_y + 96, "  run (1M), not a limit.", kAxis, 1);
  return c;
}

}  // namespace plateau
