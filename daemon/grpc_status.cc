#include "daemon/grpc_status.h"

#include <string>

#include "proto/refit.pb.h"

namespace refit {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(s.code());
  std::string message(s.message());
  v1::RpcStatus details;
  s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    google::protobuf::Any* any = details.add_details();
    any->set_type_url(std::string(url));
    any->set_value(std::string(payload));
  });
  if (details.details().empty()) return grpc::Status(code, message);
  details.set_code(static_cast<int32_t>(code));
  details.set_message(message);
  return grpc::Status(code, message, details.SerializeAsString());
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  v1::RpcStatus details;
  // Details from a peer that is not refitd may be anything: taken only when they parse.
  if (!s.error_details().empty() && details.ParseFromString(s.error_details())) {
    for (const google::protobuf::Any& any : details.details()) out.SetPayload(any.type_url(), absl::Cord(any.value()));
  }
  return out;
}

}  // namespace refit
