// Early-return helpers for absl::Status / absl::StatusOr (the spelling of absl's internal
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, which absl does not export).
//
//   LOGITSERVE_RETURN_IF_ERROR(DoThing());              // returns DoThing()'s status unless OK
//   LOGITSERVE_ASSIGN_OR_RETURN(Plan plan, MakePlan());  // declares `plan`, or returns the error
//   LOGITSERVE_ASSIGN_OR_RETURN(existing, MakePlan());   // assigns to an existing variable
//
// The enclosing function returns absl::Status or any absl::StatusOr<U> (a non-OK Status converts
// to either). The expression is evaluated exactly once; the status is returned unchanged (no
// message is added). Not for kernels/: they return error codes, not Status.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LOGITSERVE_RETURN_IF_ERROR(expr)                       \
  do {                                                         \
    ::absl::Status logitserve_return_if_error_status = (expr); \
    if (!logitserve_return_if_error_status.ok()) {             \
      return logitserve_return_if_error_status;                \
    }                                                          \
  } while (false)

#define LOGITSERVE_ASSIGN_OR_RETURN(lhs, expr)                                                    \
  LOGITSERVE_ASSIGN_OR_RETURN_IMPL(LOGITSERVE_STATUS_CONCAT(logitserve_statusor_, __LINE__), lhs, \
                                   expr)

// Implementation details of LOGITSERVE_ASSIGN_OR_RETURN.
#define LOGITSERVE_STATUS_CONCAT_INNER(a, b) a##b
#define LOGITSERVE_STATUS_CONCAT(a, b) LOGITSERVE_STATUS_CONCAT_INNER(a, b)
#define LOGITSERVE_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                     \
  if (!statusor.ok()) return std::move(statusor).status();    \
  lhs = *std::move(statusor)
