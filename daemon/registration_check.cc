#include "daemon/registration_check.h"

#include "absl/strings/str_cat.h"
#include "daemon/memory_refs.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

std::string RoleName(v1::Role r) { return r == v1::TRAINER ? "trainer" : r == v1::INFERENCE ? "inference" : "?"; }

}  // namespace

absl::Status CheckRegistrationFields(const v1::RegisterWorkerRequest& request) {
  const v1::Worker& w = request.worker();
  if (request.group().empty()) return absl::InvalidArgumentError("register: \"group\" is empty");
  if (request.role() != v1::TRAINER && request.role() != v1::INFERENCE) {
    return absl::InvalidArgumentError("register: role must be TRAINER or INFERENCE");
  }
  if (w.name().empty() || w.name().find('/') != std::string::npos) {
    return absl::InvalidArgumentError("register: the worker needs a name without '/'");
  }
  if (request.memory_size() != w.buffers_size()) {
    return absl::InvalidArgumentError(absl::StrCat("register: worker \"", w.name(), "\" has ", w.buffers_size(),
                                                   " buffers but ", request.memory_size(), " memory handles"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckedLayout> CheckRegistrationLayout(const v1::RegisterWorkerRequest& request, int32_t node,
                                                      size_t fds) {
  const v1::Worker& w = request.worker();
  // The worker's own part of the layout must be well formed before it joins a group.
  v1::Layout mine;
  *mine.mutable_tensors() = request.tensors();
  *mine.add_workers() = w;
  mine.mutable_workers(0)->set_node(node);
  auto layout = LayoutFromProto(mine);
  if (!layout.ok()) return absl::InvalidArgumentError(absl::StrCat("register: ", layout.status().message()));
  if (auto s = ValidateLayout(*layout, RoleName(request.role())); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("register: ", s.message()));
  }
  CheckedLayout out;
  out.buffer_bytes.reserve(layout->buffers.size());
  for (const Buffer& b : layout->buffers) out.buffer_bytes.push_back(b.NumBytes());
  if (auto s = CheckMemoryRefs(request, out.buffer_bytes, fds); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("register: worker \"", w.name(), "\": ", s.message()));
  }
  out.layout = *std::move(layout);
  return out;
}

std::string TakePieces(v1::RegisterWorkerRequest* request) {
  // The handles are set aside rather than copied: the request is large.
  google::protobuf::RepeatedPtrField<v1::BufferMemory> memory;
  google::protobuf::RepeatedPtrField<v1::VmmRange> ranges;
  memory.Swap(request->mutable_memory());
  ranges.Swap(request->mutable_vmm_ranges());
  std::string token = std::move(*request->mutable_fd_token());
  request->clear_fd_token();
  std::string wire = request->SerializeAsString();
  memory.Swap(request->mutable_memory());
  ranges.Swap(request->mutable_vmm_ranges());
  request->set_fd_token(std::move(token));
  for (v1::Buffer& b : *request->mutable_worker()->mutable_buffers()) {
    // Swapped out and destroyed: clear_pieces() would keep every Piece allocated for reuse.
    google::protobuf::RepeatedPtrField<v1::Piece>().Swap(b.mutable_pieces());
  }
  return wire;
}

}  // namespace refit
