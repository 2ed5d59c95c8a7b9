// The generated part of docs/FRONTIER.md: the text between
// "<!-- frontier table: begin -->" and "<!-- frontier table: end -->"
// (each on its own line) is the output of FrontierTable.
#ifndef PLATEAU_TOOLS_FRONTIER_FRONTIER_DOC_H_
#define PLATEAU_TOOLS_FRONTIER_FRONTIER_DOC_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace plateau {

inline constexpr char kFrontierBegin[] = "<!-- frontier table: begin -->\n";
inline constexpr char kFrontierEnd[] = "<!-- frontier table: end -->\n";

// The text between the markers; NOT_FOUND when either is missing.
inline absl::StatusOr<std::string> FrontierTableOf(const std::string& doc) {
  const size_t b = doc.find(kFrontierBegin);
  const size_t e = b == std::string::npos ? std::string::npos : doc.find(kFrontierEnd, b);
  if (e == std::string::npos) {
    return absl::NotFoundError(absl::StrCat("expected the markers '", kFrontierBegin, "' and '", kFrontierEnd,
                                            "' on their own lines"));
  }
  const size_t start = b + sizeof(kFrontierBegin) - 1;
  return doc.substr(start, e - start);
}

// The document with the text between the markers replaced by `table`.
inline absl::StatusOr<std::string> ReplaceFrontierTable(const std::string& doc, const std::string& table) {
  const size_t b = doc.find(kFrontierBegin);
  const size_t e = b == std::string::npos ? std::string::npos : doc.find(kFrontierEnd, b);
  if (e == std::string::npos) return FrontierTableOf(doc).status();
  const size_t start = b + sizeof(kFrontierBegin) - 1;
  return absl::StrCat(doc.substr(0, start), table, doc.substr(e));
}

}  // namespace plateau

#endif  // PLATEAU_TOOLS_FRONTIER_FRONTIER_DOC_H_
