#include "kernels/model/config.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace plateau {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view expected,
                 absl::string_view got) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected ", expected, ", got ", got));
}

}  // namespace

int64_t WeightSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status ValidateModelConfig(const ModelConfig& m) {
  auto positive = [](absl::string_view field, int64_t v) -> absl::Status {
    if (v < 1) return Bad(field, ">= 1", absl::StrCat(v));
    return absl::OkStatus();
  };
  if (m.vocab_size < 2) {
    return Bad("model.vocab_size", ">= 2", absl::StrCat(m.vocab_size));
  }
  if (m.vocab_size > (int64_t{1} << 31)) {
    return Bad("model.vocab_size", "< 2^31 (token ids are int32)",
               absl::StrCat(m.vocab_size));
  }
  for (auto [field, v] : {std::pair<absl::string_view, int64_t>{"model.hidden", m.hidden},
                          {"model.layers", m.layers},
                          {"model.heads", m.heads},
                          {"model.kv_heads", m.kv_heads},
                          {"model.experts", m.experts},
                          {"model.top_k", m.top_k},
                          {"model.expert_ffn", m.expert_ffn},
                          {"model.seq_len", m.seq_len}}) {
    if (absl::Status s = positive(field, v); !s.ok()) return s;
  }
  if (m.hidden % m.heads != 0) {
    return Bad("model.heads", absl::StrCat("a divisor of model.hidden = ", m.hidden),
               absl::StrCat(m.heads));
  }
  if (m.heads % m.kv_heads != 0) {
    return Bad("model.kv_heads", absl::StrCat("a divisor of model.heads = ", m.heads),
               absl::StrCat(m.kv_heads));
  }
  if (m.head_dim() % 2 != 0) {
    return Bad("model.heads",
               "a head dimension hidden/heads that is even (rotary pairs)",
               absl::StrCat("hidden/heads = ", m.head_dim()));
  }
  if (m.top_k > m.experts) {
    return Bad("model.top_k", absl::StrCat("<= model.experts = ", m.experts),
               absl::StrCat(m.top_k));
  }
  if (!(m.rope_theta > 1.0f) || !std::isfinite(m.rope_theta)) {
    return Bad("model.rope_theta", "a finite value > 1", absl::StrCat(m.rope_theta));
  }
  if (!(m.norm_eps > 0.0f) || !std::isfinite(m.norm_eps)) {
    return Bad("model.norm_eps", "a finite value > 0", absl::StrCat(m.norm_eps));
  }
  if (!(m.init_std > 0.0f) || !std::isfinite(m.init_std)) {
    return Bad("model.init_std", "a finite value > 0", absl::StrCat(m.init_std));
  }
  return absl::OkStatus();
}

absl::Status ValidateLayout(const ModelConfig& m, const LayoutConfig& l) {
  if (absl::Status s = ValidateModelConfig(m); !s.ok()) return s;
  if (l.ranks < 1) return Bad("layout.ranks", ">= 1", absl::StrCat(l.ranks));
  if (l.batch < 1) return Bad("layout.batch", ">= 1", absl::StrCat(l.batch));
  if (m.experts % l.ranks != 0) {
    return Bad("model.experts",
               absl::StrCat("a multiple of layout.ranks = ", l.ranks,
                            " (experts are partitioned across ranks)"),
               absl::StrCat(m.experts));
  }
  if (m.seq_len % l.ranks != 0) {
    return Bad("model.seq_len",
               absl::StrCat("a multiple of layout.ranks = ", l.ranks,
                            " (each rank holds one contiguous slice of every "
                            "sequence)"),
               absl::StrCat(m.seq_len));
  }
  return absl::OkStatus();
}

std::vector<WeightSpec> ModelWeights(const ModelConfig& m) {
  const int64_t H = m.hidden, d = m.head_dim(), E = m.experts,
                F = m.expert_ffn, V = m.vocab_size;
  const float s = m.init_std;
  const float s_out = s / std::sqrt(2.0f * static_cast<float>(m.layers));
  std::vector<WeightSpec> w;
  w.push_back({"embed.weight", {V, H}, s, false});
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    w.push_back({p + "attn_norm.weight", {H}, 0.0f, false});
    w.push_back({p + "attn.wq", {H, m.heads * d}, s, false});
    w.push_back({p + "attn.wk", {H, m.kv_heads * d}, s, false});
    w.push_back({p + "attn.wv", {H, m.kv_heads * d}, s, false});
    w.push_back({p + "attn.wo", {m.heads * d, H}, s_out, false});
    w.push_back({p + "moe_norm.weight", {H}, 0.0f, false});
    w.push_back({p + "router.weight", {H, E}, s, false});
    w.push_back({p + "experts.w_gate", {E, H, F}, s, true});
    w.push_back({p + "experts.w_up", {E, H, F}, s, true});
    w.push_back({p + "experts.w_down", {E, F, H}, s_out, true});
  }
  w.push_back({"final_norm.weight", {H}, 0.0f, false});
  w.push_back({"lm_head.weight", {V, H}, s, false});
  return w;
}

int64_t ParameterCount(const ModelConfig& m) {
  int64_t n = 0;
  for (const WeightSpec& w : ModelWeights(m)) n += w.numel();
  return n;
}

int64_t ActiveParameterCount(const ModelConfig& m) {
  int64_t n = 0;
  for (const WeightSpec& w : ModelWeights(m)) {
    n += w.expert ? w.numel() / m.experts * m.top_k : w.numel();
  }
  return n;
}

int64_t TokensPerRank(const ModelConfig& m, const LayoutConfig& l) {
  return l.batch * m.seq_len / l.ranks;
}

}  // namespace plateau
