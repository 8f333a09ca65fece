#include "daemon/registration_check.h"

#include <algorithm>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "daemon/memory_refs.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

using google::protobuf::internal::WireFormatLite;

std::string RoleName(v1::Role r) {
  return r == v1::TRAINER ? "trainer" : r == v1::INFERENCE ? "inference" : "?";
}

// `request`'s tensors and worker lent to a v1::Layout for as long as this lives, not copied (the
// decoder only reads them); taken back before the layout goes, so that it never frees them.
class BorrowedLayout {
 public:
  explicit BorrowedLayout(const v1::RegisterWorkerRequest& request) {
    layout_.mutable_tensors()->Reserve(request.tensors_size());
    for (const v1::TensorSpec& t : request.tensors()) {
      layout_.mutable_tensors()->UnsafeArenaAddAllocated(const_cast<v1::TensorSpec*>(&t));
    }
    layout_.mutable_workers()->UnsafeArenaAddAllocated(const_cast<v1::Worker*>(&request.worker()));
  }
  ~BorrowedLayout() {
    while (!layout_.tensors().empty()) layout_.mutable_tensors()->UnsafeArenaReleaseLast();
    while (!layout_.workers().empty()) layout_.mutable_workers()->UnsafeArenaReleaseLast();
  }
  BorrowedLayout(const BorrowedLayout&) = delete;
  BorrowedLayout& operator=(const BorrowedLayout&) = delete;
  const v1::Layout& get() const { return layout_; }

 private:
  v1::Layout layout_;
};

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Appends to `out` the encoded message `bytes` without the fields `drop` at the end of `path`: a
// field numbered path[0] is rewritten with the rest of the path applied to its payload (a
// message), every other field is copied as it is. False if `bytes` is not a valid encoding.
bool AppendWithout(absl::string_view bytes, absl::Span<const int> path,
                   std::initializer_list<int> drop, std::string* out) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  while (true) {
    const int start = in.CurrentPosition();
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return in.CurrentPosition() == static_cast<int>(bytes.size());
    const int number = WireFormatLite::GetTagFieldNumber(tag);
    if (!path.empty() && number == path[0] &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      const int tag_end = in.CurrentPosition();
      uint32_t length = 0;
      if (!in.ReadVarint32(&length)) return false;
      const int payload = in.CurrentPosition();
      if (!in.Skip(static_cast<int>(length))) return false;
      std::string inner;
      if (!AppendWithout(bytes.substr(payload, length), path.subspan(1), drop, &inner)) {
        return false;
      }
      out->append(bytes.data() + start, tag_end - start);
      AppendVarint(inner.size(), out);
      out->append(inner);
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) return false;
    const bool dropped = path.empty() && std::find(drop.begin(), drop.end(), number) != drop.end();
    if (!dropped) out->append(bytes.data() + start, in.CurrentPosition() - start);
  }
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

absl::StatusOr<CheckedLayout> CheckRegistrationLayout(const v1::RegisterWorkerRequest& request,
                                                      int32_t node, size_t fds,
                                                      std::optional<int32_t> gpu) {
  const v1::Worker& w = request.worker();
  // The worker's own part of the layout must be well formed before it joins a group.
  absl::StatusOr<Layout> layout = [&] {
    const BorrowedLayout mine(request);
    return LayoutFromProto(mine.get());
  }();
  if (!layout.ok())
    return absl::InvalidArgumentError(absl::StrCat("register: ", layout.status().message()));
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

absl::StatusOr<KeptRegistration> KeepRegistration(const v1::RegisterWorkerRequest& request,
                                                  int32_t node, int32_t gpu) {
  // Both made from one encoding of `request` (1x its size), never from a copy as messages (12x).
  const std::string whole = request.SerializeAsString();
  KeptRegistration out;
  out.wire.reserve(whole.size() + 32);  // appended to: grown by doubling, it would keep up to 2x
  std::string header;
  const int path[] = {v1::RegisterWorkerRequest::kWorkerFieldNumber,
                      v1::Worker::kBuffersFieldNumber};
  const bool ok = AppendWithout(whole, path, {v1::Buffer::kPiecesFieldNumber}, &header) &&
                  out.header.ParseFromString(header) &&
                  AppendWithout(whole, {},
                                {v1::RegisterWorkerRequest::kMemoryFieldNumber,
                                 v1::RegisterWorkerRequest::kFdTokenFieldNumber,
                                 v1::RegisterWorkerRequest::kVmmRangesFieldNumber},
                                &out.wire);
  if (!ok) {  // our own encoding of a message that parsed: not expected
    return absl::InternalError(absl::StrCat("register: worker \"", request.worker().name(),
                                            "\": its registration could not be re-encoded"));
  }
  out.header.mutable_worker()->set_node(node);
  out.header.mutable_worker()->set_gpu(gpu);
  out.wire += WorkerPlacement(node, gpu);
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
