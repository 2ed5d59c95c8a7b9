// Test helper: a spec whose four schedule settings are all `auto`.
#ifndef PLATEAU_WORKER_AUTO_SPEC_TESTING_H_
#define PLATEAU_WORKER_AUTO_SPEC_TESTING_H_

#include "proto/plateau/v1/job.pb.h"

namespace plateau {

// Clears the fixed values of PipelinedLLEP's c, SCO's host budget and
// OffloadStreamAdamW's bucket, and sets all four `*_auto` fields, so that the
// chooser (kernels/budget/auto_settings.h) picks c, S, beta and the bucket.
inline v1::JobSpec WithAllAuto(v1::JobSpec spec) {
  v1::ScheduleSpec* s = spec.mutable_schedule();
  s->mutable_pipelined_llep()->clear_chunk_tokens();
  s->mutable_pipelined_llep()->set_chunk_tokens_auto(true);
  s->mutable_ring_dtp()->set_strip_auto(true);
  s->mutable_sco()->clear_host_budget_bytes();
  s->mutable_sco()->set_host_budget_auto(true);
  s->mutable_offload_stream_adamw()->clear_bucket_params();
  s->mutable_offload_stream_adamw()->set_bucket_params_auto(true);
  return spec;
}

}  // namespace plateau

#endif  // PLATEAU_WORKER_AUTO_SPEC_TESTING_H_
