// The metrics component: what its handles, the RoundLog listener, the metered backend, the
// ToGrpc observer and the cluster view put into the text exposition, and /metrics served over
// HTTP on a free port.
#include "daemon/ops/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <sstream>

#include "daemon/base/grpc_status.h"
#include "daemon/coordinator/round_log.h"
#include "daemon/dataplane/host/host_backend.h"
#include "daemon/ops/metered_backend.h"

namespace refit {
namespace {

// The value of the sample named exactly `series` (name and labels as exposed), or -1.
double Value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

v1::RoundStats Round(const std::string& group, v1::RoundStats::State state, int64_t bytes,
                     double seconds) {
  v1::RoundStats s;
  s.set_group(group);
  s.set_state(state);
  s.set_bytes(bytes);
  s.set_seconds(seconds);
  s.set_prepare_seconds(seconds / 4);
  if (state == v1::RoundStats::COMMITTED) {
    s.set_transfer_seconds(seconds / 2);
    s.set_commit_seconds(seconds / 4);
  }
  return s;
}

class FakeBackend : public DataBackend {
 public:
  std::string name() const override { return "fake"; }
  std::string data_address() const override { return "fake:0"; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory&, int64_t) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<int32_t> GpuIndex(const std::string&) override { return 0; }
  absl::StatusOr<TransferStats> Transfer(const TransferJob& job) override {
    if (job.round_id < 0) {
      ++counts_.aborted;  // as the cuda backend drops its communicator after a failure
      return absl::AbortedError("cancelled");
    }
    ++counts_.built;
    return TransferStats{
        .bytes_sent = 1000, .bytes_received = 3000, .bytes_local = 500, .bytes_nvlink = 1000};
  }
  void Cancel(const std::string&, int64_t, const std::string&) override {}
  CommunicatorCounts Communicators() const override { return counts_; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> AllocateScratch(const Worker&, int64_t) override {
    return absl::UnimplementedError(
        "fake scratch");  // tells the wrapper's forwarding from the default
  }

 private:
  CommunicatorCounts counts_;
};

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  REQUIRE(write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size()));
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;)
    response.append(buf, static_cast<size_t>(n));
  close(fd);
  return response;
}

TEST_CASE("metrics: rounds from the RoundLog, by group and outcome, with histograms") {
  auto metrics = Metrics::Start("");
  REQUIRE(metrics.ok());
  Metrics* m = metrics->get();
  CHECK(m->address().empty());
  RoundLog log;
  log.AddListener([m](const v1::RoundStats& s) { m->RoundEnded(s); });
  log.Publish(Round("policy", v1::RoundStats::PREPARING, 0, 0));  // not an end: not counted
  log.Publish(Round("policy", v1::RoundStats::TRANSFERRING, 0, 0));
  log.Publish(Round("policy", v1::RoundStats::COMMITTED, 4096, 0.2));
  log.Publish(Round("policy", v1::RoundStats::COMMITTED, 1024, 3));
  log.Publish(Round("policy", v1::RoundStats::ABORTED, 0, 0.004));
  log.Publish(Round("other", v1::RoundStats::COMMITTED, 10, 0.01));
  const std::string text = m->Scrape();
  INFO(text);
  CHECK(Value(text, R"(refit_rounds_total{group="policy",outcome="committed"})") == 2);
  CHECK(Value(text, R"(refit_rounds_total{group="policy",outcome="aborted"})") == 1);
  CHECK(Value(text, R"(refit_rounds_total{group="other",outcome="committed"})") == 1);
  CHECK(Value(text, R"(refit_round_bytes_total{group="policy",outcome="committed"})") == 5120);
  CHECK(Value(text, R"(refit_round_duration_seconds_count{group="policy",outcome="committed"})") ==
        2);
  CHECK(Value(text, R"(refit_round_duration_seconds_sum{group="policy",outcome="committed"})") ==
        Approx(3.2));
  CHECK(
      Value(
          text,
          R"(refit_round_duration_seconds_bucket{group="policy",outcome="committed",le="0.25"})") ==
      1);
  CHECK(
      Value(text,
            R"(refit_round_duration_seconds_bucket{group="policy",outcome="committed",le="5"})") ==
      2);
  CHECK(
      Value(
          text,
          R"(refit_round_duration_seconds_bucket{group="policy",outcome="committed",le="+Inf"})") ==
      2);
  CHECK(
      Value(
          text,
          R"(refit_round_duration_seconds_bucket{group="policy",outcome="aborted",le="0.005"})") ==
      1);
  // Phases a round reached: the aborted round only its prepare.
  CHECK(Value(text,
              R"(refit_round_phase_duration_seconds_count{group="policy",phase="prepare"})") == 3);
  CHECK(Value(text,
              R"(refit_round_phase_duration_seconds_count{group="policy",phase="transfer"})") == 2);
  CHECK(Value(text, R"(refit_round_phase_duration_seconds_count{group="policy",phase="commit"})") ==
        2);
  CHECK(Value(text, R"(refit_round_phase_duration_seconds_sum{group="policy",phase="transfer"})") ==
        Approx(1.6));
}

