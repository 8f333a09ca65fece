#include "daemon/ops/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <exception>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/base/grpc_status.h"

namespace refit {
namespace {

std::string Outcome(v1::RoundStats::State s) {
  return s == v1::RoundStats::COMMITTED ? "committed" : "aborted";
}

std::string CodeName(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);  // "UNAVAILABLE", ... ("" when unknown)
  return name.empty() ? absl::StrCat("CODE_", static_cast<int>(code)) : name;
}

prometheus::ClientMetric Sample(double value, prometheus::Labels labels, bool counter = false) {
  prometheus::ClientMetric m;
  for (auto& [k, v] : labels) m.label.push_back({k, v});
  if (counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Gauge);
}

prometheus::MetricFamily CounterFamily(std::string name, std::string help) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Counter);
}

}  // namespace

const std::vector<double>& DurationBuckets() {
  static const std::vector<double> buckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                              0.5,   1,      2.5,   5,    10,    30,   60,  120};
  return buckets;
}

// Groups, workers and plans, read through the daemon's callback at every scrape.
class Metrics::ClusterCollector : public prometheus::Collectable {
 public:
  void Set(std::function<ClusterView()> view) {
    absl::MutexLock lock(&mu_);
    view_ = view ? std::make_shared<std::function<ClusterView()>>(std::move(view)) : nullptr;
  }
  // Waits for a scrape that is reading the view, so that the callback is never called after.
  void Clear() {
    absl::MutexLock lock(&mu_);
    view_ = nullptr;
    mu_.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &reading_));
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::shared_ptr<std::function<ClusterView()>> view;
    {
      absl::MutexLock lock(&mu_);
      view = view_;
      if (view == nullptr) return {};
      ++reading_;
    }
    const ClusterView v = (*view)();  // no lock of ours held
    {
      absl::MutexLock lock(&mu_);
      --reading_;
    }
    prometheus::MetricFamily workers = GaugeFamily(
        "refit_workers", "Live workers by model group and role (the coordinator's membership).");
    prometheus::MetricFamily ready = GaugeFamily(
        "refit_group_ready", "1 when the group's current membership epoch has a plan, else 0.");
    prometheus::MetricFamily membership_epoch =
        GaugeFamily("refit_group_membership_epoch",
                    "The group's membership epoch (bumped when its workers change).");
    prometheus::MetricFamily plan_epoch = GaugeFamily(
        "refit_group_plan_epoch", "The membership epoch the group's current plan was made for.");
    prometheus::MetricFamily planning = GaugeFamily(
        "refit_group_planning_seconds", "How long planning the group's current plan took.");
    prometheus::MetricFamily plannings =
        CounterFamily("refit_plannings_total",
                      "Plannings run by the coordinator (one per group and membership epoch).");
    for (const GroupView& g : v.groups) {
      workers.metric.push_back(Sample(g.trainers, {{"group", g.name}, {"role", "trainer"}}));
      workers.metric.push_back(Sample(g.inference, {{"group", g.name}, {"role", "inference"}}));
      ready.metric.push_back(Sample(g.ready ? 1 : 0, {{"group", g.name}}));
      membership_epoch.metric.push_back(
          Sample(static_cast<double>(g.membership_epoch), {{"group", g.name}}));
      plan_epoch.metric.push_back(Sample(static_cast<double>(g.plan_epoch), {{"group", g.name}}));
      planning.metric.push_back(
          Sample(absl::ToDoubleSeconds(g.planning_time), {{"group", g.name}}));
    }
    prometheus::MetricFamily connections = CounterFamily(
        "refit_data_connections_total",
        "This node's data connections by event: accepted, refused (every one inside a frame), "
        "evicted (idle, for a newer one), first_byte_timeout, idle_closed, accept_error, "
        "tls_refused, user_refused (another uid, without TLS), handshake_cut, forged_frame, "
        "stale_frame.");
    for (const auto& [event, n] : v.data_connections) {
      connections.metric.push_back(
          Sample(static_cast<double>(n), {{"event", event}}, /*counter=*/true));
    }
    std::vector<prometheus::MetricFamily> out;
    out.push_back(std::move(connections));
    if (!v.coordinator) return out;
    plannings.metric.push_back(Sample(static_cast<double>(v.plannings), {}, /*counter=*/true));
    prometheus::MetricFamily membership = CounterFamily(
        "refit_membership_events_total",
        "The coordinator's membership events: stale_sync (a worker list older than one applied, "
        "or taken before the node's readmission), rebased_sync (a change to a list other than the "
        "one held: the node sends its whole list), node_forgotten (dead for --forget-dead-after, "
        "or making room), join_refused (over --max-nodes, every node alive).");
    membership.metric.push_back(
        Sample(static_cast<double>(v.stale_syncs), {{"event", "stale_sync"}}, true));
    membership.metric.push_back(
        Sample(static_cast<double>(v.rebased_syncs), {{"event", "rebased_sync"}}, true));
    membership.metric.push_back(
        Sample(static_cast<double>(v.forgotten_nodes), {{"event", "node_forgotten"}}, true));
    membership.metric.push_back(
        Sample(static_cast<double>(v.refused_joins), {{"event", "join_refused"}}, true));
    prometheus::MetricFamily synced = CounterFamily(
        "refit_membership_synced_bytes_total",
        "Bytes of worker registrations the coordinator received in nodes' syncs: a registration "
        "travels once, and a node revived at the same incarnation names its list instead of "
        "sending it again.");
    synced.metric.push_back(Sample(static_cast<double>(v.synced_bytes), {}, /*counter=*/true));
    for (auto* f : {&workers, &ready, &membership_epoch, &plan_epoch, &planning, &plannings,
                    &membership, &synced}) {
      out.push_back(std::move(*f));
    }
    return out;
  }

 private:
  mutable absl::Mutex mu_;
  std::shared_ptr<std::function<ClusterView()>> view_ ABSL_GUARDED_BY(mu_);
  mutable int reading_ ABSL_GUARDED_BY(mu_) = 0;
};

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      cluster_(std::make_shared<ClusterCollector>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  rounds_ = &BuildCounter()
                 .Name("refit_rounds_total")
                 .Help("Rounds ended, by model group and outcome (committed, aborted).")
                 .Register(*registry_);
  round_seconds_ =
      &BuildHistogram()
           .Name("refit_round_duration_seconds")
           .Help("Duration of ended rounds, from PREPARE to the outcome, by group and outcome.")
           .Register(*registry_);
  phase_seconds_ = &BuildHistogram()
                        .Name("refit_round_phase_duration_seconds")
                        .Help(
                            "Duration of each phase (prepare, transfer, commit) an ended round "
                            "reached, by group.")
                        .Register(*registry_);
  round_bytes_ =
      &BuildCounter()
           .Name("refit_round_bytes_total")
           .Help("Bytes the ended rounds moved (RoundStats.bytes), by group and outcome.")
           .Register(*registry_);
  transfers_ =
      &BuildCounter()
           .Name("refit_transfers_total")
           .Help("This node's transfers through its backend, by group and outcome (ok, failed).")
           .Register(*registry_);
  transfer_seconds_ = &BuildHistogram()
                           .Name("refit_transfer_duration_seconds")
                           .Help(
                               "This node's data-plane time per successful transfer (the backend's "
                               "Transfer), by group.")
                           .Register(*registry_);
  wire_rate_ = &BuildGauge()
                    .Name("refit_transfer_wire_bytes_per_second")
                    .Help(
                        "This node's network bytes (sent + received) over its data-plane time, of "
                        "the group's last "
                        "successful transfer that used the network.")
                    .Register(*registry_);
  transfer_bytes_ = &BuildCounter()
                         .Name("refit_transfer_bytes_total")
                         .Help(
                             "Bytes this node's successful transfers moved, by group, link "
                             "(network, nvlink, local) "
                             "and direction (sent, received; nvlink: received from another GPU of "
                             "this node; local: "
                             "copied).")
                         .Register(*registry_);
  nodes_dead_ =
      &BuildCounter()
           .Name("refit_nodes_declared_dead_total")
           .Help("Nodes the coordinator's failure detector declared dead (heartbeats missed).")
           .Register(*registry_)
           .Add({});
  rpc_errors_ = &BuildCounter()
                     .Name("refit_rpc_errors_total")
                     .Help("Failures this daemon's services answered, by gRPC status code.")
                     .Register(*registry_);
  communicators_ =
      &BuildCounter()
           .Name("refit_nccl_communicators_total")
           .Help(
               "NCCL communicators this node brought up (event=built) and aborted (event=aborted); "
               "cuda backend.")
           .Register(*registry_);
  communicators_->Add({{"event", "built"}});
  communicators_->Add({{"event", "aborted"}});
}

