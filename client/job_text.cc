#include "client/job_text.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "proto/timestamps.h"

namespace plateau {

std::string FailureLine(const v1::Job& job) {
  if (!job.has_failure()) return "";
  const v1::Failure& f = job.failure();
  std::string whose;
  switch (job.state()) {
    case v1::PENDING:
      // Attempt 0 has never failed: a failure here is a restart's.
      if (job.attempt() > 0) whose = absl::StrCat("attempt ", job.attempt() - 1, " failed: ");
      break;
    case v1::RESTARTING:
      whose = absl::StrCat("attempt ", job.attempt(), " failed: ");
      break;
    case v1::SCHEDULED:
    case v1::RUNNING:
      whose = job.failure_held_for().empty()
                  ? absl::StrCat("attempt ", job.attempt(), " failing (its ranks are being stopped): ")
                  : absl::StrCat("attempt ", job.attempt(), " failing, held until ",
                                 absl::StrJoin(job.failure_held_for(), ", "),
                                 " is heard from (whose loss would be the cause): ");
      break;
    default:  // FAILED, and the states no failure stays on
      break;
  }
  std::string line = absl::StrCat("  failure:  ", whose, v1::Failure::Kind_Name(f.kind()));
  if (!f.live_set().empty()) absl::StrAppend(&line, " live_set=", f.live_set());
  if (f.kind() == v1::Failure::RANK_CRASHED || f.kind() == v1::Failure::OUT_OF_MEMORY ||
      f.kind() == v1::Failure::INVALID) {
    absl::StrAppendFormat(&line, " rank=%d exit_code=%d signal=%d", f.rank(), f.exit_code(), f.signal());
  }
  if (f.kind() == v1::Failure::RANK_HUNG) absl::StrAppend(&line, " rank=", f.rank());
  if (!f.worker_id().empty()) absl::StrAppend(&line, " worker=", f.worker_id());
  return line + "\n";
}

absl::Time StepEnded(const v1::JobEvent& event) {
  const google::protobuf::Timestamp& t =
      event.has_job_step() && event.job_step().has_end_time() ? event.job_step().end_time() : event.time();
  return TimeOf(t);
}

}  // namespace plateau
