#include "daemon/worker/encoded_registration.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/worker/registration_decoder.h"
#include "proto/decoded_size.h"

namespace refit {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using Request = v1::RegisterWorkerRequest;

absl::Status NotARequest() {
  return absl::InvalidArgumentError(
      "register: the request is not a valid RegisterWorkerRequest encoding");
}

std::string Megabytes(int64_t bytes) { return absl::StrFormat("%.1f MB", bytes / 1e6); }

int64_t Occurrences(const DecodedSize& size, int number) {
  auto it = size.fields.find(number);
  return it == size.fields.end() ? 0 : it->second.occurrences;
}

// The field of `type` that takes most of `size`, as "tensors (1000000 entries, 91.0 MB)".
std::string Costliest(const DecodedSize& size, const Descriptor& type) {
  int number = 0;
  DecodedSize::Field most;
  for (const auto& [n, f] : size.fields) {
    if (f.bytes > most.bytes) {
      number = n;
      most = f;
    }
  }
  const FieldDescriptor* field = type.FindFieldByNumber(number);
  return absl::StrCat(field == nullptr ? absl::StrCat("field ", number) : field->name(), " (",
                      most.occurrences, most.occurrences == 1 ? " entry, " : " entries, ",
                      Megabytes(most.bytes), ")");
}

absl::Status TooLarge(int64_t decoded, int64_t encoded, absl::string_view where) {
  return absl::InvalidArgumentError(
      absl::StrCat("register: the request would take ", Megabytes(decoded), " decoded, more than ",
                   kMaxDecodedPerEncoded, " times its ", Megabytes(encoded),
                   " encoding; most of it in ", where));
}

}  // namespace

absl::StatusOr<Request> DecodeRegistrationRequest(std::string encoded,
                                                  const RegistrationLimits& limits) {
  const auto size = static_cast<int64_t>(encoded.size());
  if (size > limits.max_bytes) return CheckCounts(size, 0, 0, 0, limits);
  const int64_t budget = kMaxDecodedPerEncoded * size + kDecodedSlack;

  // Everything but the worker, as the parser would decode it.
  const Descriptor& type = *Request::descriptor();
  const FieldDescriptor* worker_fields[] = {
      type.FindFieldByNumber(Request::kWorkerFieldNumber),
      type.FindFieldByNumber(Request::kWorkerEncodedFieldNumber)};
  const std::optional<DecodedSize> header = EstimateDecodedSize(encoded, type, worker_fields);
  if (!header.has_value()) return NotARequest();
  const int64_t tensors = Occurrences(*header, Request::kTensorsFieldNumber);
  if (auto s = CheckCounts(0, tensors, 0, 0, limits); !s.ok()) return s;
  if (const int64_t n = Occurrences(*header, Request::kMemoryFieldNumber); n > limits.max_buffers)
    return OverRegistrationLimit("memory entries", n, limits.max_buffers,
                                 "max-registration-buffers");
  if (const int64_t n = Occurrences(*header, Request::kVmmRangesFieldNumber);
      n > limits.max_buffers)
    return OverRegistrationLimit("vmm_ranges", n, limits.max_buffers, "max-registration-buffers");
  if (header->bytes > budget) return TooLarge(header->bytes, size, Costliest(*header, type));

  // The rest decoded, the worker kept as its encoding.
  const bool spelled_out = Occurrences(*header, Request::kWorkerFieldNumber) > 0;
  if (spelled_out && Occurrences(*header, Request::kWorkerEncodedFieldNumber) > 0) {
    return absl::InvalidArgumentError(
        "register: the request sets both worker and worker_encoded; set one");
  }
  Request request;
  if (spelled_out) {
    std::string rest, worker;
    if (!SplitOutWorker(encoded, &rest, &worker)) return NotARequest();
    std::string().swap(encoded);
    if (!request.ParseFromString(rest)) return NotARequest();
    request.set_worker_encoded(std::move(worker));
  } else {
    if (!request.ParseFromString(encoded)) return NotARequest();
    std::string().swap(encoded);
  }

  // The worker: its buffers and pieces counted, its largest piece measured, and what of it is
  // decoded as messages (all but the pieces) estimated, before any of it is decoded.
  const std::string& worker = request.worker_encoded();
  const FieldDescriptor* pieces_field =
      v1::Buffer::descriptor()->FindFieldByNumber(v1::Buffer::kPiecesFieldNumber);
  const std::optional<DecodedSize> shell =
      EstimateDecodedSize(worker, *v1::Worker::descriptor(), {&pieces_field, 1});
  const int64_t pieces = CountPieces(worker);
  const int64_t largest = LargestPiece(worker);
  if (!shell.has_value() || pieces < 0 || largest < 0) {
    return absl::InvalidArgumentError("register: the worker's encoding is not a valid Worker");
  }
  if (auto s =
          CheckCounts(0, 0, Occurrences(*shell, v1::Worker::kBuffersFieldNumber), pieces, limits);
      !s.ok()) {
    return s;
  }
  if (largest > kMaxPieceBytes) {
    return absl::InvalidArgumentError(absl::StrCat("register: a piece of the worker is ", largest,
                                                   " bytes encoded, more than ", kMaxPieceBytes));
  }
  if (header->bytes + shell->bytes > budget) {
    return TooLarge(header->bytes + shell->bytes, size,
                    absl::StrCat("the worker's ", Costliest(*shell, *v1::Worker::descriptor())));
  }
  return request;
}

}  // namespace refit
