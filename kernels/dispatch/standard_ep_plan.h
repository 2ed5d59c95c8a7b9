// Standard EP's dispatch live set, planned without a backend: the peak
// bytes of one layer's Forward and Backward for given routes, and the most
// rows a rank can be sent. The budget links only this; standard_ep.cc
// allocates exactly the buffers PeakBytes counts.
#ifndef PLATEAU_KERNELS_DISPATCH_STANDARD_EP_PLAN_H_
#define PLATEAU_KERNELS_DISPATCH_STANDARD_EP_PLAN_H_

#include <cstdint>

#include "kernels/model/config.h"
#include "kernels/model/precision.h"

namespace plateau {

// Peak bytes of the kDispatch live set over Forward and Backward of one
// layer in which this rank sends `sent_routes` routes (N*k) and receives
// `received_rows` rows (Backward holds the most). Rows in the working
// precision, the gates in fp32; standard_ep.cc allocates with the default
// (its kernels compute fp32), the budget passes the step's precision.
int64_t StandardEpPeakBytes(const ModelConfig& model, int64_t sent_routes, int64_t received_rows,
                            const ElementBytes& e = kFp32Elements);

// The most rows one rank can receive: every token of every source rank
// sends it all the routes it can, min(k, E/P) (a token's k experts are
// distinct, so at most E/P of them live on one rank).
int64_t StandardEpWorstCaseReceivedRows(const ModelConfig& model, int64_t ranks,
                                        int64_t tokens_per_rank);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_STANDARD_EP_PLAN_H_
