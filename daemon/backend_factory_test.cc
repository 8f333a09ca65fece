// The data planes by --backend name: one entry per name config accepts, an unknown name refused
// naming the known ones, and the host data plane made from a config.
#include "daemon/backend_factory.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "daemon/backend_names.h"

namespace refit {
namespace {

TEST_CASE("the factory has one entry per name config accepts, each described") {
  REQUIRE(Backends().size() == kBackendNames.size());
  for (size_t i = 0; i < kBackendNames.size(); ++i) {
    INFO(kBackendNames[i]);
    CHECK(Backends()[i].name == kBackendNames[i]);
    CHECK_FALSE(Backends()[i].description.empty());
    CHECK(Backends()[i].make != nullptr);
    CHECK(FindBackend(kBackendNames[i]) == &Backends()[i]);
    CHECK(CheckBackendName(kBackendNames[i]).ok());
  }
  CHECK(FindBackend("gpu") == nullptr);
  CHECK(KnownBackendNames() == "cuda, host");
}

TEST_CASE("an unknown --backend is refused, naming the known ones") {
  DaemonConfig config;
  config.backend = "gpu";
  const auto made = MakeBackend(config, BackendContext{});
  REQUIRE_FALSE(made.ok());
  CHECK(made.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(made.status().message() == "--backend must be one of: cuda, host (got \"gpu\")");
  CHECK(CheckBackendName("").message() == "--backend must be one of: cuda, host (got \"\")");
}

TEST_CASE("host makes a host data plane listening on --data-listen") {
  DaemonConfig config;
  config.backend = "host";
  config.data_listen = "127.0.0.1:0";
  auto made = MakeBackend(config, BackendContext{.local_users = std::make_shared<LoopbackUsers>()});
  REQUIRE(made.ok());
  const std::unique_ptr<DataBackend>& backend = *made;
  CHECK(backend->name() == "host");
  const std::string address = backend->data_address();
  INFO(address);
  REQUIRE(absl::StartsWith(address, "127.0.0.1:"));
  int port = 0;
  REQUIRE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port));
  REQUIRE(port > 0);
  // It listens there.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) == 0);
  close(fd);
}

}  // namespace
}  // namespace refit
