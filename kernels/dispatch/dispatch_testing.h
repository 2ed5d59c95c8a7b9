// What the dispatch schedules' tests share (testonly): a global problem (P
// ranks' tokens, routes and dout; global expert weights and gradients), its
// reference in double (checked against central finite differences in
// standard_ep_test), and a runner that drives any ExpertDispatch on P rank
// threads over Gloo loopback and reports its outputs, gradients and
// measured kDispatch peaks.
#ifndef PLATEAU_KERNELS_DISPATCH_DISPATCH_TESTING_H_
#define PLATEAU_KERNELS_DISPATCH_DISPATCH_TESTING_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/dispatch/expert_dispatch.h"
#include "kernels/dispatch/routing_profiles.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/bf16_testing.h"

namespace plateau {

// The tiny model with 8 experts, so that at P = 4 a rank owns E/P = 2 >= k
// and a token's k distinct experts can all live on rank 0.
ModelConfig DispatchTestModel();

// One global problem. Weights are global [E, H, F] (gate, up) and [E, F, H]
// (down); rank p owns experts [p E/P, (p+1) E/P). out, du and the weight
// gradients start from nonzero values: they accumulate.
struct DispatchProblem {
  ModelConfig m;
  int P = 1;
  std::vector<int64_t> n;                      // tokens per rank
  std::vector<std::vector<float>> u;           // [N, H]
  std::vector<std::vector<int32_t>> chosen;    // [N, k]
  std::vector<std::vector<float>> gates;       // [N, k]
  std::vector<std::vector<float>> dout;        // [N, H]
  std::vector<std::vector<float>> out0;        // [N, H]
  std::vector<std::vector<float>> du0;         // [N, H]
  std::vector<float> wg, wu, wd;               // weights
  std::vector<float> gg0, gu0, gd0;            // gradients before Backward
};

// Hand-made routings of the standard EP tests.
enum class Routing {
  kBalanced,       // k distinct experts uniformly at random; N differs per rank
  kSkewed,         // every token chooses experts 0..k-1, all on rank 0
  kLastRankEmpty,  // no token chooses an expert of rank P-1
  kOneToken,       // N = 1 on every rank
};
std::string RoutingName(Routing r);
void PrintTo(Routing r, std::ostream* os);
DispatchProblem MakeDispatchProblem(const ModelConfig& m, int P, Routing routing, uint64_t seed);

// Routes from a routing profile (routing_profiles.h), n[p] tokens on rank p.
DispatchProblem MakeProfileProblem(const ModelConfig& m, const std::vector<int64_t>& n,
                                   const RoutingProfile& profile, uint64_t seed);

// The reference in double: out = out0 + sum_j gate_j * expert_{e_j}(u);
// given dout, du = du0 + d/du, dgates, and gradients = g0 + d/dW of
// <dout, out>.
struct DispatchWant {
  std::vector<std::vector<double>> out, du, dgates;
  std::vector<double> gg, gu, gd;
};
DispatchWant DispatchReference(const DispatchProblem& pr);

// What a run produced.
struct DispatchGot {
  std::vector<std::vector<float>> out, du, dgates;
  std::vector<float> gg, gu, gd;  // global, assembled from the ranks' experts
  // Per rank: the kDispatch peak in Forward (counted from just before it,
  // including whatever the schedule already held) and in Backward, and
  // what is left after Backward.
  std::vector<int64_t> peak_forward, peak_backward, after;
  int64_t peak(int p) const { return std::max(peak_forward[p], peak_backward[p]); }
};

// Makes rank `rank`'s schedule (after its streams and kernels exist).
using DispatchFactory = std::function<absl::StatusOr<std::unique_ptr<ExpertDispatch>>(
    int rank, const ModelConfig& m, Backend& backend, ModelKernels& kernels,
    Communicator& experts, Stream& compute, Stream& comm)>;
// Called on each rank after Forward (and after Backward), for schedule stats.
using DispatchObserver = std::function<void(int rank, ExpertDispatch& dispatch)>;

// A test's wrapper around a schedule: Backward and Release go to the
// wrapped one (inner()); a subclass says what its Forward does instead
// (the step's recompute order, a measurement around it, ...).
class WrappedDispatch : public ExpertDispatch {
 public:
  explicit WrappedDispatch(std::unique_ptr<ExpertDispatch> d) : d_(std::move(d)) {}
  absl::Status Backward(const float* dout, const ExpertWeights& w, float* du, float* dgates,
                        const ExpertGrads& g) override {
    return d_->Backward(dout, w, du, dgates, g);
  }
  void Release() override { d_->Release(); }

 protected:
  ExpertDispatch& inner() { return *d_; }

