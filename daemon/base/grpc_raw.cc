#include "daemon/base/grpc_raw.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace refit {

std::string TakeRequestBytes(const grpc::ByteBuffer* request) {
  std::string out;
  if (request == nullptr) return out;
  auto* buffer = const_cast<grpc::ByteBuffer*>(request);
  std::vector<grpc::Slice> slices;
  if (buffer->Dump(&slices).ok()) {
    out.reserve(buffer->Length());
    for (const grpc::Slice& s : slices)
      out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  slices.clear();
  buffer->Clear();
  return out;
}

absl::Status ParseRequest(absl::string_view what, const std::string& bytes,
                          google::protobuf::Message* out) {
  if (out->ParseFromString(bytes)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": the request is not a valid ",
                                                 out->GetDescriptor()->name(), " encoding"));
}

absl::Status SetResponse(const google::protobuf::Message& message, grpc::ByteBuffer* response) {
  std::string bytes;
  if (!message.SerializeToString(&bytes))
    return absl::InternalError(absl::StrCat("cannot encode a ", message.GetDescriptor()->name()));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer out(&slice, 1);
  response->Swap(&out);
  return absl::OkStatus();
}

}  // namespace refit
