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