void Metrics::Communicators(const DataBackend::CommunicatorCounts& counts) {
  absl::MutexLock lock(&counts_mu_);
  if (counts.built > counted_.built) {
    communicators_->Add({{"event", "built"}})
        .Increment(static_cast<double>(counts.built - counted_.built));
  }
  if (counts.aborted > counted_.aborted) {
    communicators_->Add({{"event", "aborted"}})
        .Increment(static_cast<double>(counts.aborted - counted_.aborted));
  }
  counted_.built = std::max(counted_.built, counts.built);
  counted_.aborted = std::max(counted_.aborted, counts.aborted);
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(const std::string& listen) {
  std::unique_ptr<Metrics> m(new Metrics());
  if (!listen.empty()) {
    const size_t colon = listen.rfind(':');
    if (colon == std::string::npos || colon + 1 == listen.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-listen \"", listen, "\" is not host:port"));
    }
    try {
      // civetweb binds host:port; its own default of "0.0.0.0:port" is what an empty host means.
      m->exposer_ =
          std::make_unique<prometheus::Exposer>(colon == 0 ? listen.substr(1) : listen, 1);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("--metrics-listen ", listen, ": cannot serve /metrics: ", e.what()));
    }
    m->exposer_->RegisterCollectable(m->registry_);
    m->exposer_->RegisterCollectable(m->cluster_);
    const std::vector<int> ports = m->exposer_->GetListeningPorts();
    m->address_ = absl::StrCat(listen.substr(0, colon), ":", ports.empty() ? 0 : ports.front());
  }
  // Keeps the registry (which owns the family) alive for a call still running after Stop().
  m->observer_ = AddRpcErrorObserver(
      [registry = m->registry_, family = m->rpc_errors_](absl::StatusCode code) {
        if (code != absl::StatusCode::kOk) family->Add({{"code", CodeName(code)}}).Increment();
      });
  return m;
}

