// The contexts a time-limited throughput run climbs (composed_bench --mfu_s,
// issue 17's MFU target): from a short context towards the longest one that
// fits the device cap, one step at each, every next context the longest
// whose step is predicted to end in the time left.
//
// Why a ladder and not one step at the longest context: the longest context
// of one H200 is ~1M tokens, ~27 PFLOP a step at L = 4, H = 1024 (about
// 70 s at 40% MFU, 4x that at 10%), and the speed is what is measured. Each
// rung's measured rate predicts the next rung's time; a rung does at most
// `growth` times the last one's FLOPs (4: a context twice as long where
// attention dominates), so a rate that falls with the context cannot
// overrun the time left by more than that factor's misjudgement, and the
// whole climb costs about 1 / (1 - 1/growth) of its last step.
//
// Pure functions; thread-safe.
#ifndef PLATEAU_BENCH_CONTEXT_LADDER_H_
#define PLATEAU_BENCH_CONTEXT_LADDER_H_

#include <cstdint>
#include <functional>

namespace plateau {
namespace bench {

struct LadderLimits {
  int64_t n_max = 0;    // the longest context that fits (any value >= 1)
  int64_t quantum = 1;  // contexts below n_max are multiples of it (> 0)
  double growth = 4;    // the most FLOPs a rung does over the last rung's (> 1)
};

// Model FLOPs of one step at a context; must not fall as the context grows.
using FlopsAt = std::function<double(int64_t seq_len)>;

// The first rung: `start` rounded down to a multiple of the quantum (at
// least one quantum), and never past n_max.
int64_t FirstContext(const LadderLimits& limits, int64_t start);

// The rung after one at `last` tokens whose step ran at `flops_per_s` model
// FLOP/s, with `left_s` seconds left and `overhead_s` a rung costs besides
// its step (creating it): the longest context N in (last, n_max], a
// multiple of the quantum or n_max itself, with flops(N) <= growth *
// flops(last) and overhead_s + flops(N) / flops_per_s <= left_s. 0 when
// there is none (last is n_max, or no longer context fits the time).
int64_t NextContext(const LadderLimits& limits, int64_t last, double flops_per_s, double left_s,
                    double overhead_s, const FlopsAt& flops);

}  // namespace bench
}  // namespace plateau

#endif  // PLATEAU_BENCH_CONTEXT_LADDER_H_
