#include "daemon/worker/registration_check.h"

#include <algorithm>
#include <initializer_list>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "daemon/worker/memory_refs.h"
#include "google/protobuf/wire_format_lite.h"
#include "plan/status_macros.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

using google::protobuf::internal::WireFormatLite;

std::string RoleName(v1::Role r) {
  return r == v1::TRAINER ? "trainer" : r == v1::INFERENCE ? "inference" : "?";
}

// The encoding of {worker: {node: node, gpu: gpu}}: appended to a registration's encoding, it
// sets them (a later occurrence of a singular field wins, of a message field merges).
std::string WorkerPlacement(int32_t node, int32_t gpu) {
  std::string worker;
  for (const auto& [field, value] : {std::pair{v1::Worker::kNodeFieldNumber, node},
                                     std::pair{v1::Worker::kGpuFieldNumber, gpu}}) {
    AppendVarint(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_VARINT), &worker);
    // An int32 is encoded as its sign extension to 64 bits.
    AppendVarint(static_cast<uint64_t>(static_cast<int64_t>(value)), &worker);
  }
  std::string out;
  AppendVarint(WireFormatLite::MakeTag(v1::RegisterWorkerRequest::kWorkerFieldNumber,
                                       WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
               &out);
  AppendVarint(worker.size(), &out);
  out += worker;
  return out;
}

// "[8, 4] bf16", and how it is quantized if it is.
std::string Declaration(const v1::TensorSpec& t) {
  std::string out = absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "] ",
                                 t.dtype().empty() ? "(no dtype)" : t.dtype());
  if (t.has_quantization()) {
    const v1::Quantization& q = t.quantization();
    absl::StrAppend(&out, " quantized ", q.format(), " [", absl::StrJoin(q.block(), ", "), "]",
                    q.scale().empty() ? "" : absl::StrCat(" scale \"", q.scale(), "\""));
  }
  return out;
}

bool SameDeclaration(const v1::TensorSpec& a, const v1::TensorSpec& b) {
  if (a.dtype() != b.dtype() || a.shape_size() != b.shape_size() ||
      a.has_quantization() != b.has_quantization()) {
    return false;
  }
  if (!std::equal(a.shape().begin(), a.shape().end(), b.shape().begin())) return false;
  // As the planner compares them: every field of the quantization, as encoded.
  return !a.has_quantization() ||
         a.quantization().SerializeAsString() == b.quantization().SerializeAsString();
}

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
    return absl::InvalidArgumentError(absl::StrCat("register: worker \"", w.name(), "\" has ",
                                                   w.buffers_size(), " buffers but ",
                                                   request.memory_size(), " memory handles"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckedLayout> CheckRegistrationLayout(const SplitRegistration& registration,
                                                      int32_t node, size_t fds,
                                                      std::optional<int32_t> gpu) {
  const v1::RegisterWorkerRequest& request = registration.header();
  const v1::Worker& w = request.worker();
  // The worker's own part of the layout must be well formed before it joins a group.
  absl::StatusOr<Layout> layout = DecodeWorkerLayout(registration, kMaxLayoutPieces);
  if (!layout.ok()) {
    const absl::string_view m = layout.status().message();
    return absl::InvalidArgumentError(
        absl::StartsWith(m, "register: ") ? std::string(m) : absl::StrCat("register: ", m));
  }
  layout->workers[0].node = node;
  if (gpu.has_value()) layout->workers[0].gpu = *gpu;
  if (auto s = ValidateLayout(*layout, RoleName(request.role())); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("register: ", s.message()));
  }
  CheckedLayout out;
  out.buffer_bytes.reserve(layout->buffers.size());
  for (const Buffer& b : layout->buffers) out.buffer_bytes.push_back(b.NumBytes());
  if (auto s = CheckMemoryRefs(request, out.buffer_bytes, fds); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: worker \"", w.name(), "\": ", s.message()));
  }
  out.layout = *std::move(layout);
  return out;
}

absl::StatusOr<CheckedLayout> CheckRegistrationLayout(const v1::RegisterWorkerRequest& request,
                                                      int32_t node, size_t fds,
                                                      std::optional<int32_t> gpu) {
  REFIT_ASSIGN_OR_RETURN(const SplitRegistration split, SplitRegistration::Of(request));
  return CheckRegistrationLayout(split, node, fds, gpu);
}

absl::StatusOr<KeptRegistration> KeepRegistration(const SplitRegistration& registration,
                                                  int32_t node, int32_t gpu) {
  KeptRegistration out;
  out.header = registration.header();  // no pieces: small
  out.header.mutable_worker()->set_node(node);
  out.header.mutable_worker()->set_gpu(gpu);
  // What the coordinator is sent: the registration as one request that spells the worker out
  // (field `worker`), made from its encoding (1x its size), never from a copy as messages (12x).
  std::string rest;
  const bool ok = AppendWithout(registration.header().SerializeAsString(), {},
                                {v1::RegisterWorkerRequest::kWorkerFieldNumber,
                                 v1::RegisterWorkerRequest::kWorkerEncodedFieldNumber,
                                 v1::RegisterWorkerRequest::kMemoryFieldNumber,
                                 v1::RegisterWorkerRequest::kFdTokenFieldNumber,
                                 v1::RegisterWorkerRequest::kVmmRangesFieldNumber},
                                &rest);
  if (!ok) {  // our own encoding of a message: not expected
    return absl::InternalError(absl::StrCat("register: worker \"", out.header.worker().name(),
                                            "\": its registration could not be re-encoded"));
  }
  const absl::string_view worker = registration.worker();
  const std::string placement = WorkerPlacement(node, gpu);
  // Reserved whole: grown by doubling, it would keep up to 2x.
  out.wire.reserve(rest.size() + worker.size() + placement.size() + 16);
  out.wire.append(rest);
  AppendVarint(WireFormatLite::MakeTag(v1::RegisterWorkerRequest::kWorkerFieldNumber,
                                       WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
               &out.wire);
  AppendVarint(worker.size(), &out.wire);
  out.wire.append(worker.data(), worker.size());
  out.wire += placement;
  return out;
}

TensorsByName IndexTensors(const v1::RegisterWorkerRequest& request) {
  TensorsByName out;
  out.reserve(static_cast<size_t>(request.tensors_size()));
  for (const v1::TensorSpec& t : request.tensors()) out.emplace(t.name(), &t);
  return out;
}

absl::Status CheckSameTensors(const v1::RegisterWorkerRequest& request, const TensorsByName& mine,
                              const v1::RegisterWorkerRequest& registered,
                              absl::string_view registered_id) {
  for (const v1::TensorSpec& theirs : registered.tensors()) {
    auto it = mine.find(theirs.name());
    if (it == mine.end() || SameDeclaration(*it->second, theirs)) continue;
    const bool trainers = request.role() == v1::TRAINER;
    return absl::FailedPreconditionError(absl::StrCat(
        "register: worker \"", request.worker().name(), "\" declares tensor \"", theirs.name(),
        "\" as ", Declaration(*it->second), ", but ", trainers ? "trainer" : "inference worker",
        " \"", registered_id, "\", registered earlier, declares it as ", Declaration(theirs),
        ": the ", trainers ? "trainers" : "inference workers",
        " of a group must agree on each tensor's shape, dtype and "
        "quantization (refused so that the group stays usable; to change the model, unregister \"",
        registered_id, "\" first)"));
  }
  return absl::OkStatus();
}

}  // namespace refit
