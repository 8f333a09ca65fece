#include "daemon/worker/memory_refs.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

namespace refit {
namespace {

// Worker "w" with buffers a, b (64 bytes each): a in shared memory descriptor 1, b in VMM range 0
// (two chunks of 32 bytes, descriptors 1 and 2, 0-based).
v1::RegisterWorkerRequest Request() {
  v1::RegisterWorkerRequest r;
  r.mutable_worker()->set_name("w");
  r.mutable_worker()->add_buffers()->set_name("a");
  r.mutable_worker()->add_buffers()->set_name("b");
  r.add_memory()->mutable_shm()->set_fd(1);
  r.add_memory()->mutable_cuda_vmm()->set_range(0);
  v1::VmmRange* range = r.add_vmm_ranges();
  range->add_chunk_bytes(32);
  range->add_chunk_bytes(32);
  range->set_first_fd(1);
  return r;
}

const std::vector<int64_t> kBytes = {64, 64};

std::string Message(const v1::RegisterWorkerRequest& r, size_t fds) {
  const absl::Status s = CheckMemoryRefs(r, kBytes, fds);
  if (!s.ok()) CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  return std::string(s.message());
}

bool Has(const std::string& s, const std::string& part) {
  INFO(s);
  return s.find(part) != std::string::npos;
}

TEST_CASE("well-formed references pass") {
  CHECK(CheckMemoryRefs(Request(), kBytes, 3).ok());
  CHECK(VmmRangeBytes(Request().vmm_ranges(0)) == 64);
  auto r = Request();
  r.mutable_memory(0)->mutable_shm()->set_fd(0);  // by name: no descriptor
  r.mutable_vmm_ranges(0)->set_first_fd(0);
  CHECK(CheckMemoryRefs(r, kBytes, 2).ok());
}

TEST_CASE("every index out of range names the buffer or the range") {
  CHECK(Has(Message(Request(), 2),
            "VMM range 0 takes descriptors 1 to 2 (0-based), but only 2 were handed over"));
  CHECK(Has(Message(Request(), 0), "none were handed over (fd_token is empty)"));
  auto r = Request();
  r.mutable_memory(0)->mutable_shm()->set_fd(4);
  CHECK(
      Has(Message(r, 3), "buffer \"a\": its shared memory is descriptor 4 (1-based), but only 3"));
  r.mutable_memory(0)->mutable_shm()->set_fd(-1);
  CHECK(Has(Message(r, 3), "descriptor -1"));
  r = Request();
  r.mutable_memory(1)->mutable_cuda_vmm()->set_range(1);
  CHECK(Has(Message(r, 3), "buffer \"b\" lies in VMM range 1, but the registration has 1"));
  r = Request();
  r.mutable_memory(1)->mutable_cuda_vmm()->set_offset(8);
  CHECK(
      Has(Message(r, 3), "buffer \"b\": 64 bytes at offset 8 do not fit VMM range 0 of 64 bytes"));
  r.mutable_memory(1)->mutable_cuda_vmm()->set_offset(-8);
  CHECK(Has(Message(r, 3), "at offset -8"));
  r = Request();
  r.mutable_vmm_ranges(0)->set_first_fd(-1);
  CHECK(Has(Message(r, 3), "VMM range 0 takes descriptors -1"));
}

TEST_CASE("malformed ranges and doubly claimed descriptors are refused") {
  auto r = Request();
  r.mutable_vmm_ranges(0)->clear_chunk_bytes();
  CHECK(Has(Message(r, 3), "VMM range 0 has no chunks"));
  r = Request();
  r.mutable_vmm_ranges(0)->set_chunk_bytes(1, 0);
  CHECK(Has(Message(r, 3), "chunk 1 has 0 bytes"));
  r.mutable_vmm_ranges(0)->set_chunk_bytes(1, INT64_MAX);
  CHECK(Has(Message(r, 3), "chunk 1 has"));
  r = Request();
  r.mutable_vmm_ranges(0)->set_first_fd(0);  // descriptor 0 is the shared memory's
  CHECK(Has(Message(r, 3),
            "descriptor 0 (0-based) is claimed by both VMM range 0 and shared memory"));
  r = Request();
  *r.add_vmm_ranges() = r.vmm_ranges(0);
  CHECK(Has(Message(r, 3), "descriptor 1 is claimed by both VMM range 0 and VMM range 1"));
  // Buffers sharing one object are fine.
  r = Request();
  r.mutable_memory(1)->mutable_shm()->set_fd(1);
  CHECK(CheckMemoryRefs(r, kBytes, 3).ok());
}

}  // namespace
}  // namespace refit
