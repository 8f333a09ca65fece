// What a registration's memory handles refer to, checked before any backend touches them: every
// descriptor index (SharedMemory.fd, VmmRange.first_fd and its chunks) within the descriptors
// handed over under its fd_token, every VMM range index within its vmm_ranges, every buffer
// inside its range, and no descriptor claimed twice. The backends then index without checking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "proto/refit.pb.h"

namespace refit {

// `buffer_bytes`: per buffer of request.worker(), from its layout; `fds`: how many descriptors
// the fd_token's delivery holds (0 without a token). INVALID_ARGUMENT naming the buffer or the
// range at fault.
absl::Status CheckMemoryRefs(const v1::RegisterWorkerRequest& request,
                             std::span<const int64_t> buffer_bytes, size_t fds);

// Bytes of a VMM range: the sum of its chunks (CheckMemoryRefs has bounded it).
int64_t VmmRangeBytes(const v1::VmmRange& range);

}  // namespace refit
