#include "tests/bench/registration_memory.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/worker/worker_client.h"
#include "proto/layout_codec.h"

extern char** environ;

namespace refit {
namespace {

struct Rss {
  int64_t rss = 0, anon = 0, hwm = 0;
};

Rss ReadRss(pid_t pid) {
  Rss r;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string key;
  int64_t kib = 0;
  while (status >> key) {
    if (key == "VmRSS:" && status >> kib) r.rss = kib * 1024;
    if (key == "RssAnon:" && status >> kib) r.anon = kib * 1024;
    if (key == "VmHWM:" && status >> kib) r.hwm = kib * 1024;
  }
  return r;
}

// A refitd process, stopped (SIGTERM, waited for) when this goes.
class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const std::string& binary,
                                                       const std::string& tag,
                                                       std::vector<std::string> flags) {
    auto d = std::unique_ptr<Daemon>(new Daemon);
    const std::string base = absl::StrCat("/tmp/refit-regmem-", getpid(), "-", tag);
    d->socket_ = base + ".sock";
    d->addr_file_ = base + ".addr";
    unlink(d->addr_file_.c_str());
    std::vector<std::string> args = {binary,        "--worker-socket", d->socket_, "--address-file",
                                     d->addr_file_, "--log-level",     "warn"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&d->pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
      return absl::InternalError(absl::StrCat("cannot start ", binary));
    }
    for (int i = 0; i < 300 && d->address_.empty(); ++i) {
      std::ifstream(d->addr_file_) >> d->address_;
      if (d->address_.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (d->address_.empty())
      return absl::DeadlineExceededError(absl::StrCat("refitd ", tag, " did not start"));
    return d;
  }
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    unlink(addr_file_.c_str());
  }
  pid_t pid() const { return pid_; }
  const std::string& address() const { return address_; }
  std::string worker_target() const { return "unix:" + socket_; }

 private:
  Daemon() = default;
  pid_t pid_ = -1;
  std::string socket_, addr_file_, address_;
};

void Settle(double seconds) { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); }

}  // namespace

Layout RegistrationLayout(const RegistrationMemoryOptions& o, const std::string& worker_name) {
  Layout l;
  const int64_t rows = o.rows_per_tensor;
  const int64_t tensors = (o.pieces + rows - 1) / rows;
  const int32_t worker = l.AddWorker(worker_name, 0, 0);
  l.pieces.reserve(static_cast<size_t>(o.pieces));
  int64_t left = o.pieces;
  for (int64_t t = 0; t < tensors; ++t) {
    const int64_t n = std::min(rows, left);
    left -= n;
    const int32_t tensor =
        l.AddTensor(absl::StrCat("model.layers.", t, ".weight"), Dims{n, 4}, DType::kF32);
    const int32_t buffer = l.AddBuffer(worker, absl::StrCat("flat.", t), DType::kF32, Dims{n * 4});
    for (int64_t r = 0; r < n; ++r) {
      l.AddPiece(tensor, Box::FromDims(Dims{r, 0}, Dims{1, 4}), buffer,
                 Box::FromDims(Dims{r * 4}, Dims{4}));
    }
  }
  return l;
}

absl::StatusOr<RegistrationMemory> MeasureRegistration(const RegistrationMemoryOptions& o) {
  RegistrationMemory out;
  out.workers = o.workers;
  std::vector<Layout> layouts;
  for (int64_t i = 0; i < o.workers; ++i)
    layouts.push_back(RegistrationLayout(o, absl::StrCat("regmem-", i)));
  const Layout& layout = layouts.front();
  out.pieces = static_cast<int64_t>(layout.pieces.size());
  out.tensors = static_cast<int64_t>(layout.tensors.size());
  out.buffers = static_cast<int64_t>(layout.buffers.size());
  {
    // What the worker library sends (client/worker/worker_client.cc): the layout's tensors and its
    // one worker, one memory handle per buffer (a shared-memory descriptor and offset), a token.
    const v1::Layout proto = LayoutToProto(layout);
    v1::RegisterWorkerRequest r;
    r.set_group("regmem");
    r.set_role(v1::TRAINER);
    *r.mutable_tensors() = proto.tensors();
    *r.mutable_worker() = proto.workers(0);
    int64_t offset = 0;
    for (const Buffer& b : layout.buffers) {
      v1::SharedMemory* shm = r.add_memory()->mutable_shm();
      shm->set_fd(1);
      shm->set_offset(offset);
      offset += (b.NumBytes() + 255) / 256 * 256;
    }
    for (auto& m : *r.mutable_memory()) m.mutable_shm()->set_size(offset);
    r.set_fd_token(std::string(32, 'a'));
    out.wire_bytes = static_cast<int64_t>(r.ByteSizeLong());
  }
  const std::string limit = absl::StrCat(std::max<int64_t>(out.pieces, 1 << 20));
  const std::vector<std::string> limits = {
      "--max-registration-pieces", limit, "--max-registration-buffers", limit,
      "--max-registration-tensors", limit, "--max-rpc-bytes", absl::StrCat((int64_t{1} << 31) - 1),
      // Patient, so that a loaded machine (2 shared cores) slows
      // the registration down but does not fail it.
      "--peer-timeout", "120", "--heartbeat", "1", "--heartbeats-missed", "60"};
  std::vector<std::string> flags = {"--node", "0"};
  flags.insert(flags.end(), limits.begin(), limits.end());
  auto coordinator = Daemon::Start(o.refitd, "coordinator", flags);
  if (!coordinator.ok()) return coordinator.status();
  flags = {"--node", "1", "--coordinator", (*coordinator)->address()};
  flags.insert(flags.end(), limits.begin(), limits.end());
  auto node = Daemon::Start(o.refitd, "node", flags);
  if (!node.ok()) return node.status();

  // `peak`: VmHWM too (it never comes down: read once registered, it is the peak while
  // registering).
  auto read = [&](int64_t DaemonMemory::*rss, int64_t DaemonMemory::*anon, bool peak = false) {
    Settle(o.settle_seconds);
    for (auto [d, m] :
         {std::pair{node->get(), &out.node}, std::pair{coordinator->get(), &out.coordinator}}) {
      const Rss r = ReadRss(d->pid());
      m->*rss = r.rss;
      m->*anon = r.anon;
      if (peak) m->hwm_registered = r.hwm;
    }
  };
  read(&DaemonMemory::rss_before, &DaemonMemory::anon_before);
  const auto start = std::chrono::steady_clock::now();
  std::vector<absl::StatusOr<std::unique_ptr<WorkerClient>>> workers(layouts.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < layouts.size(); ++i) {
      threads.emplace_back([&, i] {
        workers[i] = WorkerClient::Connect((*node)->worker_target(), "regmem", v1::TRAINER,
                                           layouts[i], WorkerCallbacks{}, absl::Seconds(300));
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (const auto& w : workers) {
    if (!w.ok()) return w.status();
  }
  out.register_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  read(&DaemonMemory::rss_registered, &DaemonMemory::anon_registered, /*peak=*/true);
  for (auto& w : workers) {
    if (auto s = (*w)->Unregister(); !s.ok()) return s;
    w->reset();
  }
  read(&DaemonMemory::rss_unregistered, &DaemonMemory::anon_unregistered);
  return out;
}

}  // namespace refit
