// libFuzzer target for a worker's registration: arbitrary bytes parsed as the
// RegisterWorkerRequest a local process sends (binary protobuf, as gRPC delivers it) and run
// through exactly the checks refitd applies before any backend touches memory
// (WorkerRegistry::Register): the limits and names (registration_limits.h), the fields, the
// worker's layout decoded and validated, and what its memory handles refer to
// (registration_check.h, memory_refs.h). Any crash, sanitizer report, leak or hang is a bug; so
// is an accepted registration that breaks what the backends then assume without checking.
// Built by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "daemon/worker/memory_refs.h"
#include "daemon/worker/registration_check.h"
#include "daemon/worker/registration_limits.h"
#include "google/protobuf/stubs/logging.h"

namespace {

using namespace refit;

// What MapBuffers indexes without checking (host_backend.cc, cuda_backend.cc).
void CheckAccepted(const v1::RegisterWorkerRequest& r, const CheckedLayout& c, size_t fds,
                   const RegistrationLimits& limits) {
  const v1::Worker& w = r.worker();
  if (c.layout.workers.size() != 1 ||
      c.layout.buffers.size() != static_cast<size_t>(w.buffers_size()) ||
      c.buffer_bytes.size() != c.layout.buffers.size() || r.memory_size() != w.buffers_size() ||
      static_cast<int64_t>(c.layout.pieces.size()) > limits.max_pieces) {
    __builtin_trap();
  }
  for (int b = 0; b < r.memory_size(); ++b) {
    const v1::BufferMemory& m = r.memory(b);
    if (c.buffer_bytes[b] < 0) __builtin_trap();
    if (m.has_shm() && m.shm().fd() != 0 &&
        (m.shm().fd() < 0 || static_cast<size_t>(m.shm().fd()) > fds)) {
      __builtin_trap();
    }
    if (m.has_cuda_vmm()) {
      const v1::CudaVmm& v = m.cuda_vmm();
      if (v.range() < 0 || v.range() >= r.vmm_ranges_size()) __builtin_trap();
      const v1::VmmRange& range = r.vmm_ranges(v.range());
      if (range.first_fd() < 0 ||
          range.first_fd() + range.chunk_bytes_size() > static_cast<int64_t>(fds)) {
        __builtin_trap();
      }
      if (v.offset() < 0 || v.offset() + c.buffer_bytes[b] > VmmRangeBytes(range)) __builtin_trap();
    }
  }
}

// REFIT_FUZZ_VERBOSE=1: say why each input was refused (to check that seeds get deep).
bool Refused(const absl::Status& s) {
  static const bool verbose = std::getenv("REFIT_FUZZ_VERBOSE") != nullptr;
  if (verbose && !s.ok()) std::fprintf(stderr, "refused: %s\n", s.ToString().c_str());
  return !s.ok();
}

}  // namespace

// Protobuf logs every string field that is not UTF-8 (as most inputs are): silenced, it is noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::RegisterWorkerRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  // How many descriptors the handle inbox delivered under the fd_token (none without one): its
  // last character's value mod 16, so that mutations reach both sides of every bound.
  const size_t fds =
      request.fd_token().empty() ? 0 : static_cast<unsigned char>(request.fd_token().back()) % 16;
  // Small limits, so that inputs stay fast and the limits themselves are reached.
  RegistrationLimits limits;
  limits.max_pieces = 2048;
  limits.max_buffers = 64;
  limits.max_tensors = 512;
  if (Refused(CheckRegistration(request, limits))) return 0;
  if (Refused(CheckRegistrationFields(request))) return 0;
  auto checked = CheckRegistrationLayout(request, 3, fds);
  if (Refused(checked.status())) return 0;
  if (std::getenv("REFIT_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "accepted\n");
  CheckAccepted(request, *checked, fds, limits);
  return 0;
}
