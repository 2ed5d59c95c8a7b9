// Reading a job spec file (text-format plateau.v1.JobSpec) for plateauctl.
//
// A file that does not parse is INVALID_ARGUMENT naming the file, the line
// and column, and the field in dotted form as the validator names it, with
// what was expected:
//   "job.txtpb:3:11: model.hidden (int64): Expected integer, got: abc"
//   "job.txtpb:7:10: backend (enum plateau.v1.Backend): Unknown enumeration
//    value of "BACKEND_TPU" for field "backend"; expected one of ..."
// protobuf's parser reports the position but not the enclosing messages; the
// field path is recovered by re-reading the tokens up to the error.
//
// Thread safety: free functions without shared state.
#ifndef PLATEAU_CLIENT_SPEC_FILE_H_
#define PLATEAU_CLIENT_SPEC_FILE_H_

#include <istream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

// A spec file larger than this is refused before it is read whole
// (plateauctl submit /dev/zero must not fill memory); real specs are <1 KiB.
inline constexpr size_t kMaxSpecFileBytes = size_t{1} << 20;

// Parses `text`; errors start with "<name>:LINE:COLUMN: FIELD: ".
absl::StatusOr<v1::JobSpec> ParseSpecText(absl::string_view text, const std::string& name);

// Reads and parses the file at `path`, or standard input for "-" (named
// "<stdin>" in errors); errors name the path.
absl::StatusOr<v1::JobSpec> ReadSpecFile(const std::string& path);

// Reads at most kMaxSpecFileBytes from `in` and parses them; errors start
// with `name`.
absl::StatusOr<v1::JobSpec> ReadSpecStream(std::istream& in, const std::string& name);

}  // namespace plateau

#endif  // PLATEAU_CLIENT_SPEC_FILE_H_
