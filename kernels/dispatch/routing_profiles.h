// Deterministic routing profiles for the dispatch tests and benchmarks
// (DESIGN.md §1.1; the paper's App. B.2): the same (profile, seed, rank,
// shape) gives byte-identical routes on every machine and for every
// schedule, so standard EP, LLEP and PipelinedLLEP are compared on the same
// inputs.
//
// - balanced: each token chooses k distinct experts uniformly at random.
// - "h%/g": round(h% of N) of a rank's tokens (chosen at random) are hot and
//   route to the hot set, experts [0, g): k distinct of them when g >= k,
//   else all g plus k - g distinct others. The other tokens are balanced.
//   Skew rises with h and falls with g; g < k is the regime where a hot
//   token's routes cannot all land on hot experts (the paper's boundary).
//   The hot set is the lowest expert ids, so it lives on the lowest ranks:
//   the most concentrated load for a given (h, g).
// - "h%/g@b": the same routes, but the hot tokens are b contiguous runs of
//   the rank's token order (a document or a long span about one topic)
//   instead of a random subset. Strided chunks (tokens j, j+K, ...) still
//   see about h% hot tokens each; contiguous chunks see runs: some all hot,
//   some all cold. This is the case where the two memberships differ (the
//   paper's 12.5% strided against 17.1% contiguous of Eq. 1's bound).
// Gates are positive and sum to 1 per token, as the router's renormalised
// top-k probabilities do.
//
// Every draw comes from a splitmix64 stream and integer arithmetic (no
// <random> distributions, whose results differ between standard libraries).
// Thread safety: plain functions.
#ifndef PLATEAU_KERNELS_DISPATCH_ROUTING_PROFILES_H_
#define PLATEAU_KERNELS_DISPATCH_ROUTING_PROFILES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace plateau {

struct RoutingProfile {
  double hot_percent = 0.0;  // h in [0, 100]; 0 is the balanced profile
  int64_t hot_experts = 0;   // g in [1, E] when h > 0 (ignored at h = 0)
  // b: the hot tokens form b contiguous runs (at random places, of sizes
  // differing by at most one; runs may touch); 0: a random subset. >= 0.
  int64_t hot_blocks = 0;

  // "balanced", "50%/4", "100%/1", "50%/4@4".
  std::string Name() const;
};

inline RoutingProfile BalancedRouting() { return {}; }
inline RoutingProfile HotRouting(double hot_percent, int64_t hot_experts) {
  return {hot_percent, hot_experts, 0};
}
inline RoutingProfile HotBlockRouting(double hot_percent, int64_t hot_experts,
                                      int64_t hot_blocks) {
  return {hot_percent, hot_experts, hot_blocks};
}

// The routes of one rank: chosen[t*k + j] (k distinct experts per token) and
// gates[t*k + j].
struct Routes {
  std::vector<int32_t> chosen;
  std::vector<float> gates;
};

// INVALID_ARGUMENT naming the field: routing.hot_percent outside [0, 100],
// routing.hot_experts outside [1, E] with h > 0, routing.hot_blocks < 0,
// model.experts < 1,
// model.top_k outside [1, E], tokens < 0.
absl::Status ValidateRoutingProfile(const RoutingProfile& profile, int64_t experts, int64_t top_k,
                                    int64_t tokens = 0);

// The routes of `tokens` tokens of rank `rank`, from `seed`.
absl::StatusOr<Routes> MakeRoutes(const RoutingProfile& profile, int64_t experts, int64_t top_k,
                                  int64_t tokens, uint64_t seed, int rank);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_ROUTING_PROFILES_H_