Metrics::~Metrics() { Stop(); }

void Metrics::Stop() {
  if (observer_ >= 0) {
    RemoveRpcErrorObserver(observer_);
    observer_ = -1;
  }
  exposer_.reset();  // joins civetweb's threads: no scrape runs after this
  cluster_->Clear();
}

std::string Metrics::Scrape() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (auto& f : cluster_->Collect()) families.push_back(std::move(f));
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

void Metrics::RoundEnded(const v1::RoundStats& stats) {
  if (stats.state() != v1::RoundStats::COMMITTED && stats.state() != v1::RoundStats::ABORTED)
    return;
  const prometheus::Labels labels = {{"group", stats.group()}, {"outcome", Outcome(stats.state())}};
  rounds_->Add(labels).Increment();
  round_seconds_->Add(labels, DurationBuckets()).Observe(stats.seconds());
  round_bytes_->Add(labels).Increment(static_cast<double>(std::max<int64_t>(stats.bytes(), 0)));
  const std::pair<const char*, double> phases[] = {{"prepare", stats.prepare_seconds()},
                                                   {"transfer", stats.transfer_seconds()},
                                                   {"commit", stats.commit_seconds()}};
  for (const auto& [phase, seconds] : phases) {
    if (seconds <= 0) continue;  // not reached
    phase_seconds_->Add({{"group", stats.group()}, {"phase", phase}}, DurationBuckets())
        .Observe(seconds);
  }
}

void Metrics::TransferEnded(const Transfer& t) {
  transfers_->Add({{"group", t.group}, {"outcome", t.ok ? "ok" : "failed"}}).Increment();
  if (!t.ok) return;
  const double seconds = absl::ToDoubleSeconds(t.elapsed);
  transfer_seconds_->Add({{"group", t.group}}, DurationBuckets()).Observe(seconds);
  transfer_bytes_->Add({{"group", t.group}, {"link", "network"}, {"direction", "sent"}})
      .Increment(static_cast<double>(t.bytes_sent));
  transfer_bytes_->Add({{"group", t.group}, {"link", "network"}, {"direction", "received"}})
      .Increment(static_cast<double>(t.bytes_received - t.bytes_nvlink));
  transfer_bytes_->Add({{"group", t.group}, {"link", "nvlink"}, {"direction", "received"}})
      .Increment(static_cast<double>(t.bytes_nvlink));
  transfer_bytes_->Add({{"group", t.group}, {"link", "local"}, {"direction", "copied"}})
      .Increment(static_cast<double>(t.bytes_local));
  const int64_t wire = t.bytes_sent + t.bytes_received - t.bytes_nvlink;  // the network's
  if (wire > 0 && seconds > 0)
    wire_rate_->Add({{"group", t.group}}).Set(static_cast<double>(wire) / seconds);
}

void Metrics::NodesDeclaredDead(int n) {
  if (n > 0) nodes_dead_->Increment(n);
}

void Metrics::RpcError(absl::StatusCode code) {
  if (code == absl::StatusCode::kOk) return;
  rpc_errors_->Add({{"code", CodeName(code)}}).Increment();
}

void Metrics::SetClusterView(std::function<ClusterView()> view) { cluster_->Set(std::move(view)); }

}  // namespace refit
