#include "daemon/base/grpc_status.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "proto/refit.pb.h"

namespace refit {
namespace {

// Observers are added and removed rarely (a daemon's start and end) and called on failures only,
// outside the lock: one removed may still be running a call that began before
// (daemon/ops/metrics.cc's observer keeps what it counts into alive itself).
using Observer = std::function<void(absl::StatusCode)>;
struct Observers {
  absl::Mutex mu;
  int next ABSL_GUARDED_BY(mu) = 0;
  std::map<int, std::shared_ptr<const Observer>> by_id ABSL_GUARDED_BY(mu);
};

Observers& TheObservers() {
  static Observers* o = new Observers();
  return *o;
}

void TellObservers(absl::StatusCode code) {
  Observers& o = TheObservers();
  std::vector<std::shared_ptr<const Observer>> observers;
  {
    absl::MutexLock lock(&o.mu);
    if (o.by_id.empty()) return;
    for (const auto& [id, observe] : o.by_id) observers.push_back(observe);
  }
  for (const auto& observe : observers) (*observe)(code);
}

}  // namespace

int AddRpcErrorObserver(std::function<void(absl::StatusCode)> observer) {
  Observers& o = TheObservers();
  absl::MutexLock lock(&o.mu);
  o.by_id[o.next] = std::make_shared<const Observer>(std::move(observer));
  return o.next++;
}

void RemoveRpcErrorObserver(int id) {
  Observers& o = TheObservers();
  absl::MutexLock lock(&o.mu);
  o.by_id.erase(id);
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  TellObservers(s.code());
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
    for (const google::protobuf::Any& any : details.details())
      out.SetPayload(any.type_url(), absl::Cord(any.value()));
  }
  return out;
}

}  // namespace refit
