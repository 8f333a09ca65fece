#include "daemon/security/authority.h"

#include <catch2/catch.hpp>

namespace refit {
namespace {

Caller Cert(std::vector<std::string> names) {
  Caller c;
  c.authenticated = true;
  c.names = std::move(names);
  c.peer = "ipv4:127.0.0.1:5000";
  return c;
}

Authority Enforcing() {
  TlsConfig tls;
  tls.cert = "node.pem";
  tls.key = "node.key";
  tls.ca = "ca.pem";
  return Authority(tls);
}

TEST_CASE("NodeOf reads refit-node-<digits> only, from verified certificates") {
  CHECK(NodeOf(Cert({"refit-node-3", "refitd"})) == 3);
  CHECK(NodeOf(Cert({"refitd", "refit-node-12"})) == 12);
  CHECK_FALSE(NodeOf(Cert({"refit-node-"})).has_value());
  CHECK_FALSE(NodeOf(Cert({"refit-node-+1"})).has_value());
  CHECK_FALSE(NodeOf(Cert({"refit-node- 1"})).has_value());
  CHECK_FALSE(NodeOf(Cert({"refit-node-1x"})).has_value());
  CHECK_FALSE(NodeOf(Cert({"xrefit-node-1"})).has_value());
  CHECK_FALSE(NodeOf(Cert({"refit-node-1234567890"})).has_value());  // past an int32's digits
  CHECK_FALSE(NodeOf(Cert({"refit-node-00"})).has_value());
  CHECK_FALSE(NodeOf(Cert({"refit-node-01"})).has_value());
  CHECK(NodeOf(Cert({"refit-node-0"})) == 0);
  CHECK(NodeOf(Cert({"refit-node-10"})) == 10);
  // A certificate naming two nodes is no node's (which would it speak for?); the same node
  // twice (CN and SAN) is that node.
  CHECK_FALSE(NodeOf(Cert({"refit-node-1", "refit-node-0", "refitd"})).has_value());
  CHECK(NodeOf(Cert({"refit-node-1", "refit-node-1", "refitd"})) == 1);
  CHECK(NodeOfNames({"refit-operator", "refit-node-7"}) == 7);
  CHECK(NodeOfNames({"refit-operator"}) == -1);
  Caller unverified = Cert({"refit-node-1"});
  unverified.authenticated = false;
  CHECK_FALSE(NodeOf(unverified).has_value());
}

TEST_CASE("Control: operators steer, viewers look, the unix socket only looks") {
  const Authority a = Enforcing();
  CHECK(a.CheckControl(Cert({"refit-operator"}), Access::kOperate, "Refit").ok());
  CHECK(a.CheckControl(Cert({"refit-operator"}), Access::kView, "Status").ok());
  CHECK(a.CheckControl(Cert({"refit-viewer"}), Access::kView, "Status").ok());
  const absl::Status viewer = a.CheckControl(Cert({"refit-viewer"}), Access::kOperate, "Refit");
  CHECK(viewer.code() == absl::StatusCode::kPermissionDenied);
  CHECK(viewer.message().find("refit-viewer") != absl::string_view::npos);
  CHECK(viewer.message().find("--tls-operators") != absl::string_view::npos);
  CHECK(a.CheckControl(Cert({"intruder"}), Access::kView, "Status").code() ==
        absl::StatusCode::kPermissionDenied);
  // Daemons forward their callers' calls.
  CHECK(a.CheckControl(Cert({"refit-node-2"}), Access::kOperate, "Refit").ok());
  Caller local;
  local.unix_socket = true;
  CHECK(a.CheckControl(local, Access::kView, "Status").ok());
  CHECK(a.CheckControl(local, Access::kOperate, "Refit").code() ==
        absl::StatusCode::kPermissionDenied);
  Caller anonymous;
  anonymous.peer = "ipv4:10.0.0.9:1";
  CHECK(a.CheckControl(anonymous, Access::kView, "Status").code() ==
        absl::StatusCode::kPermissionDenied);
}

TEST_CASE("Control: the role lists come from the configuration") {
  TlsConfig tls;
  tls.cert = tls.key = tls.ca = "x";
  tls.operators = {"rl-controller"};
  tls.viewers = {};
  const Authority a(tls);
  CHECK(a.CheckControl(Cert({"rl-controller"}), Access::kOperate, "Refit").ok());
  CHECK(a.CheckControl(Cert({"refit-operator"}), Access::kOperate, "Refit").code() ==
        absl::StatusCode::kPermissionDenied);
  CHECK(a.CheckControl(Cert({"refit-viewer"}), Access::kView, "Status").code() ==
        absl::StatusCode::kPermissionDenied);
}

TEST_CASE("Workers over TCP: only --tls-workers names register; the unix socket is the uid's") {
  const Authority a = Enforcing();
  CHECK(a.CheckWorker(Cert({"refit-worker"})).ok());
  const absl::Status intruder = a.CheckWorker(Cert({"intruder"}));
  CHECK(intruder.code() == absl::StatusCode::kPermissionDenied);
  CHECK(intruder.message().find("--tls-workers") != absl::string_view::npos);
  CHECK(a.CheckWorker(Cert({"refit-viewer"})).code() == absl::StatusCode::kPermissionDenied);
  CHECK(a.CheckWorker(Cert({"refit-operator"})).code() == absl::StatusCode::kPermissionDenied);
  Caller local;
  local.unix_socket = true;
  CHECK(a.CheckWorker(local).ok());
}

TEST_CASE("Join and SyncWorkers: only a node's own certificate speaks for it") {
  const Authority a = Enforcing();
  CHECK(a.CheckNode(Cert({"refit-node-1", "refitd"}), 1, "Join").ok());
  const absl::Status forged = a.CheckNode(Cert({"refit-node-2"}), 1, "Join");
  CHECK(forged.code() == absl::StatusCode::kPermissionDenied);
  CHECK(forged.message().find("node 1") != absl::string_view::npos);
  CHECK(a.CheckNode(Cert({"refit-operator"}), 1, "SyncWorkers").code() ==
        absl::StatusCode::kPermissionDenied);
}

TEST_CASE("Phases and plans: only the coordinator this node joined, at its incarnation") {
  const Authority a = Enforcing();
  const KnownCoordinator joined{0, 777};
  CHECK(a.CheckCoordinator(Cert({"refit-node-0"}), joined, 777, "RunPhase").ok());
  CHECK(a.CheckCoordinator(Cert({"refit-node-2"}), joined, 777, "RunPhase").code() ==
        absl::StatusCode::kPermissionDenied);
  CHECK(a.CheckCoordinator(Cert({"refit-operator"}), joined, 777, "InstallPlan").code() ==
        absl::StatusCode::kPermissionDenied);
  CHECK(a.CheckCoordinator(Cert({"refit-node-0"}), joined, 776, "RunPhase").code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(a.CheckCoordinator(Cert({"refit-node-0"}), KnownCoordinator{}, 777, "RunPhase").code() ==
        absl::StatusCode::kPermissionDenied);
}

TEST_CASE("Without TLS every caller is trusted (listeners are loopback)") {
  const Authority a{TlsConfig{}};
  Caller anonymous;
  CHECK(a.CheckControl(anonymous, Access::kOperate, "Refit").ok());
  CHECK(a.CheckNode(anonymous, 1, "Join").ok());
  CHECK(a.CheckCoordinator(anonymous, KnownCoordinator{}, 0, "RunPhase").ok());
}

}  // namespace
}  // namespace refit
