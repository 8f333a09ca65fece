// Return-if-error helpers over absl::Status, in the style of tensorstore: context is added as
// the error unwinds, so a message names what failed and where.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace refit {

// Prefixes `context` to a non-OK status's message, keeping its code.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace refit

#define REFIT_CONCAT_INNER_(a, b) a##b
#define REFIT_CONCAT_(a, b) REFIT_CONCAT_INNER_(a, b)

#define REFIT_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status refit_status_ = (expr);         \
    if (!refit_status_.ok()) return refit_status_; \
  } while (0)

#define REFIT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()

#define REFIT_ASSIGN_OR_RETURN(lhs, expr) \
  REFIT_ASSIGN_OR_RETURN_IMPL_(REFIT_CONCAT_(refit_statusor_, __LINE__), lhs, expr)
