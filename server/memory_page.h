// The coordinator's memory timeline page on the metrics port:
// GET /jobs/ID/memory[?rank=R] (rank 0 by default) answers the page of
// timeline/svg_page.h for the job's latest timeline of that rank. An
// unknown job, a job without a timeline yet (or with them off) and a rank
// without one are 404 with a page that says which; a malformed path or
// rank is 400 (docs/SERVICE.md "Memory timeline").
//
// The port has no bearer token (like /metrics): the page shows a job's id,
// its live sets' bytes and its plan, nothing of its data.
//
// Thread safety: MemoryPage reads the coordinator (thread-safe); it runs on
// the HTTP server's thread and does not block beyond a store read.
#ifndef PLATEAU_SERVER_MEMORY_PAGE_H_
#define PLATEAU_SERVER_MEMORY_PAGE_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "plateau/v1/job.pb.h"
#include "server/http_server.h"

namespace plateau {

struct MemoryPageRequest {
  std::string job_id;
  int rank = 0;
};

// "/jobs/job-3/memory" + "rank=1" -> {job-3, 1}. NOT_FOUND for another path
// below /jobs/; INVALID_ARGUMENT naming `rank` for a bad rank.
absl::StatusOr<MemoryPageRequest> ParseMemoryPagePath(const std::string& path, const std::string& query);

// The response for a request, given how to read a job's timelines (the
// coordinator's GetMemoryTimeline).
HttpResponse MemoryPage(
    const std::string& path, const std::string& query,
    const std::function<absl::StatusOr<v1::GetMemoryTimelineResponse>(const std::string& job_id)>& timeline);

}  // namespace plateau

#endif  // PLATEAU_SERVER_MEMORY_PAGE_H_
