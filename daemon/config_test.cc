// refitd's flags as ParseDaemonFlags reads them: values into the config, the config file under
// the command line, and every kind of bad input returned as an error naming the flag (a test
// that goes on after a refusal shows that the library did not end the process).
#include "daemon/config.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit {
namespace {

absl::StatusOr<DaemonInvocation> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "refitd");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return ParseDaemonFlags(static_cast<int>(argv.size()), argv.data());
}

DaemonConfig ParseOk(std::vector<std::string> args) {
  absl::StatusOr<DaemonInvocation> parsed = Parse(std::move(args));
  INFO(parsed.status().ToString());
  REQUIRE(parsed.ok());
  CHECK(parsed->action == DaemonInvocation::Action::kRun);
  return parsed->config;
}

std::string ParseError(std::vector<std::string> args) {
  absl::StatusOr<DaemonInvocation> parsed = Parse(std::move(args));
  REQUIRE_FALSE(parsed.ok());
  return std::string(parsed.status().message());
}

// A file in the test's temporary directory, removed with the object.
class TempFile {
 public:
  TempFile(const std::string& name, const std::string& text)
      : path_(absl::StrCat(TempDir(), "/", name, ".", getpid())) {
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  static std::string TempDir() {
    const char* dir = std::getenv("TEST_TMPDIR");
    return dir != nullptr ? dir : "/tmp";
  }
  std::string path_;
};

TEST_CASE("flags set the config; unset ones keep DaemonConfig's defaults") {
  const DaemonConfig c =
      ParseOk({"--node", "3", "--listen=127.0.0.1:7070", "--coordinator", "10.0.0.1:7070", "--gpus",
               "0,2", "--prepare-timeout", "2.5", "--norouting", "--worker-uids", "1000,0",
               "--max-group-pieces=99", "--log-format", "json", "--nccl-register",
               "--fanout-threads", "3"});
  CHECK(c.node == 3);
  CHECK(c.listen == "127.0.0.1:7070");
  CHECK(c.coordinator == "10.0.0.1:7070");
  CHECK_FALSE(c.is_coordinator());
  CHECK(c.gpus == std::vector<int32_t>{0, 2});
  CHECK(c.prepare_timeout == absl::Milliseconds(2500));
  CHECK_FALSE(c.routing);
  CHECK(c.worker_uids == std::vector<uint32_t>{1000, 0});
  CHECK(c.group_limits.max_pieces == 99);
  CHECK(c.log_format == "json");
  CHECK(c.nccl_register);
  CHECK(c.fanout_threads == 3);
  CHECK(c.worker_socket == "/tmp/refitd-3.sock");
  CHECK(c.state_file == "/tmp/refitd-3.sock.state");

  const DaemonConfig defaults;
  CHECK(c.transfer_timeout == defaults.transfer_timeout);
  CHECK(c.max_rpc_bytes == defaults.max_rpc_bytes);
  CHECK(c.tls.operators == defaults.tls.operators);
  CHECK(c.limits.max_pieces == defaults.limits.max_pieces);
}

TEST_CASE("each parse starts from the defaults, whatever an earlier one set") {
  REQUIRE(ParseOk({"--node", "5", "--state-file", "", "--noaligned-copy-kernel"}).node == 5);
  const DaemonConfig c = ParseOk({});
  const DaemonConfig defaults;
  CHECK(c.node == 0);
  CHECK(c.aligned_copy_kernel == defaults.aligned_copy_kernel);
  CHECK(c.state_file == "/tmp/refitd-0.sock.state");
  CHECK(c.heartbeat == defaults.heartbeat);
  CHECK(c.is_coordinator());
}

TEST_CASE("booleans: bare, negated with no, and with a value") {
  CHECK(ParseOk({"--insecure-listen"}).insecure_listen);
  CHECK_FALSE(ParseOk({"--insecure-listen", "--noinsecure-listen"}).insecure_listen);
  CHECK_FALSE(ParseOk({"--insecure-listen=false"}).insecure_listen);
  CHECK(ParseOk({"--routing=true"}).routing);
}

TEST_CASE("the config file is read first, the command line over it") {
  const TempFile file("good.json",
                      R"({"node": 1, "log-format": "json", "max-rpc-bytes": 268435457,
                          "heartbeat": 0.25, "insecure-listen": true})");
  const DaemonConfig c = ParseOk({"--config", file.path(), "--node", "2"});
  CHECK(c.node == 2);
  CHECK(c.log_format == "json");
  CHECK(c.max_rpc_bytes == 268435457);  // a whole number of more than six digits, exactly
  CHECK(c.heartbeat == absl::Milliseconds(250));
  CHECK(c.insecure_listen);
}

