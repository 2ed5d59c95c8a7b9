// kernels/memory.h's LiveSet and plateau.v1.LiveSet are one list: the proto
// value is the C++ value + 1 (0 is the proto's "unspecified"). Checked here
// at compile time, so that adding a live set on one side alone does not build.
#ifndef PLATEAU_WORKER_LIVE_SET_PROTO_H_
#define PLATEAU_WORKER_LIVE_SET_PROTO_H_

#include "kernels/memory.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

constexpr v1::LiveSet ToProto(LiveSet set) { return static_cast<v1::LiveSet>(static_cast<int>(set) + 1); }

static_assert(v1::LiveSet_ARRAYSIZE == kNumLiveSets + 1, "plateau.v1.LiveSet and LiveSet differ in size");
static_assert(ToProto(LiveSet::kWeights) == v1::LIVE_SET_WEIGHTS);
static_assert(ToProto(LiveSet::kGrads) == v1::LIVE_SET_GRADS);
static_assert(ToProto(LiveSet::kOptimizer) == v1::LIVE_SET_OPTIMIZER);
static_assert(ToProto(LiveSet::kCheckpoints) == v1::LIVE_SET_CHECKPOINTS);
static_assert(ToProto(LiveSet::kDispatch) == v1::LIVE_SET_DISPATCH);
static_assert(ToProto(LiveSet::kProjection) == v1::LIVE_SET_PROJECTION);
static_assert(ToProto(LiveSet::kActivations) == v1::LIVE_SET_ACTIVATIONS);
static_assert(ToProto(LiveSet::kWorkspace) == v1::LIVE_SET_WORKSPACE);

}  // namespace plateau

#endif  // PLATEAU_WORKER_LIVE_SET_PROTO_H_
