#include "worker/assignment.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace plateau {

absl::Status CheckAssignment(const v1::Assignment& a) {
  const std::string& id = a.job_id();
  // "job-" and 1 to 19 digits, the first not 0: JobIdOf's spelling.
  bool canonical = id.size() > 4 && id.size() <= 23 && id.rfind("job-", 0) == 0 && id[4] != '0';
  for (size_t i = 4; canonical && i < id.size(); ++i)
    canonical = absl::ascii_isdigit(static_cast<unsigned char>(id[i]));
  if (!canonical) {
    return absl::InvalidArgumentError(
        absl::StrCat("assignment: job_id: expected 'job-N' (N > 0), got '", absl::CHexEscape(id.substr(0, 64)), "'"));
  }
  if (a.attempt() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("assignment: attempt: expected >= 0, got ", a.attempt()));
  }
  const std::string& prefix = a.kv_prefix();
  bool printable = !prefix.empty() && prefix.size() <= 1024;
  for (char c : prefix) printable = printable && absl::ascii_isgraph(static_cast<unsigned char>(c));
  if (!printable) {
    return absl::InvalidArgumentError(
        absl::StrCat("assignment: kv_prefix: expected 1 to 1024 printable characters without spaces, got '",
                     absl::CHexEscape(prefix.substr(0, 64)), "'"));
  }
  const int64_t ranks = a.spec().layout().ranks();
  std::vector<bool> seen(static_cast<size_t>(std::clamp<int64_t>(ranks, 0, int64_t{1} << 20)), false);
  for (int r : a.ranks()) {
    if (r < 0 || r >= static_cast<int64_t>(seen.size()) || seen[r]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "assignment: ranks: expected distinct ranks of 0 to layout.ranks - 1 = ", ranks - 1, ", got ", r));
    }
    seen[r] = true;
  }
  return absl::OkStatus();
}

namespace {

// `path` with its links resolved as far as it exists (the rest as
// written): what an open would reach, given `path` has no "." or ".."
// (a ".." after a part that does not exist yet is only resolved
// lexically, past a link it would cross: refused before this). Empty when
// it cannot be resolved (a loop of links, no permission to look).
std::string Resolved(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  return ec ? std::string() : p.string();
}

// No ".", ".." or empty components ("//"): the path as it will be opened.
// Trailing slashes are allowed.
bool Plain(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (path == "/") return true;
  for (absl::string_view part : absl::StrSplit(absl::string_view(path).substr(1), '/')) {
    if (part.empty() || part == "." || part == "..") return false;
  }
  return true;
}

// Whether `path` is `root` or below it, component by component.
bool Under(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path == root ||
         (path.size() > root.size() && path.compare(0, root.size(), root) == 0 && path[root.size()] == '/');
}

}  // namespace

absl::StatusOr<std::vector<std::string>> AllowedPaths(const std::string& flag_value) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(flag_value, ',', absl::SkipEmpty())) {
    const std::string dir(part);
    if (dir.empty() || dir[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("--allowed_paths: expected absolute directories separated by commas, got '", dir, "'"));
    }
    std::string r = Resolved(dir);
    if (r.empty()) return absl::InvalidArgumentError(absl::StrCat("--allowed_paths: cannot resolve '", dir, "'"));
    // The list travels to the ranks comma-separated.
    if (r.find(',') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--allowed_paths: '", dir, "' resolves to '", r, "', which holds a comma"));
    }
    while (r.size() > 1 && r.back() == '/') r.pop_back();
    out.push_back(std::move(r));
  }
  return out;
}

absl::Status CheckSpecPaths(const v1::JobSpec& spec, const std::vector<std::string>& allowed) {
  if (allowed.empty()) return absl::OkStatus();
  std::vector<std::pair<std::string, std::string>> named;
  if (spec.data().has_text()) named.emplace_back("data.text.path", spec.data().text().path());
  for (int i = 0; i < spec.data().shards().paths_size(); ++i) {
    named.emplace_back(absl::StrCat("data.shards.paths[", i, "]"), spec.data().shards().paths(i));
  }
  if (!spec.checkpoint().directory().empty()) named.emplace_back("checkpoint.directory", spec.checkpoint().directory());
  for (const auto& [field, path] : named) {
    if (path.empty() || path[0] != '/' || !Plain(path)) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, "=", path,
                       ": expected an absolute path without '.', '..' or '//' components (this worker checks "
                       "paths against its --allowed_paths)"));
    }
    const std::string r = Resolved(path);
    if (r.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, "=", path, ": cannot be resolved (a loop of links, or no permission to look)"));
    }
    bool ok = false;
    for (const std::string& root : allowed) ok = ok || Under(r, root);
    if (!ok) {
      return absl::FailedPreconditionError(absl::StrCat(field, "=", path, r == path ? "" : absl::StrCat(" (", r, ")"),
                                                        ": outside this worker's --allowed_paths (",
                                                        absl::StrJoin(allowed, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace plateau