TEST_CASE("every kind of bad value is refused by name") {
  struct Case {
    std::vector<std::string> args;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{"--frobnicate"}, "unknown flag \"--frobnicate\""},
      {{"--node"}, "flag --node needs a value"},
      {{"--node", "abc"}, "flag --node: cannot use \"abc\""},
      {{"--node", "-1"}, "--node must be >= 0"},
      {{"--coordinator-node", "-2"}, "--coordinator-node must be a node index, or -1"},
      {{"--routing=maybe"}, "flag --routing: cannot use \"maybe\""},
      {{"--prepare-timeout", "0"}, "--prepare-timeout must be positive"},
      {{"--heartbeat", "nan"}, "--heartbeat must be positive"},
      {{"--data-idle-timeout", "-3"}, "--data-idle-timeout must be positive"},
      {{"--drain-timeout", "-1"}, "--drain-timeout must be >= 0"},
      {{"--max-message-bytes", "100"}, "--max-message-bytes must be in [4096, 2^31]"},
      {{"--max-rpc-bytes", "10"}, "--max-rpc-bytes must be in [1024, 2^31)"},
      {{"--staging-bytes", "1000"}, "--staging-bytes must be at least 1048576"},
      {{"--max-relay-depth", "99"}, "--max-relay-depth must be in [0, 6]"},
      {{"--backend", "gpu"}, "--backend must be one of: cuda, host (got \"gpu\")"},
      {{"--arm-rounds", "sometimes"},
       "--arm-rounds must be never, auto or always, not \"sometimes\""},
      {{"--log-level", "verbose"}, "--log-level \"verbose\" is not one of"},
      {{"--log-format", "yaml"}, "--log-format \"yaml\" is not text or json"},
      {{"--gpus", "0,x"}, "--gpus: \"x\" is not a GPU index"},
      {{"--gpus", "-1"}, "--gpus: \"-1\" is not a GPU index"},
      {{"--worker-uids", "root"}, "--worker-uids: \"root\" is not a uid"},
      {{"--max-nodes", "0"}, "--max-nodes must be positive"},
      {{"--fanout-threads", "17"},
       "--fanout-threads must be in [0, 16] (0: from the cores), not 17"},
      {{"--fanout-threads", "-1"}, "--fanout-threads must be in [0, 16]"},
      {{"--max-registration-buffers", "0"}, "--max-registration-buffers must be positive"},
      {{"--max-group-bytes", "-5"}, "--max-group-bytes must be positive"},
      {{"--tls-cert", "c.pem"}, "--tls-cert, --tls-key and --tls-ca go together"},
      {{"--tls-cert", "/no/c.pem", "--tls-key", "/no/k.pem", "--tls-ca", "/no/a.pem"},
       "cannot read TLS file /no/c.pem"},
      {{"--listen", "10.1.2.3:7070"}, "--listen 10.1.2.3:7070 is not a loopback address"},
      {{"--worker-listen", "0.0.0.0:1"}, "--worker-listen 0.0.0.0:1 is not a loopback address"},
      {{"stray"}, "unexpected argument \"stray\""},
  };
  for (const Case& c : cases) {
    INFO(absl::StrJoin(c.args, " "));
    const absl::StatusOr<DaemonInvocation> parsed = Parse(c.args);
    REQUIRE_FALSE(parsed.ok());
    INFO(parsed.status().ToString());
    CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(parsed.status().message(), c.error));
  }
}

