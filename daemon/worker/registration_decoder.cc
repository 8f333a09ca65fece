#include "daemon/worker/registration_decoder.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/field_mask.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/util/field_mask_util.h"
#include "google/protobuf/wire_format_lite.h"
#include "plan/status_macros.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

CodedInputStream InputOf(absl::string_view bytes) {
  return CodedInputStream(reinterpret_cast<const uint8_t*>(bytes.data()),
                          static_cast<int>(bytes.size()));
}

// Calls `visit(payload)` for each occurrence of length-delimited field `number` of the encoded
// message `bytes`, in order, skipping every other field. False if `bytes` is not a valid encoding
// or `visit` returns false.
template <typename Visit>
bool ForEachField(absl::string_view bytes, int number, Visit&& visit) {
  CodedInputStream in = InputOf(bytes);
  while (true) {
    // At the end, or a tag: ReadTag's 0 also stands for a truncated one.
    if (in.CurrentPosition() == static_cast<int>(bytes.size())) return true;
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return false;
    if (WireFormatLite::GetTagFieldNumber(tag) == number &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length)) return false;
      const int payload = in.CurrentPosition();
      if (!in.Skip(static_cast<int>(length))) return false;
      if (!visit(bytes.substr(payload, length))) return false;
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) return false;
  }
}

absl::Status NotAWorker() {
  return absl::InvalidArgumentError("register: the worker's encoding is not a valid Worker");
}

// An omitted box means all of `whole`; as LayoutFromProto decodes them.
template <typename What>
absl::StatusOr<Box> BoxOf(const v1::Piece& piece, bool tensor_side, const Dims& whole,
                          What&& what) {
  const bool present = tensor_side ? piece.has_tensor_box() : piece.has_buffer_box();
  if (!present) return Box::Whole(whole);
  const v1::Box& b = tensor_side ? piece.tensor_box() : piece.buffer_box();
  auto box = Box::Make({b.origin().data(), static_cast<size_t>(b.origin_size())},
                       {b.shape().data(), static_cast<size_t>(b.shape_size())});
  if (!box.ok()) return Annotate(box.status(), what());
  return box;
}

bool HasRunFields(const v1::Piece& p) {
  return p.repeat() != 0 || p.run_pieces() != 0 || p.tensor_index_step() != 0 ||
         p.tensor_box_step_size() != 0 || p.buffer_box_step_size() != 0;
}

}  // namespace

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

bool AppendWithout(absl::string_view bytes, absl::Span<const int> path,
                   std::initializer_list<int> drop, std::string* out) {
  CodedInputStream in = InputOf(bytes);
  while (true) {
    const int start = in.CurrentPosition();
    if (start == static_cast<int>(bytes.size())) return true;
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return false;  // a truncated tag, or field 0
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

bool SplitOutWorker(absl::string_view registration, std::string* rest, std::string* worker) {
  constexpr int kWorker = v1::RegisterWorkerRequest::kWorkerFieldNumber;
  constexpr int kEncoded = v1::RegisterWorkerRequest::kWorkerEncodedFieldNumber;
  size_t worker_bytes = 0;
  CodedInputStream in = InputOf(registration);
  while (true) {
    const int start = in.CurrentPosition();
    if (start == static_cast<int>(registration.size())) break;
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return false;  // a truncated tag, or field 0
    const int number = WireFormatLite::GetTagFieldNumber(tag);
    if (number == kEncoded) return false;
    if (number == kWorker &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || !in.Skip(static_cast<int>(length))) return false;
      worker_bytes += length;
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) return false;
    rest->append(registration.data() + start, in.CurrentPosition() - start);
  }
  worker->reserve(worker->size() + worker_bytes);
  return ForEachField(registration, kWorker, [&](absl::string_view payload) {
    worker->append(payload.data(), payload.size());
    return true;
  });
}

absl::StatusOr<SplitRegistration> SplitRegistration::Of(const v1::RegisterWorkerRequest& request) {
  SplitRegistration out;
  if (request.has_worker() && !request.worker_encoded().empty()) {
    return absl::InvalidArgumentError(
        "register: the request sets both worker and worker_encoded; set one");
  }
  out.request_bytes_ = static_cast<int64_t>(request.ByteSizeLong());
  if (request.has_worker()) {
    // Already decoded by gRPC (10x its size); encoded once more so that one path reads both.
    out.encoded_ = request.worker().SerializeAsString();
    out.owned_ = true;
  } else {
    out.view_ = request.worker_encoded();
  }
  // Every field but the worker's two, by the descriptor: fields added later come along.
  google::protobuf::FieldMask others;
  const google::protobuf::Descriptor* d = v1::RegisterWorkerRequest::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const int number = d->field(i)->number();
    if (number != v1::RegisterWorkerRequest::kWorkerFieldNumber &&
        number != v1::RegisterWorkerRequest::kWorkerEncodedFieldNumber) {
      others.add_paths(d->field(i)->name());
    }
  }
  google::protobuf::util::FieldMaskUtil::MergeMessageTo(
      request, others, google::protobuf::util::FieldMaskUtil::MergeOptions(), &out.header_);
  // The worker without its pieces: cut out of the encoding, so that none is decoded.
  std::string worker;
  const int path[] = {v1::Worker::kBuffersFieldNumber};
  if (!AppendWithout(out.worker(), path, {v1::Buffer::kPiecesFieldNumber}, &worker) ||
      !out.header_.mutable_worker()->ParseFromString(worker)) {
    return NotAWorker();
  }
  return out;
}

