// Early-return helpers for absl::Status / absl::StatusOr, used across the
// runtime and the control plane.
#ifndef PLATEAU_KERNELS_STATUS_MACROS_H_
#define PLATEAU_KERNELS_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PLATEAU_RETURN_IF_ERROR(expr)        \
  do {                                       \
    ::absl::Status plateau_status_ = (expr); \
    if (!plateau_status_.ok()) return plateau_status_; \
  } while (0)

#define PLATEAU_CONCAT_INNER_(a, b) a##b
#define PLATEAU_CONCAT_(a, b) PLATEAU_CONCAT_INNER_(a, b)

// PLATEAU_ASSIGN_OR_RETURN(auto x, MakeX()); declares x from a StatusOr or
// returns its error.
#define PLATEAU_ASSIGN_OR_RETURN(lhs, expr)                              \
  PLATEAU_ASSIGN_OR_RETURN_IMPL_(PLATEAU_CONCAT_(plateau_or_, __LINE__), \
                                 lhs, expr)
#define PLATEAU_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

#endif  // PLATEAU_KERNELS_STATUS_MACROS_H_
