#include "bench/context_ladder.h"

#include <algorithm>

namespace plateau {
namespace bench {

int64_t FirstContext(const LadderLimits& limits, int64_t start) {
  const int64_t rounded = std::max(start / limits.quantum, int64_t{1}) * limits.quantum;
  return std::min(rounded, limits.n_max);
}

int64_t NextContext(const LadderLimits& limits, int64_t last, double flops_per_s, double left_s,
                    double overhead_s, const FlopsAt& flops) {
  if (last >= limits.n_max || !(flops_per_s > 0)) return 0;
  const double most = limits.growth * flops(last);
  auto fits = [&](int64_t n) {
    const double f = flops(n);
    return f <= most && overhead_s + f / flops_per_s <= left_s;
  };
  if (fits(limits.n_max)) return limits.n_max;
  // The candidates below n_max: multiples of the quantum in (last, n_max).
  // fits() holds on a prefix of them (flops does not fall), so bisect for
  // the last one that fits.
  int64_t lo = last / limits.quantum + 1;            // the first candidate's multiple
  int64_t hi = (limits.n_max - 1) / limits.quantum;  // the last candidate's
  if (lo > hi || !fits(lo * limits.quantum)) return 0;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid * limits.quantum)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo * limits.quantum;
}

}  // namespace bench
}  // namespace plateau
