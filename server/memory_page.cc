#include "server/memory_page.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "timeline/svg_page.h"

namespace plateau {
namespace {

constexpr char kHtml[] = "text/html; charset=utf-8";

int HttpStatusOf(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:  // no timeline (yet): nothing at this address
      return 404;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

HttpResponse ErrorPage(const absl::Status& s, const std::string& title) {
  return HttpResponse{HttpStatusOf(s), kHtml, MessagePage(title, s.message())};
}

}  // namespace

absl::StatusOr<MemoryPageRequest> ParseMemoryPagePath(const std::string& path, const std::string& query) {
  const std::vector<std::string> parts = absl::StrSplit(path, '/');  // "", "jobs", ID, "memory"
  if (parts.size() != 4 || parts[1] != "jobs" || parts[2].empty() || parts[3] != "memory") {
    return absl::NotFoundError(absl::StrCat("path: this port serves /jobs/ID/memory below /jobs/, not '",
                                            path.substr(0, 128), "'"));
  }
  MemoryPageRequest r;
  r.job_id = parts[2];
  for (absl::string_view kv : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first != "rank") continue;  // other parameters are ignored, as browsers add their own
    if (!absl::SimpleAtoi(p.second, &r.rank) || r.rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank: expected a rank number >= 0, got '", std::string(p.second).substr(0, 32), "'"));
    }
  }
  return r;
}

HttpResponse MemoryPage(
    const std::string& path, const std::string& query,
    const std::function<absl::StatusOr<v1::GetMemoryTimelineResponse>(const std::string& job_id)>& timeline) {
  absl::StatusOr<MemoryPageRequest> r = ParseMemoryPagePath(path, query);
  if (!r.ok()) return ErrorPage(r.status(), "Not a memory timeline");
  const std::string title = absl::StrCat(r->job_id, " memory timeline");
  absl::StatusOr<v1::GetMemoryTimelineResponse> t = timeline(r->job_id);
  if (!t.ok()) return ErrorPage(t.status(), title);
  absl::StatusOr<std::string> page = MemoryTimelinePage(*t, r->rank);
  if (!page.ok()) return ErrorPage(page.status(), title);
  return HttpResponse{200, kHtml, *std::move(page)};
}

}  // namespace plateau
