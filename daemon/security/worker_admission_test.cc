// The admission rule (who may register) and session keys, without a daemon: each rule's refusal
// and its admission, so that a rule that stopped refusing fails here.
#include "daemon/security/worker_admission.h"

#include <catch2/catch.hpp>
#include <set>

namespace refit {
namespace {

v1::RegisterWorkerRequest Named(const std::string& name) {
  v1::RegisterWorkerRequest r;
  r.mutable_worker()->set_name(name);
  return r;
}

TEST_CASE("a peer's transport: ipv4/ipv6 are the network, the rest is held to the unix rule") {
  CHECK(TransportOfPeer("unix:/tmp/refitd-0.sock") == WorkerTransport::kUnix);
  CHECK(TransportOfPeer("unix:") == WorkerTransport::kUnix);
  CHECK(TransportOfPeer("ipv4:127.0.0.1:4242") == WorkerTransport::kNetwork);
  CHECK(TransportOfPeer("ipv6:[::1]:4242") == WorkerTransport::kNetwork);
  CHECK(TransportOfPeer("") == WorkerTransport::kUnix);
  CHECK(TransportOfPeer("vsock:3:4") == WorkerTransport::kUnix);
}

TEST_CASE("uids: the configured ones, else the daemon's own and root") {
  CHECK(WorkerAdmission({}, 1000).uids() == std::vector<uint32_t>{1000, 0});
  CHECK(WorkerAdmission({}, 0).uids() == std::vector<uint32_t>{0});
  CHECK(WorkerAdmission({1234}, 1000).uids() == std::vector<uint32_t>{1234});
}

TEST_CASE("the unix socket: a delivery is required and its uid must be listed") {
  const WorkerAdmission a({1234, 5678}, 1000);
  const auto r = Named("t0");
  CHECK(a.Admit(r, WorkerTransport::kUnix, true, 1234).ok());
  CHECK(a.Admit(r, WorkerTransport::kUnix, true, 5678).ok());
  const absl::Status other = a.Admit(r, WorkerTransport::kUnix, true, 1000);
  CHECK(absl::IsPermissionDenied(other));
  CHECK(std::string(other.message()).find("uid 1000") != std::string::npos);
  CHECK(std::string(other.message()).find("--worker-uids 1234,5678") != std::string::npos);
  CHECK(std::string(other.message()).find("\"t0\"") != std::string::npos);
  CHECK(absl::IsPermissionDenied(
      a.Admit(r, WorkerTransport::kUnix, true, 0)));  // root is not implied
  const absl::Status none = a.Admit(r, WorkerTransport::kUnix, false, 1234);
  CHECK(absl::IsInvalidArgument(none));
  CHECK(std::string(none.message()).find("handle socket") != std::string::npos);
  // By default: the daemon's own uid and root.
  const WorkerAdmission d({}, 1000);
  CHECK(d.Admit(r, WorkerTransport::kUnix, true, 1000).ok());
  CHECK(d.Admit(r, WorkerTransport::kUnix, true, 0).ok());
  CHECK(absl::IsPermissionDenied(d.Admit(r, WorkerTransport::kUnix, true, 1001)));
}

TEST_CASE("over TCP (--worker-listen) no uid is checked; CUDA IPC still needs a delivery") {
  const WorkerAdmission a({1234}, 1000);
  auto r = Named("e0");
  r.add_memory()->mutable_cuda_vmm();
  CHECK(a.Admit(r, WorkerTransport::kNetwork, false, 0).ok());
  CHECK(a.Admit(r, WorkerTransport::kNetwork, true, 999).ok());
  r.add_memory()->mutable_cuda_ipc()->set_handle(std::string(64, 'x'));
  const absl::Status ipc = a.Admit(r, WorkerTransport::kNetwork, false, 0);
  CHECK(absl::IsInvalidArgument(ipc));
  CHECK(std::string(ipc.message()).find("CUDA IPC") != std::string::npos);
  CHECK(a.Admit(r, WorkerTransport::kNetwork, true, 999).ok());
  // In-process callers (tests) are trusted.
  CHECK(a.Admit(r, WorkerTransport::kInProcess, false, 0).ok());
}

TEST_CASE("session keys: 32 hex digits, fresh each time, compared whole") {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string k = NewSessionKey();
    REQUIRE(k.size() == kSessionKeyChars);
    for (char c : k) CHECK(((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')));
    CHECK(seen.insert(k).second);
  }
  const std::string k = NewSessionKey();
  CHECK(SessionKeyMatches(k, k));
  std::string wrong = k;
  wrong.back() = wrong.back() == '0' ? '1' : '0';
  CHECK_FALSE(SessionKeyMatches(k, wrong));
  wrong = k;
  wrong.front() = wrong.front() == '0' ? '1' : '0';
  CHECK_FALSE(SessionKeyMatches(k, wrong));
  CHECK_FALSE(SessionKeyMatches(k, ""));
  CHECK_FALSE(SessionKeyMatches(k, k.substr(0, 31)));
  CHECK_FALSE(SessionKeyMatches(k, k + "0"));
  CHECK_FALSE(SessionKeyMatches("", ""));  // no key: nothing matches
}

}  // namespace
}  // namespace refit