TEST_CASE("metrics: buckets span 1 ms to 120 s") {
  const std::vector<double>& b = DurationBuckets();
  CHECK(b.front() == 0.001);
  CHECK(b.back() == 120);
  CHECK(std::is_sorted(b.begin(), b.end()));
}

TEST_CASE("metrics: the metered backend reports each transfer, bytes by link class") {
  auto metrics = Metrics::Start("");
  REQUIRE(metrics.ok());
  std::unique_ptr<DataBackend> backend =
      MeterBackend(std::make_unique<FakeBackend>(), metrics->get());
  CHECK(backend->name() == "fake");
  // The plan's scratch comes from the inner backend (device memory under cuda), not host memory.
  CHECK(backend->AllocateScratch(Worker{}, 64).status().message() == "fake scratch");
  TransferJob job;
  job.group = "policy";
  REQUIRE(backend->Transfer(job).ok());
  REQUIRE(backend->Transfer(job).ok());
  job.round_id = -1;
  CHECK(backend->Transfer(job).status().code() == absl::StatusCode::kAborted);
  const std::string text = (*metrics)->Scrape();
  INFO(text);
  CHECK(Value(text, R"(refit_transfers_total{group="policy",outcome="ok"})") == 2);
  CHECK(Value(text, R"(refit_transfers_total{group="policy",outcome="failed"})") == 1);
  CHECK(Value(text, R"(refit_transfer_duration_seconds_count{group="policy"})") == 2);
  CHECK(Value(text,
              R"(refit_transfer_bytes_total{direction="sent",group="policy",link="network"})") ==
        2000);
  // Of the 3000 bytes received each time, 1000 came over NVLink (another GPU of the node).
  CHECK(
      Value(text,
            R"(refit_transfer_bytes_total{direction="received",group="policy",link="network"})") ==
      4000);
  CHECK(Value(text,
              R"(refit_transfer_bytes_total{direction="received",group="policy",link="nvlink"})") ==
        2000);
  // NCCL communicators, as the backend counts them (by what grew since the last transfer).
  CHECK(Value(text, R"(refit_nccl_communicators_total{event="built"})") == 2);
  CHECK(Value(text, R"(refit_nccl_communicators_total{event="aborted"})") == 1);
  CHECK(Value(text,
              R"(refit_transfer_bytes_total{direction="copied",group="policy",link="local"})") ==
        1000);
  CHECK(Value(text, R"(refit_transfer_wire_bytes_per_second{group="policy"})") > 0);
}

TEST_CASE("metrics: RPC errors by code (ToGrpc's observer), nodes declared dead") {
  auto metrics = Metrics::Start("");
  REQUIRE(metrics.ok());
  ToGrpc(absl::UnavailableError("x")).error_code();
  ToGrpc(absl::UnavailableError("y")).error_code();
  ToGrpc(absl::NotFoundError("z")).error_code();
  ToGrpc(absl::OkStatus()).error_code();
  (*metrics)->NodesDeclaredDead(2);
  (*metrics)->NodesDeclaredDead(0);
  const std::string text = (*metrics)->Scrape();
  INFO(text);
  CHECK(Value(text, R"(refit_rpc_errors_total{code="UNAVAILABLE"})") == 2);
  CHECK(Value(text, R"(refit_rpc_errors_total{code="NOT_FOUND"})") == 1);
  CHECK(text.find("code=\"OK\"") == std::string::npos);
  CHECK(Value(text, "refit_nodes_declared_dead_total") == 2);
  // Stopped: the observer is gone.
  (*metrics)->Stop();
  ToGrpc(absl::UnavailableError("after")).error_code();
  CHECK(Value((*metrics)->Scrape(), R"(refit_rpc_errors_total{code="UNAVAILABLE"})") == 2);
}

