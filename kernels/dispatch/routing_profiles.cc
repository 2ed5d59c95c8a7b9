#include "kernels/dispatch/routing_profiles.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"

namespace plateau {
namespace {

// splitmix64 (Steele, Lea, Flood 2014): a full-period 64-bit stream that
// mixes any seed well, the same bits on every platform.
class SplitMix {
 public:
  explicit SplitMix(uint64_t state) : state_(state) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) by a 64x64 -> 128-bit multiply (bias below 2^-40 at
  // the sizes used here; exactness is not needed, determinism is).
  int64_t Below(int64_t n) {
    const unsigned __int128 wide =
        static_cast<unsigned __int128>(Next()) * static_cast<uint64_t>(n);
    return static_cast<int64_t>(wide >> 64);
  }
  // A float in [lo, lo + span) from 24 random bits: every step is exact or a
  // single IEEE rounding.
  float Uniform(float lo, float span) {
    return lo + span * (static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f));
  }

 private:
  uint64_t state_;
};

// The first m entries of pool become a uniformly random m-subset in random
// order (partial Fisher-Yates).
void PartialShuffle(std::vector<int32_t>& pool, int64_t m, SplitMix& rng) {
  const int64_t n = static_cast<int64_t>(pool.size());
  for (int64_t i = 0; i < m; ++i) std::swap(pool[i], pool[i + rng.Below(n - i)]);
}

absl::Status Bad(absl::string_view field, absl::string_view expected, double got) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
}

}  // namespace

std::string RoutingProfile::Name() const {
  if (hot_percent == 0.0) return "balanced";
  if (hot_blocks > 0) return absl::StrCat(hot_percent, "%/", hot_experts, "@", hot_blocks);
  return absl::StrCat(hot_percent, "%/", hot_experts);
}

absl::Status ValidateRoutingProfile(const RoutingProfile& p, int64_t experts, int64_t top_k,
                                    int64_t tokens) {
  if (experts < 1) return Bad("model.experts", ">= 1", static_cast<double>(experts));
  if (top_k < 1 || top_k > experts) {
    return Bad("model.top_k", absl::StrCat("in [1, model.experts = ", experts, "]"),
               static_cast<double>(top_k));
  }
  // Written so that NaN fails too.
  if (!(p.hot_percent >= 0.0 && p.hot_percent <= 100.0)) {
    return Bad("routing.hot_percent", "a percentage in [0, 100]", p.hot_percent);
  }
  if (p.hot_percent > 0.0 && (p.hot_experts < 1 || p.hot_experts > experts)) {
    return Bad("routing.hot_experts",
               absl::StrCat("a hot set of 1 to model.experts = ", experts, " experts"),
               static_cast<double>(p.hot_experts));
  }
  if (p.hot_blocks < 0) {
    return Bad("routing.hot_blocks", ">= 0 runs of hot tokens (0: scattered)",
               static_cast<double>(p.hot_blocks));
  }
  if (tokens < 0) return Bad("tokens", ">= 0", static_cast<double>(tokens));
  return absl::OkStatus();
}

absl::StatusOr<Routes> MakeRoutes(const RoutingProfile& p, int64_t experts, int64_t top_k,
                                  int64_t tokens, uint64_t seed, int rank) {
  if (absl::Status st = ValidateRoutingProfile(p, experts, top_k, tokens); !st.ok()) return st;
  const int64_t E = experts, K = top_k, N = tokens;
  // One stream per (seed, rank); the rank is mixed in so that neighbouring
  // ranks' streams share nothing.
  SplitMix rng(seed ^ (0xD1B54A32D192ED03ull * (static_cast<uint64_t>(rank) + 1)));

  // Which tokens are hot: a random subset of exactly round(h N / 100).
  const int64_t hot =
      static_cast<int64_t>(std::llround(p.hot_percent * static_cast<double>(N) / 100.0));
  std::vector<char> is_hot(N, 0);
  if (p.hot_blocks == 0) {
    std::vector<int32_t> order(N);
    std::iota(order.begin(), order.end(), 0);
    PartialShuffle(order, hot, rng);
    for (int64_t i = 0; i < hot; ++i) is_hot[order[i]] = 1;
  } else {
    // b runs of floor/ceil(hot / b) tokens; the N - hot cold tokens are cut
    // into b + 1 gaps at b uniform points of [0, N - hot], sorted.
    const int64_t b = p.hot_blocks, cold = N - hot;
    std::vector<int64_t> cut(b);
    for (int64_t& c : cut) c = rng.Below(cold + 1);
    std::sort(cut.begin(), cut.end());
    for (int64_t i = 0, prev_cut = 0, t = 0; i < b; ++i) {
      t += cut[i] - prev_cut;  // the gap before run i
      prev_cut = cut[i];
      const int64_t run = (i + 1) * hot / b - i * hot / b;
      for (int64_t j = 0; j < run; ++j) is_hot[t++] = 1;
    }
  }

  Routes r;
  r.chosen.resize(N * K);
  r.gates.resize(N * K);
  const int64_t g = p.hot_experts;
  std::vector<int32_t> all(E), hot_pool(p.hot_percent > 0.0 ? g : 0), cold_pool;
  std::iota(all.begin(), all.end(), 0);
  std::iota(hot_pool.begin(), hot_pool.end(), 0);
  if (p.hot_percent > 0.0 && g < K) {
    cold_pool.resize(E - g);
    std::iota(cold_pool.begin(), cold_pool.end(), static_cast<int32_t>(g));
  }
  for (int64_t t = 0; t < N; ++t) {
    int32_t* c = &r.chosen[t * K];
    if (!is_hot[t]) {
      PartialShuffle(all, K, rng);
      std::copy_n(all.begin(), K, c);
    } else if (g >= K) {
      PartialShuffle(hot_pool, K, rng);
      std::copy_n(hot_pool.begin(), K, c);
    } else {
      // All g hot experts and k - g others, then in random slot order (the
      // hot experts are not always the first choices).
      PartialShuffle(cold_pool, K - g, rng);
      std::vector<int32_t> mix(hot_pool);
      mix.insert(mix.end(), cold_pool.begin(), cold_pool.begin() + (K - g));
      PartialShuffle(mix, K, rng);
      std::copy_n(mix.begin(), K, c);
    }
    float* w = &r.gates[t * K];
    float sum = 0.0f;
    for (int64_t j = 0; j < K; ++j) sum += (w[j] = rng.Uniform(0.05f, 0.95f));
    for (int64_t j = 0; j < K; ++j) w[j] /= sum;
  }
  return r;
}

}  // namespace plateau
