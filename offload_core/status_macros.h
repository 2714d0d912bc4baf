// Early-return helpers for absl::Status / absl::StatusOr (abseil does not export its own).
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_STATUS_MACROS_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define CKPT_STATUS_CONCAT_INNER_(a, b) a##b
#define CKPT_STATUS_CONCAT_(a, b) CKPT_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define CKPT_RETURN_IF_ERROR(expr)               \
  do {                                           \
    const ::absl::Status ckpt_status_ = (expr);  \
    if (!ckpt_status_.ok()) return ckpt_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define CKPT_ASSIGN_OR_RETURN(lhs, expr) \
  CKPT_ASSIGN_OR_RETURN_IMPL_(CKPT_STATUS_CONCAT_(ckpt_statusor_, __LINE__), lhs, expr)

#define CKPT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                \
  if (!statusor.ok()) return statusor.status();          \
  lhs = std::move(statusor).value()

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_STATUS_MACROS_H_