TEST_CASE("metrics: groups, workers and plans read at scrape time; /metrics over HTTP") {
  auto metrics = Metrics::Start("127.0.0.1:0");
  REQUIRE(metrics.ok());
  Metrics* m = metrics->get();
  REQUIRE(m->address().rfind("127.0.0.1:", 0) == 0);
  const int port = std::stoi(m->address().substr(m->address().rfind(':') + 1));
  REQUIRE(port > 0);
  int scrapes = 0;
  m->SetClusterView([&scrapes] {
    ++scrapes;
    ClusterView v;
    GroupView g;
    g.name = "policy";
    g.trainers = 2;
    g.inference = 3;
    g.ready = true;
    g.membership_epoch = 7;
    g.plan_epoch = 7;
    g.planning_time = absl::Milliseconds(250);
    v.coordinator = true;
    v.groups.push_back(g);
    v.plannings = 4;
    v.stale_syncs = 5;
    v.synced_bytes = 12345;
    v.forgotten_nodes = 6;
    v.refused_joins = 9;
    v.data_connections = {{"accepted", 11}, {"evicted", 3}, {"user_refused", 2}};
    return v;
  });
  m->RoundEnded(Round("policy", v1::RoundStats::COMMITTED, 8, 1));
  const std::string response = HttpGet(port, "/metrics");
  INFO(response);
  REQUIRE(response.rfind("HTTP/1.1 200", 0) == 0);
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  CHECK(scrapes == 1);
  CHECK(Value(body, R"(refit_rounds_total{group="policy",outcome="committed"})") == 1);
  CHECK(Value(body, R"(refit_workers{group="policy",role="trainer"})") == 2);
  CHECK(Value(body, R"(refit_workers{group="policy",role="inference"})") == 3);
  CHECK(Value(body, R"(refit_group_ready{group="policy"})") == 1);
  CHECK(Value(body, R"(refit_group_membership_epoch{group="policy"})") == 7);
  CHECK(Value(body, R"(refit_group_plan_epoch{group="policy"})") == 7);
  CHECK(Value(body, R"(refit_group_planning_seconds{group="policy"})") == Approx(0.25));
  CHECK(Value(body, "refit_plannings_total") == 4);
  CHECK(Value(body, R"(refit_membership_events_total{event="stale_sync"})") == 5);
  CHECK(Value(body, "refit_membership_synced_bytes_total") == 12345);
  CHECK(Value(body, R"(refit_membership_events_total{event="node_forgotten"})") == 6);
  CHECK(Value(body, R"(refit_membership_events_total{event="join_refused"})") == 9);
  CHECK(Value(body, R"(refit_data_connections_total{event="accepted"})") == 11);
  CHECK(Value(body, R"(refit_data_connections_total{event="evicted"})") == 3);
  CHECK(Value(body, R"(refit_data_connections_total{event="user_refused"})") == 2);
  m->Stop();  // the callback is never called again
  CHECK(Value(m->Scrape(), "refit_plannings_total") == -1);
  CHECK(scrapes == 1);
}

TEST_CASE("metrics: a node that does not coordinate exports its data connections, no groups") {
  auto metrics = Metrics::Start("");
  REQUIRE(metrics.ok());
  Metrics* m = metrics->get();
  m->SetClusterView([] {
    ClusterView v;
    v.data_connections = {{"accepted", 4}, {"first_byte_timeout", 1}};
    return v;
  });
  const std::string text = m->Scrape();
  INFO(text);
  CHECK(Value(text, R"(refit_data_connections_total{event="accepted"})") == 4);
  CHECK(Value(text, R"(refit_data_connections_total{event="first_byte_timeout"})") == 1);
  CHECK(Value(text, "refit_plannings_total") == -1);
  CHECK(text.find("refit_membership_events_total") == std::string::npos);
}

TEST_CASE("metrics: the host backend counts its data connections' events") {
  auto backend = HostBackend::Start("127.0.0.1:0");
  REQUIRE(backend.ok());
  const auto before = (*backend)->ConnectionEvents();
  auto find = [](const std::vector<std::pair<std::string, int64_t>>& events,
                 const std::string& name) {
    for (const auto& [event, n] : events) {
      if (event == name) return n;
    }
    return int64_t{-1};
  };
  CHECK(find(before, "accepted") == 0);
  CHECK(find(before, "user_refused") == 0);
  CHECK(find(before, "evicted") == 0);
  // One connection made: counted as accepted once the acceptor took it.
  const std::string address = (*backend)->data_address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (find((*backend)->ConnectionEvents(), "accepted") < 1 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(5));
  CHECK(find((*backend)->ConnectionEvents(), "accepted") == 1);
  close(fd);
}

TEST_CASE("metrics: a listen address that is not host:port is refused") {
  CHECK(Metrics::Start("nonsense").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Metrics::Start("127.0.0.1:").status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit
