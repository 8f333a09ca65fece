#include "daemon/base/culprit.h"

namespace refit {

absl::Status WithCulprit(absl::Status status, const v1::Culprit& culprit) {
  if (status.ok()) return status;
  status.SetPayload(kCulpritUrl, absl::Cord(culprit.SerializeAsString()));
  return status;
}

absl::Status WithCulpritIfNone(absl::Status status, const v1::Culprit& culprit) {
  if (status.ok() || status.GetPayload(kCulpritUrl).has_value()) return status;
  return WithCulprit(std::move(status), culprit);
}

std::optional<v1::Culprit> CulpritOf(const absl::Status& status) {
  auto payload = status.GetPayload(kCulpritUrl);  // absl::optional in this absl
  if (!payload.has_value()) return std::nullopt;
  v1::Culprit c;
  if (!c.ParseFromString(std::string(*payload))) return std::nullopt;
  return c;
}

v1::Culprit WorkerCulprit(int32_t node, const std::string& worker_id, const std::string& phase) {
  v1::Culprit c;
  c.set_kind(v1::Culprit::WORKER);
  c.set_node(node);
  c.set_worker_id(worker_id);
  c.set_phase(phase);
  return c;
}

v1::Culprit NodeCulprit(int32_t node, const std::string& address, const std::string& phase) {
  v1::Culprit c;
  c.set_kind(v1::Culprit::NODE);
  c.set_node(node);
  c.set_address(address);
  c.set_phase(phase);
  return c;
}

v1::Culprit CoordinatorCulprit(int32_t node, const std::string& phase) {
  v1::Culprit c;
  c.set_kind(v1::Culprit::COORDINATOR);
  c.set_node(node);
  c.set_phase(phase);
  return c;
}

absl::Status Rewrap(const absl::Status& status, absl::StatusCode code, const std::string& message) {
  absl::Status out(code, message);
  status.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace refit
