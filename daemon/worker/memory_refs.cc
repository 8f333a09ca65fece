#include "daemon/worker/memory_refs.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

constexpr int64_t kMaxRangeBytes = int64_t{1} << 50;  // far beyond any GPU, far from overflow

std::string Descriptors(size_t fds) {
  return fds == 0 ? "none were handed over (fd_token is empty)"
                  : absl::StrCat("only ", fds, " were handed over under its fd_token");
}

}  // namespace

int64_t VmmRangeBytes(const v1::VmmRange& range) {
  int64_t total = 0;
  for (int64_t c : range.chunk_bytes()) total += c;
  return total;
}

absl::Status CheckMemoryRefs(const v1::RegisterWorkerRequest& request,
                             std::span<const int64_t> buffer_bytes, size_t fds) {
  // Who claims each descriptor: -1 nobody, -2 shared memory (any number of buffers may share an
  // object), r >= 0 VMM range r.
  std::vector<int> claimed(fds, -1);
  auto claim_name = [](int who) {
    return who == -2 ? std::string("shared memory") : absl::StrCat("VMM range ", who);
  };
  const int ranges = request.vmm_ranges_size();
  std::vector<int64_t> range_bytes(ranges, 0);
  for (int r = 0; r < ranges; ++r) {
    const v1::VmmRange& range = request.vmm_ranges(r);
    const std::string what = absl::StrCat("VMM range ", r);
    if (range.chunk_bytes_size() == 0)
      return absl::InvalidArgumentError(absl::StrCat(what, " has no chunks"));
    int64_t total = 0;
    for (int c = 0; c < range.chunk_bytes_size(); ++c) {
      const int64_t b = range.chunk_bytes(c);
      if (b <= 0 || b > kMaxRangeBytes - total) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": chunk ", c, " has ", b, " bytes"));
      }
      total += b;
    }
    range_bytes[r] = total;
    const int64_t first = range.first_fd();
    if (first < 0 || first + range.chunk_bytes_size() > static_cast<int64_t>(fds)) {
      return absl::InvalidArgumentError(absl::StrCat(what, " takes descriptors ", first, " to ",
                                                     first + range.chunk_bytes_size() - 1,
                                                     " (0-based), but ", Descriptors(fds)));
    }
    for (int c = 0; c < range.chunk_bytes_size(); ++c) {
      int& owner = claimed[static_cast<size_t>(first + c)];
      if (owner != -1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "descriptor ", first + c, " is claimed by both ", claim_name(owner), " and ", what));
      }
      owner = r;
    }
  }
  const v1::Worker& w = request.worker();
  for (int b = 0; b < request.memory_size() && b < w.buffers_size(); ++b) {
    const v1::BufferMemory& m = request.memory(b);
    const std::string what = absl::StrCat("buffer \"", w.buffers(b).name(), "\"");
    const int64_t bytes = buffer_bytes[b];
    if (m.has_shm() && m.shm().fd() != 0) {
      const int32_t fd = m.shm().fd();
      if (fd < 0 || static_cast<size_t>(fd) > fds) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": its shared memory is descriptor ",
                                                       fd, " (1-based), but ", Descriptors(fds)));
      }
      int& owner = claimed[static_cast<size_t>(fd - 1)];
      if (owner >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": descriptor ", fd - 1,
                                                       " (0-based) is claimed by both ",
                                                       claim_name(owner), " and shared memory"));
      }
      owner = -2;
    }
    if (m.has_cuda_vmm()) {
      const v1::CudaVmm& vmm = m.cuda_vmm();
      if (vmm.range() < 0 || vmm.range() >= ranges) {
        return absl::InvalidArgumentError(absl::StrCat(what, " lies in VMM range ", vmm.range(),
                                                       ", but the registration has ", ranges,
                                                       " (vmm_ranges)"));
      }
      if (vmm.offset() < 0 || vmm.offset() > range_bytes[vmm.range()] - bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": ", bytes, " bytes at offset ", vmm.offset(), " do not fit VMM range ",
            vmm.range(), " of ", range_bytes[vmm.range()], " bytes"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace refit
