// Messages of a method gRPC hands over as bytes (a raw callback method): read and answered here,
// so that the service checks a request's encoding before decoding it, and names what is wrong
// with one it cannot decode (gRPC's own handlers answer UNIMPLEMENTED with no message).
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace refit {

// The request's bytes, in one string. The buffer is emptied: gRPC's copy is freed at once rather
// than when the call ends (it is the call's, const only by the handler's signature).
std::string TakeRequestBytes(const grpc::ByteBuffer* request);

// `bytes` decoded into `out`: INVALID_ARGUMENT "<what>: the request is not a valid <type>
// encoding" otherwise.
absl::Status ParseRequest(absl::string_view what, const std::string& bytes,
                          google::protobuf::Message* out);

// `message` encoded into `response`.
absl::Status SetResponse(const google::protobuf::Message& message, grpc::ByteBuffer* response);

}  // namespace refit
