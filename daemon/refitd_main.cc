// refitd: the per-node refit daemon. See daemon/daemon.h and docs/DEPLOYMENT.md.
#include <csignal>
#include <cstdio>
#include <thread>

#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/logging.h"

int main(int argc, char** argv) {
  const refit::DaemonConfig config = refit::ParseDaemonFlags(argc, argv);
  // SIGINT/SIGTERM end the daemon cleanly: a thread waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  auto daemon = refit::Daemon::Start(config);
  if (!daemon.ok()) {
    std::fprintf(stderr, "refitd: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    refit::Logger("rpc")->info("signal {}: shutting down", sig);
    (*daemon)->Shutdown();
  });
  waiter.detach();
  (*daemon)->Wait();
  daemon->reset();
  return 0;
}
