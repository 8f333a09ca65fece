// refitd: the per-node refit daemon. See daemon/daemon.h and docs/DEPLOYMENT.md.
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <thread>
#include <utility>
#include <variant>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/cli_flags.h"
#include "daemon/base/log_later.h"
#include "daemon/base/logging.h"
#include "daemon/config.h"
#include "daemon/daemon.h"

namespace {

// The configuration to run with, or the exit code when the command line asks for no daemon:
// 0 after --help or --check-config, 2 after one line naming what is wrong.
std::variant<refit::DaemonConfig, int> ConfigFromFlags(int argc, char** argv) {
  absl::StatusOr<refit::DaemonInvocation> invocation = refit::ParseDaemonFlags(argc, argv);
  if (!invocation.ok()) {
    std::fprintf(stderr, "%s\n", refit::ErrorLine("refitd", invocation.status().message()).c_str());
    return 2;
  }
  switch (invocation->action) {
    case refit::DaemonInvocation::Action::kPrintHelp:
      std::fputs(refit::DaemonFlagsHelp().c_str(), stdout);
      return 0;
    case refit::DaemonInvocation::Action::kCheckConfig:
      std::printf("%s\n", refit::DescribeConfig(invocation->config).c_str());
      for (const std::string& w : refit::ConfigWarnings(invocation->config))
        std::printf("warning: %s\n", w.c_str());
      return 0;
    case refit::DaemonInvocation::Action::kRun:
      break;
  }
  return std::move(invocation->config);
}

}  // namespace

int main(int argc, char** argv) {
  std::variant<refit::DaemonConfig, int> flags = ConfigFromFlags(argc, argv);
  if (const int* exit_code = std::get_if<int>(&flags)) return *exit_code;
  const refit::DaemonConfig config = std::get<refit::DaemonConfig>(std::move(flags));
#ifdef NDEBUG
  // Debian's Abseil is built with its mutex deadlock detection on: every Lock updates a graph of
  // lock orders (3% of the coordinator's CPU in a round of 64 nodes). Debug builds and the tests
  // keep it; optimized ones, what operators run, do not pay for it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  // SIGINT/SIGTERM end the daemon cleanly: a thread waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  // Workers hand memory over as file descriptors (up to 65,536 per delivery, daemon/README.md):
  // the soft limit (often 1,024) would cut deliveries off long before the hard one.
  if (rlimit nofile; getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max &&
                     nofile.rlim_cur < (rlim_t{1} << 20)) {
    nofile.rlim_cur =
        std::min<rlim_t>(nofile.rlim_max, rlim_t{1} << 20);  // the kernel's usual nr_open
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  // Buffers of 1 MiB and more (data-plane staging, plan scratch, transient registration
  // messages) are mappings of their own, unmapped when freed. glibc's default threshold rises
  // after each such free, so the next ones land in per-thread arenas, which keep them: a daemon
  // whose rounds abort again and again grew by tens of MiB (tests/integration/
  // fp8_fault_matrix_test, 6 MiB of scratch: RssAnon 20 -> 43 MiB over 12 aborted rounds).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // No fast bins: small chunks freed go back at once to their neighbours and the arena's top,
  // which is given back to the system when it grows past the trim threshold. With fast bins, a
  // large message decoded into many small objects (a registration's sync) ended up, after
  // malloc_trim consolidated it, as the top of a per-thread arena, which malloc_trim never
  // shrinks: the coordinator kept 50 MiB for one 9 MB registration, at random
  // (tests/load/registration_memory_test).
  mallopt(M_MXFAST, 0);
  // The waiter starts before the daemon: Start may wait long for the coordinator, and a signal
  // meanwhile (nothing to drain yet: no worker registers before the join) ends the process.
  std::atomic<refit::Daemon*> running{nullptr};
  std::atomic<bool> signalled{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    signalled = true;
    refit::Daemon* d = running.load();
    if (d == nullptr) {
      refit::Logger("rpc")->info("signal {} before the daemon was up: exiting", sig);
      std::_Exit(0);
    }
    refit::Logger("rpc")->info("signal {}: draining, then shutting down", sig);
    d->Shutdown();
  });
  waiter.detach();
  auto daemon = refit::Daemon::Start(config);
  if (!daemon.ok()) {
    std::fprintf(stderr, "refitd: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  running = daemon->get();
  if (signalled) (*daemon)->Shutdown();  // raced the signal: it saw no daemon, or this one did
  (*daemon)->Wait();
  refit::FlushLaterLogs();  // the last rounds' reports (daemon/base/log_later.h)
  daemon->reset();
  return 0;
}