 private:
  std::unique_ptr<ExpertDispatch> d_;
};

// Forward then Backward on P rank threads. Fails the current test (and
// returns what it has) on an error.
DispatchGot RunDispatch(const DispatchProblem& pr, const DispatchFactory& make,
                        const DispatchObserver& after_forward = nullptr,
                        const DispatchObserver& after_backward = nullptr,
                        int64_t device_bytes = 64 << 20);

// bf16 mixed precision. The problem with every value the schedule holds in
// the working precision (rows, out0, du0, dout, weights, gradients)
// rounded to bf16, so that a bf16 run reads exactly its values; the gates
// stay fp32 (precision.h).
DispatchProblem RoundedToBf16(DispatchProblem pr);
// RunDispatch with bf16 rows, weights and gradients (the schedules' Bf16
// overloads; `make` creates them with kBf16MixedElements): the problem's
// values must be bf16 (RoundedToBf16); out, du and the gradients come back
// as the floats their bf16 values load as, dgates as computed (fp32).
DispatchGot RunDispatchBf16(const DispatchProblem& pr, const DispatchFactory& make,
                            const DispatchObserver& after_forward = nullptr,
                            const DispatchObserver& after_backward = nullptr, int64_t device_bytes = 64 << 20);

// The reference of a bf16 run, in double, rounding to bf16 where the
// schedules store bf16, and each value's bound. Every schedule computes,
// route by route (expert_mlp.h, llep_chunk.h; docs/RUNTIME.md, "bf16 mixed
// precision"): gate = rn(x Wg), up = rn(x Wu), act = rn(silu(gate) up),
// y = rn(act Wd); out = rn(out0 + sum_j g_j y_j) (one fp32 sum per token);
// dgates_j = <dout, y_j> (summed in double, fp32); dy = rn(g dout);
// dact = rn(dy Wd^T); d gate = rn(dact up silu'(gate)), d up =
// rn(dact silu(gate)); dx = rn(rn(d gate Wg^T) + d up Wu^T); du =
// rn(du0 + sum_j dx_j). Each op is fp32 arithmetic on exactly loaded bf16
// inputs within the documented per-op bounds (GEMM: (k + 3) 2^-24 (sum
// |a b| + |c|); SwiGLU: 16 and 32 2^-24 of its terms, cpu_bf16_ops_test),
// rounded once. The reference stores rn of the exact value; the schedule's
// fp32 value lies within the op's bound plus what its inputs may differ by
// (propagated with the ops' derivatives' bounds: |silu'| <= 1.1,
// |silu''| <= 0.5, |silu(g)| <= |g|), so its stored value lies in
// [rn(z - err), rn(z + err)] (StoreBf16): out and du must lie there, which
// is the reference's value itself wherever no rounding boundary is that
// close, and dgates within the propagated bound.
// The expert gradients' sums depend on the schedule (which rank computes
// which routes, K chunks): g0 + the exact sum of the routes' terms (from
// the reference's stored act, dy, d gate, d up), within the propagated
// bound, the fp32 sums' (2^-24 (routes + 3 K P + 8) of the terms'
// magnitudes M = |g0| + sum |terms|) and 2 bf16 roundings of M: the ranks'
// stored partial sums (disjoint: u sum |terms| in all) and the owner's one
// rounding of its fp32 sum of them (Backend::AddRowsBf16 at K = 1, the fp32
// accumulators over K > 1 chunks).
struct DispatchBf16Want {
  std::vector<std::vector<StoredBf16>> out, du;  // [P][N H]
  std::vector<std::vector<double>> dgates, dgates_err;
  std::vector<double> gg, gu, gd, gg_err, gu_err, gd_err;
  // How many stored out / du values may differ from the reference's own
  // (a rounding boundary within their bound).
  int64_t loose = 0;
};
DispatchBf16Want DispatchReferenceBf16(const DispatchProblem& pr, int64_t chunks);
// Every output and gradient of a bf16 run within the reference's bounds;
// prints the worst ratio of each.
void ExpectWithinBf16Reference(const DispatchGot& got, const DispatchBf16Want& want);

// Backward on a fresh schedule, and a second Backward after Forward and
// Backward, are FAILED_PRECONDITION naming Forward, before any collective;
// at P = 1 and 2 with skewed routing (at P = 2 rank 1 is sent nothing).
void ExpectBackwardNeedsForward(const DispatchFactory& make);

// Tolerances for fp32 rounding at these shapes (H = 16, F = 24, k = 2):
// values within 1e-5 and gradients within 1e-4 of the largest magnitude of
// the quantity compared.
inline constexpr double kDispatchValueTol = 1e-5, kDispatchGradTol = 1e-4;

// Every output and gradient of `got` against the reference.
void ExpectMatchesReference(const DispatchGot& got, const DispatchWant& want);
// Every output and gradient, elementwise, to `rel` of b's largest magnitude.
void ExpectNearRuns(const DispatchGot& a, const DispatchGot& b, double rel);
// Bitwise equal outputs and gradients (`what` names the comparison).
void ExpectSameBits(const DispatchGot& a, const DispatchGot& b, const std::string& what);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_DISPATCH_TESTING_H_