TEST_CASE("a bad config file is refused naming the file and the key") {
  const TempFile unknown("unknown.json", R"({"node": 1, "heartbeet": 0.5})");
  CHECK(ParseError({"--config", unknown.path()}) ==
        absl::StrCat(unknown.path(),
                     ": unknown key \"heartbeet\" (keys are refitd's flags "
                     "without \"--\": refitd --help)"));
  const TempFile bad_value("badvalue.json", R"({"node": "abc"})");
  CHECK(ParseError({"--config=" + bad_value.path()}) ==
        absl::StrCat(bad_value.path(), ": flag --node: cannot use \"abc\""));
  const TempFile array("array.json", "[1, 2]");
  CHECK(ParseError({"--config", array.path()}) ==
        absl::StrCat(array.path(), ": not a JSON object"));
  const TempFile nested("nested.json", R"({"gpus": [0, 1]})");
  CHECK(ParseError({"--config", nested.path()}) ==
        absl::StrCat(nested.path(), ": \"gpus\" must be a string, number or boolean"));
  const TempFile itself("itself.json", R"({"config": "other.json"})");
  CHECK(absl::StrContains(ParseError({"--config", itself.path()}), "unknown key \"config\""));
  CHECK(absl::StrContains(ParseError({"--config", "/no/such/file.json"}), "/no/such/file.json"));
}

TEST_CASE("--help: what comes before it is checked, what follows it is not") {
  const absl::StatusOr<DaemonInvocation> help = Parse({"--node", "1", "--help", "--node", "abc"});
  REQUIRE(help.ok());
  CHECK(help->action == DaemonInvocation::Action::kPrintHelp);
  CHECK(absl::StrContains(ParseError({"--node", "abc", "--help"}), "flag --node: cannot use"));
  CHECK(absl::StrContains(ParseError({"--bogus", "--help"}), "unknown flag \"--bogus\""));
  // Checks made once every flag is read wait for a run: --help answers before them.
  CHECK(Parse({"--tls-cert", "c.pem", "--help"}).ok());
}

// Each listed flag, given its listed default, is accepted: the listing and the parser agree.
TEST_CASE("--help lists every flag with its help text and a default the parser accepts") {
  const std::string help = DaemonFlagsHelp();
  CHECK(absl::StartsWith(help, "usage: refitd [--config FILE] [flags]"));
  const std::regex entry(R"(  --([a-z0-9-]+)\n      (.+) \(default: (.*)\)\n)");
  std::vector<std::string> args;
  int listed = 0;
  for (std::sregex_iterator it(help.begin(), help.end(), entry), end; it != end; ++it) {
    const std::string name = (*it)[1], text = (*it)[2], value = (*it)[3];
    CHECK_FALSE(text.empty());
    ++listed;
    if (name == "config" || name == "check-config") continue;  // not settings of a run
    args.push_back(absl::StrCat("--", name, "=", value == "\"\"" ? "" : value));
  }
  CHECK(listed == 60);
  for (const char* flag : {"--worker-socket", "--check-config", "--max-group-bytes", "--tls-ca"}) {
    CHECK(absl::StrContains(help, flag));
  }
  const DaemonConfig c = ParseOk(args);
  CHECK(c.node == DaemonConfig().node);
  CHECK(c.state_file == "/tmp/refitd-0.sock.state");
}

TEST_CASE("--check-config returns the checked config for main to describe") {
  const absl::StatusOr<DaemonInvocation> check =
      Parse({"--check-config", "--listen", "10.1.2.3:7070", "--insecure-listen"});
  REQUIRE(check.ok());
  CHECK(check->action == DaemonInvocation::Action::kCheckConfig);
  CHECK(check->config.listen == "10.1.2.3:7070");
  CHECK(absl::StrContains(DescribeConfig(check->config), "no TLS, and --insecure-listen"));
  CHECK(absl::StrContains(DescribeConfig(ParseOk({})), "node 0, coordinator, "));
  CHECK(absl::StrContains(ParseError({"--check-config", "--listen", "10.1.2.3:7070"}),
                          "is not a loopback address"));
}

TEST_CASE(
    "an rpc keepalive that idle gRPC clients cannot answer in time is warned of, not refused") {
  CHECK(ConfigWarnings(ParseOk({})).empty());
  CHECK(ConfigWarnings(ParseOk({"--rpc-keepalive", "8"})).empty());
  const std::vector<std::string> warnings = ConfigWarnings(ParseOk({"--rpc-keepalive", "2.5"}));
  REQUIRE(warnings.size() == 1);
  CHECK(absl::StartsWith(warnings[0], "--rpc-keepalive 2.5s is below 8s"));
  CHECK(absl::StrContains(warnings[0], "every 5s"));
}

}  // namespace
}  // namespace refit
