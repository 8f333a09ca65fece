// The culprit travels with the failure: through wrappers, and across gRPC (both directions of
// daemon/base/grpc_status.h), without anyone parsing a message.
#include "daemon/base/culprit.h"

#include <catch2/catch.hpp>

#include "daemon/base/grpc_status.h"

namespace refit {
namespace {

TEST_CASE("culprit: set, kept by wrappers, replaced only on purpose") {
  CHECK(!CulpritOf(absl::AbortedError("x")).has_value());
  CHECK(WithCulprit(absl::OkStatus(), NodeCulprit(1, "a:1", "PREPARE")).ok());
  absl::Status s =
      WithCulprit(absl::DeadlineExceededError("late"), WorkerCulprit(2, "policy/e0", "PREPARE"));
  s = WithCulpritIfNone(
      s, NodeCulprit(2, "10.0.0.2:7070", "PREPARE"));  // the worker stays the culprit
  auto c = CulpritOf(s);
  REQUIRE(c.has_value());
  CHECK(c->kind() == v1::Culprit::WORKER);
  CHECK(c->worker_id() == "policy/e0");
  CHECK(c->node() == 2);
  const absl::Status wrapped = Rewrap(s, absl::StatusCode::kAborted, "round 3 aborted: late");
  CHECK(wrapped.code() == absl::StatusCode::kAborted);
  CHECK(wrapped.message() == "round 3 aborted: late");
  REQUIRE(CulpritOf(wrapped).has_value());
  CHECK(CulpritOf(wrapped)->worker_id() == "policy/e0");
  CHECK(CulpritOf(WithCulprit(s, CoordinatorCulprit(0, "TRANSFER")))->kind() ==
        v1::Culprit::COORDINATOR);
}

TEST_CASE("culprit: crosses gRPC in the status details, as a google.rpc.Status") {
  const absl::Status s = WithCulprit(absl::UnavailableError("node 3 died"),
                                     NodeCulprit(3, "10.0.0.3:7070", "TRANSFER"));
  const grpc::Status wire = ToGrpc(s);
  CHECK(wire.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(wire.error_message() == "node 3 died");
  v1::RpcStatus details;
  REQUIRE(details.ParseFromString(wire.error_details()));
  CHECK(details.code() == static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  REQUIRE(details.details_size() == 1);
  CHECK(details.details(0).type_url() == kCulpritUrl);
  const absl::Status back = FromGrpc(wire);
  CHECK(back.code() == absl::StatusCode::kUnavailable);
  CHECK(back.message() == "node 3 died");
  auto c = CulpritOf(back);
  REQUIRE(c.has_value());
  CHECK(c->kind() == v1::Culprit::NODE);
  CHECK(c->node() == 3);
  CHECK(c->address() == "10.0.0.3:7070");
  CHECK(c->phase() == "TRANSFER");

  // Without payloads: no details at all. Details that are not ours are ignored, not trusted.
  CHECK(ToGrpc(absl::NotFoundError("x")).error_details().empty());
  const absl::Status foreign =
      FromGrpc(grpc::Status(grpc::StatusCode::INTERNAL, "y", "\xff\xff garbage"));
  CHECK(foreign.code() == absl::StatusCode::kInternal);
  CHECK(!CulpritOf(foreign).has_value());
}

}  // namespace
}  // namespace refit