absl::Status ForEachPiece(absl::string_view worker, const PieceVisitor& visit) {
  v1::Piece piece;  // reused: one piece decoded at a time
  absl::Status stopped;
  bool parsed = true;
  int buffer = 0;
  const bool ok = ForEachField(worker, v1::Worker::kBuffersFieldNumber, [&](absl::string_view b) {
    int k = 0;
    const bool buffer_ok =
        ForEachField(b, v1::Buffer::kPiecesFieldNumber, [&](absl::string_view p) {
          if (!piece.ParseFromArray(p.data(), static_cast<int>(p.size()))) {
            parsed = false;
            return false;
          }
          stopped = visit(buffer, k++, piece);
          return stopped.ok();
        });
    ++buffer;
    return buffer_ok;
  });
  if (!stopped.ok()) return stopped;
  if (!ok || !parsed) return NotAWorker();
  return absl::OkStatus();
}

int64_t CountPieces(absl::string_view worker) {
  int64_t pieces = 0;
  const bool ok = ForEachField(worker, v1::Worker::kBuffersFieldNumber, [&](absl::string_view b) {
    return ForEachField(b, v1::Buffer::kPiecesFieldNumber, [&](absl::string_view) {
      ++pieces;
      return true;
    });
  });
  return ok ? pieces : -1;
}

int64_t LargestPiece(absl::string_view worker) {
  int64_t largest = 0;
  const bool ok = ForEachField(worker, v1::Worker::kBuffersFieldNumber, [&](absl::string_view b) {
    return ForEachField(b, v1::Buffer::kPiecesFieldNumber, [&](absl::string_view p) {
      largest = std::max(largest, static_cast<int64_t>(p.size()));
      return true;
    });
  });
  return ok ? largest : -1;
}

absl::StatusOr<Layout> DecodeWorkerLayout(const SplitRegistration& registration,
                                          int64_t max_pieces) {
  const v1::RegisterWorkerRequest& header = registration.header();
  // The tensors, the worker and its buffers (no pieces: small) as the codec decodes them, lent to
  // it rather than copied.
  v1::Layout proto;
  proto.mutable_tensors()->Reserve(header.tensors_size());
  for (const v1::TensorSpec& t : header.tensors()) {
    proto.mutable_tensors()->UnsafeArenaAddAllocated(const_cast<v1::TensorSpec*>(&t));
  }
  proto.mutable_workers()->UnsafeArenaAddAllocated(const_cast<v1::Worker*>(&header.worker()));
  absl::StatusOr<Layout> decoded = LayoutFromProto(proto, max_pieces);
  while (!proto.tensors().empty()) proto.mutable_tensors()->UnsafeArenaReleaseLast();
  proto.mutable_workers()->UnsafeArenaReleaseLast();
  REFIT_RETURN_IF_ERROR(decoded.status());
  Layout& layout = *decoded;
  const v1::Worker& w = header.worker();
  const auto num_tensors = static_cast<int64_t>(layout.tensors.size());
  absl::flat_hash_map<absl::string_view, int32_t> tensor_of;  // names unique: the codec checked
  tensor_of.reserve(layout.tensors.size());
  for (size_t t = 0; t < layout.tensors.size(); ++t)
    tensor_of.emplace(layout.tensors[t].name, static_cast<int32_t>(t));
  // The pieces, as LayoutFromProto decodes a piece that is not part of a run (its messages too).
  REFIT_RETURN_IF_ERROR(ForEachPiece(
      registration.worker(), [&](int buffer, int k, const v1::Piece& p) -> absl::Status {
        // Spelled out only for an error: a worker may list 10^6 pieces.
        auto where = [&] {
          return absl::StrCat("worker \"", w.name(), "\" buffer \"", w.buffers(buffer).name(),
                              "\"");
        };
        int32_t tensor = 0;
        if (p.tensor_index() != 0) {
          if (p.tensor_index() < 1 || p.tensor_index() > num_tensors) {
            return absl::InvalidArgumentError(absl::StrCat(
                where(), " piece ", k, ": tensor_index ", p.tensor_index(),
                " is out of range (1-based; the layout declares ", num_tensors, " tensors)"));
          }
          tensor = p.tensor_index() - 1;
          if (!p.tensor().empty() && p.tensor() != layout.tensors[tensor].name) {
            return absl::InvalidArgumentError(absl::StrCat(
                where(), " piece ", k, ": tensor \"", p.tensor(), "\" and tensor_index ",
                p.tensor_index(), " (\"", layout.tensors[tensor].name, "\") disagree"));
          }
        } else {
          auto it = tensor_of.find(p.tensor());
          if (it == tensor_of.end()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where(), ": a piece names tensor \"", p.tensor(),
                             "\", which the layout does not declare in \"tensors\""));
          }
          tensor = it->second;
        }
        auto what = [&] {
          return absl::StrCat(where(), " piece ", k, " (tensor \"", layout.tensors[tensor].name,
                              "\")");
        };
        if (HasRunFields(p)) {
          return absl::InvalidArgumentError(
              absl::StrCat(what(),
                           ": runs of pieces (repeat, run_pieces, steps) are the compact "
                           "form of plans between daemons; a registration lists its pieces"));
        }
        if (static_cast<int64_t>(layout.pieces.size()) + 1 > max_pieces) {
          return absl::InvalidArgumentError(
              absl::StrCat(where(), ": the layout expands to more than ", max_pieces, " pieces"));
        }
        REFIT_ASSIGN_OR_RETURN(Box tensor_box, BoxOf(p, true, layout.tensors[tensor].shape, [&] {
                                 return absl::StrCat(what(), " tensor_box");
                               }));
        REFIT_ASSIGN_OR_RETURN(Box buffer_box, BoxOf(p, false, layout.buffers[buffer].shape, [&] {
                                 return absl::StrCat(what(), " buffer_box");
                               }));
        layout.AddPiece(tensor, tensor_box, buffer, buffer_box);
        return absl::OkStatus();
      }));
  return decoded;
}

}  // namespace refit
