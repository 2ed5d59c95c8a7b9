// Argument checks shared by every validated entry point (Backend,
// ModelKernels, ...): each returns INVALID_ARGUMENT "<op>: <what>" naming the
// argument and what was expected, or OK.
#ifndef PLATEAU_KERNELS_ARG_CHECKS_H_
#define PLATEAU_KERNELS_ARG_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace plateau {

inline absl::Status ArgError(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

inline absl::Status CheckNonNegative(absl::string_view op, absl::string_view name, int64_t v) {
  if (v < 0) return ArgError(op, absl::StrCat(name, " must be >= 0, got ", v));
  return absl::OkStatus();
}

inline absl::Status CheckPositive(absl::string_view op, absl::string_view name, int64_t v) {
  if (v < 1) return ArgError(op, absl::StrCat(name, " must be >= 1, got ", v));
  return absl::OkStatus();
}

// A pointer may be null only when nothing is read or written through it.
// A row-wise op's shape: rows >= 0, and cols > 0 when there are rows.
inline absl::Status CheckRows(absl::string_view op, int64_t rows, int64_t cols) {
  if (rows < 0) return ArgError(op, absl::StrCat("rows must be >= 0, got ", rows));
  if (cols <= 0 && rows > 0) return ArgError(op, absl::StrCat("cols must be > 0, got ", cols));
  return absl::OkStatus();
}

inline absl::Status CheckNotNull(absl::string_view op, absl::string_view name, const void* p,
                                 int64_t elements = 1) {
  if (elements > 0 && p == nullptr) {
    return ArgError(op, absl::StrCat(name, " is null but ", elements, " elements are to be accessed"));
  }
  return absl::OkStatus();
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_ARG_CHECKS_H_
