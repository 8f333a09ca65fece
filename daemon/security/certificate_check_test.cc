#include "daemon/security/certificate_check.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

// tools/gen_certs.sh from Bazel's runfiles (or the repository root, run by hand).
std::string GenCertsScript() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr) {
    return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "refit",
                        "/tools/gen_certs.sh");
  }
  return "tools/gen_certs.sh";
}

// Nodes 0 and 1, and a certificate of the same CA named refit-node-5 only (no `refitd`).
const std::string& Certs() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string d = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/certs-XXXXXX");
    REQUIRE(mkdtemp(d.data()) != nullptr);
    const std::string command =
        absl::StrCat("bash '", GenCertsScript(), "' '", d, "' 2 refit-node-5 >/dev/null 2>&1");
    REQUIRE(std::system(command.c_str()) == 0);
    return d;
  }();
  return dir;
}

TlsConfig Files(const std::string& cert, const std::string& key, const std::string& ca = "ca.pem") {
  TlsConfig t;
  t.cert = Certs() + "/" + cert;
  t.key = Certs() + "/" + key;
  t.ca = Certs() + "/" + ca;
  return t;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST_CASE("a daemon's own certificate is checked when it starts, naming what is wrong") {
  CHECK(CheckDaemonCertificate(Files("node-0.pem", "node-0.key"), 0).ok());
  CHECK(CheckDaemonCertificate(Files("node-1.pem", "node-1.key"), 1).ok());

  const absl::Status other_node = CheckDaemonCertificate(Files("node-0.pem", "node-0.key"), 1);
  CHECK(other_node.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Message(other_node).find("is not node 1's") != std::string::npos);
  CHECK(Message(other_node).find("refit-node-0") != std::string::npos);

  const absl::Status no_server_name =
      CheckDaemonCertificate(Files("refit-node-5.pem", "refit-node-5.key"), 5);
  CHECK(no_server_name.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Message(no_server_name).find("lacks the DNS name refitd") != std::string::npos);

  const absl::Status wrong_key = CheckDaemonCertificate(Files("node-0.pem", "node-1.key"), 0);
  CHECK(Message(wrong_key).find("is not the key of --tls-cert") != std::string::npos);

  const absl::Status other_ca =
      CheckDaemonCertificate(Files("rogue/node-0.pem", "rogue/node-0.key"), 0);
  CHECK(other_ca.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Message(other_ca).find("does not verify against --tls-ca") != std::string::npos);

  { std::ofstream(Certs() + "/garbage.pem") << "not a certificate\n"; }
  const absl::Status garbage = CheckDaemonCertificate(Files("garbage.pem", "node-0.key"), 0);
  CHECK(Message(garbage).find("no PEM certificate") != std::string::npos);
  const absl::Status missing = CheckDaemonCertificate(Files("absent.pem", "node-0.key"), 0);
  CHECK(Message(missing).find("cannot read") != std::string::npos);
}

TEST_CASE("certificate names: the CN and the DNS SANs") {
  std::ifstream in(Certs() + "/node-0.pem");
  const std::string pem((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto names = CertificateNames(pem);
  REQUIRE(names.ok());
  CHECK(std::find(names->begin(), names->end(), "refit-node-0") != names->end());
  CHECK(std::find(names->begin(), names->end(), "refitd") != names->end());
  CHECK(!CertificateNames("nothing").ok());
}

}  // namespace
}  // namespace refit
