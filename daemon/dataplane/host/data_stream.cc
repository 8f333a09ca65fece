#include "daemon/dataplane/host/data_stream.h"

#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "daemon/base/logging.h"
#include "plan/status_macros.h"

namespace refit {
namespace {

// Written by the accepting side once it has checked the client (data_stream.h says why).
constexpr std::byte kTlsAccepted{0x52};

// Everything OpenSSL queued on this thread, oldest first; the queue is left empty.
std::string SslErrors() {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "no detail from OpenSSL" : out;
}

// The socket BIO writes with write(2), which raises SIGPIPE on a connection the peer closed;
// this one uses send(MSG_NOSIGNAL), and MSG_DONTWAIT so that no call blocks whatever the
// descriptor's mode (deadlines are kept by poll, as socket.cc's are).
int BioWrite(BIO* b, const char* data, int n) {
  BIO_clear_retry_flags(b);
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  const ssize_t r = send(fd, data, static_cast<size_t>(n), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_write(b);
  return static_cast<int>(r);
}
int BioRead(BIO* b, char* data, int n) {
  BIO_clear_retry_flags(b);
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  const ssize_t r = recv(fd, data, static_cast<size_t>(n), MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_read(b);
  return static_cast<int>(r);
}
long BioCtrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }
int BioCreate(BIO* b) {
  BIO_set_init(b, 1);
  return 1;
}

// Made once, kept for the process' life (connections may outlive any owner of it).
const BIO_METHOD* SocketBioMethod() {
  static const BIO_METHOD* method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "refit data socket");
    if (m == nullptr) return static_cast<BIO_METHOD*>(nullptr);
    BIO_meth_set_write(m, BioWrite);
    BIO_meth_set_read(m, BioRead);
    BIO_meth_set_ctrl(m, BioCtrl);
    BIO_meth_set_create(m, BioCreate);
    return m;
  }();
  return method;
}

struct GeneralNamesDeleter {
  void operator()(GENERAL_NAMES* names) const { GENERAL_NAMES_free(names); }
};
struct OpensslStringDeleter {
  void operator()(unsigned char* s) const { OPENSSL_free(s); }
};

// A certificate's identities: its subject common names and DNS subject alternative names.
std::vector<std::string> Identities(X509* cert) {
  std::vector<std::string> out;
  X509_NAME* subject = X509_get_subject_name(cert);
  for (int i = -1;
       subject != nullptr && (i = X509_NAME_get_index_by_NID(subject, NID_commonName, i)) >= 0;) {
    unsigned char* raw = nullptr;
    const int n =
        ASN1_STRING_to_UTF8(&raw, X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, i)));
    std::unique_ptr<unsigned char, OpensslStringDeleter> utf8(raw);
    if (n >= 0) out.emplace_back(reinterpret_cast<const char*>(utf8.get()), static_cast<size_t>(n));
  }
  std::unique_ptr<GENERAL_NAMES, GeneralNamesDeleter> sans(
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)));
  for (int i = 0; sans != nullptr && i < sk_GENERAL_NAME_num(sans.get()); ++i) {
    const GENERAL_NAME* g = sk_GENERAL_NAME_value(sans.get(), i);
    if (g->type != GEN_DNS) continue;
    out.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(g->d.dNSName)),
                     static_cast<size_t>(ASN1_STRING_length(g->d.dNSName)));
  }
  return out;
}

// Who the other end of one handshake must be; the verify callback finds it in the SSL's app data.
struct PeerRule {
  bool accepting = false;      // any node (the client of a data connection)
  int32_t node = -1;           // connecting: exactly this node
  std::string identity;        // the name that satisfied the rule
  std::vector<int32_t> nodes;  // accepting: every node the certificate names
  std::string refused;         // why the certificate's names did not
};

// Chain verification is OpenSSL's (against the CA file); at the leaf this adds the identity rule,
// inside the handshake, so that a refused peer gets an alert rather than a silent close.
int VerifyPeer(int preverify_ok, X509_STORE_CTX* store) {
  if (preverify_ok != 1 || X509_STORE_CTX_get_error_depth(store) != 0) return preverify_ok;
  SSL* ssl =
      static_cast<SSL*>(X509_STORE_CTX_get_ex_data(store, SSL_get_ex_data_X509_STORE_CTX_idx()));
  auto* rule = ssl == nullptr ? nullptr : static_cast<PeerRule*>(SSL_get_app_data(ssl));
  X509* cert = X509_STORE_CTX_get_current_cert(store);
  if (rule == nullptr || cert == nullptr) return 0;
  const std::vector<std::string> names = Identities(cert);
  const std::string wanted = absl::StrCat(kNodeIdentityPrefix, rule->node);
  // One node per certificate (NodeOfNames, as the gRPC side decides): one naming two is no node's.
  const int32_t named = NodeOfNames(names);
  if (named >= 0 && (rule->accepting || named == rule->node)) {
    rule->identity = absl::StrCat(kNodeIdentityPrefix, named);
    if (rule->accepting) rule->nodes.push_back(named);
    return 1;
  }
  std::vector<std::string> shown;
  for (const std::string& name : names) shown.push_back(absl::CHexEscape(name));
  rule->refused =
      absl::StrCat("its certificate names ", shown.empty() ? "nobody" : absl::StrJoin(shown, ", "),
                   rule->accepting ? absl::StrCat(", not one node (", kNodeIdentityPrefix, "<N>)")
                                   : absl::StrCat(", not ", wanted));
  X509_STORE_CTX_set_error(store, X509_V_ERR_APPLICATION_VERIFICATION);
  return 0;
}

}  // namespace

absl::StatusOr<SslCtxPtr> MakeDataTlsContext(const TlsConfig& config) {
  ERR_clear_error();
  SslCtxPtr ctx(SSL_CTX_new(TLS_method()));
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", SslErrors()));
  if (SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION) != 1) {
    return absl::InternalError(absl::StrCat("TLS 1.3: ", SslErrors()));
  }
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), config.cert.c_str()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert ", config.cert, ": ", SslErrors()));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), config.key.c_str(), SSL_FILETYPE_PEM) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", config.key, ": ", SslErrors()));
  }
  if (SSL_CTX_check_private_key(ctx.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", config.key,
                                                   " is not the key of --tls-cert ", config.cert,
                                                   ": ", SslErrors()));
  }
  if (SSL_CTX_load_verify_locations(ctx.get(), config.ca.c_str(), nullptr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-ca ", config.ca, ": ", SslErrors()));
  }
  // Both ends must present a certificate (FAIL_IF_NO_PEER_CERT applies to the accepting side).
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, VerifyPeer);
  // Nothing but kTlsAccepted may follow the handshake towards a sender: a reused connection is
  // judged closed when anything is readable on it (HostBackend::TakeCached). No tickets, then, and
  // no resumption (each connection verifies its certificates afresh).
  SSL_CTX_set_num_tickets(ctx.get(), 0);
  SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_OFF);
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_TICKET);
  // Non-blocking writes: partial progress returns, and a retry may pass the same data anew.
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Bulk data: read ahead, so that a record's header and body (and the next records) come in one
  // recv instead of two per 16 KiB record.
  SSL_CTX_set_read_ahead(ctx.get(), 1);
  SSL_CTX_set_default_read_buffer_len(ctx.get(), 256 << 10);
  // TLS 1.3's mandatory suite first: AES-128-GCM runs at 1.6x AES-256-GCM's rate on these
  // machines (openssl speed, AES-NI), at 128-bit security; the others stay acceptable.
  if (SSL_CTX_set_ciphersuites(
          ctx.get(),
          "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256") != 1) {
    return absl::InternalError(absl::StrCat("TLS 1.3 cipher suites: ", SslErrors()));
  }
  return ctx;
}

bool TlsContext::Stamp::operator==(const Stamp& o) const {
  return mtime.tv_sec == o.mtime.tv_sec && mtime.tv_nsec == o.mtime.tv_nsec && size == o.size &&
         inode == o.inode;
}

TlsContext::Stamps TlsContext::Read() const {
  Stamps out;
  const std::string* files[3] = {&config_.cert, &config_.key, &config_.ca};
  for (int i = 0; i < 3; ++i) {
    struct stat st;
    if (stat(files[i]->c_str(), &st) != 0) continue;  // missing: a stamp of its own (size -1)
    out[i].mtime = st.st_mtim;
    out[i].size = st.st_size;
    out[i].inode = st.st_ino;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<TlsContext>> TlsContext::Load(const TlsConfig& config) {
  std::unique_ptr<TlsContext> t(new TlsContext(config));
  const Stamps stamps = t->Read();  // before the files are read: a change meanwhile loads again
  auto ctx = MakeDataTlsContext(config);
  if (!ctx.ok()) return ctx.status();
  absl::MutexLock lock(&t->mu_);
  t->ctx_ = *std::move(ctx);
  t->loaded_ = stamps;
  t->next_check_ = absl::Now() + config.reload;
  return t;
}

void TlsContext::MaybeReload() {
  const absl::Time now = absl::Now();
  if (now < next_check_) return;
  next_check_ = now + config_.reload;
  const Stamps stamps = Read();
  if (stamps == loaded_ || stamps == failed_) return;
  auto ctx = MakeDataTlsContext(config_);
  if (!ctx.ok()) {
    failed_ = stamps;  // logged once, until the files change again
    Logger("xfer")->error(
        "data plane TLS: the certificate files changed but do not load, so new connections "
        "keep the previous ones: {}",
        std::string(ctx.status().message()));
    return;
  }
  ctx_ = *std::move(ctx);  // connections made on the old context keep it alive
  loaded_ = stamps;
  failed_ = Stamps();
  ++reloads_;
  Logger("xfer")->info("data plane TLS: reloaded {}, {} and {}", config_.cert, config_.key,
                       config_.ca);
}

absl::StatusOr<SslPtr> TlsContext::NewSsl() {
  absl::MutexLock lock(&mu_);
  MaybeReload();
  ERR_clear_error();
  SslPtr ssl(SSL_new(ctx_.get()));
  if (ssl == nullptr) return absl::InternalError(absl::StrCat("SSL_new: ", SslErrors()));
  return ssl;
}

int64_t TlsContext::reloads() const {
  absl::MutexLock lock(&mu_);
  return reloads_;
}

namespace {

// After an SSL call on `ssl` returned `r` (errno then was `err`): waits for what it wants, or
// says why the connection is over.
absl::Status AwaitSsl(SSL* ssl, int r, int err, const Fd& fd, absl::Time deadline,
                      absl::string_view what, const std::string& peer) {
  switch (SSL_get_error(ssl, r)) {
    case SSL_ERROR_WANT_READ:
      return WaitReady(fd.get(), POLLIN, deadline, absl::StrCat(what, " ", peer));
    case SSL_ERROR_WANT_WRITE:
      return WaitReady(fd.get(), POLLOUT, deadline, absl::StrCat(what, " ", peer));
    case SSL_ERROR_ZERO_RETURN:
      return absl::UnavailableError(absl::StrCat(peer, " closed the connection"));
    case SSL_ERROR_SYSCALL:
      ERR_clear_error();
      if (err == 0) return absl::UnavailableError(absl::StrCat(peer, " closed the connection"));
      return absl::UnavailableError(absl::StrCat(what, " ", peer, ": ", std::strerror(err)));
    default:
      if (ERR_GET_REASON(ERR_peek_error()) == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
        ERR_clear_error();
        return absl::UnavailableError(absl::StrCat(peer, " closed the connection"));
      }
      return absl::UnavailableError(absl::StrCat(what, " ", peer, ": ", SslErrors()));
  }
}

}  // namespace

absl::Status DataStream::Handshake(TlsContext& tls, bool accepting, int32_t node,
                                   absl::Time deadline) {
  REFIT_ASSIGN_OR_RETURN(SslPtr ssl, tls.NewSsl());
  const BIO_METHOD* method = SocketBioMethod();
  BIO* bio = method == nullptr ? nullptr : BIO_new(method);
  if (bio == nullptr) return absl::InternalError(absl::StrCat("BIO_new: ", SslErrors()));
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<intptr_t>(fd_.get())));
  SSL_set_bio(ssl.get(), bio, bio);  // ssl owns it
  PeerRule rule;
  rule.accepting = accepting;
  rule.node = node;
  SSL_set_app_data(ssl.get(), &rule);
  if (accepting) {
    SSL_set_accept_state(ssl.get());
  } else {
    SSL_set_connect_state(ssl.get());
  }
  const std::string with = absl::StrCat("TLS handshake with ", peer_);
  while (true) {
    ERR_clear_error();
    errno = 0;
    const int r = SSL_do_handshake(ssl.get());
    const int err = errno;
    if (r == 1) break;
    const int code = SSL_get_error(ssl.get(), r);
    if (code == SSL_ERROR_WANT_READ || code == SSL_ERROR_WANT_WRITE) {
      absl::Status waited = AwaitSsl(ssl.get(), r, err, fd_, deadline, "TLS handshake with", peer_);
      if (!waited.ok()) {
        SSL_set_app_data(ssl.get(), nullptr);
        return waited;
      }
      continue;
    }
    SSL_set_app_data(ssl.get(), nullptr);
    if (!rule.refused.empty()) {
      ERR_clear_error();
      return absl::PermissionDeniedError(absl::StrCat(with, " refused: ", rule.refused));
    }
    const long verified = SSL_get_verify_result(ssl.get());
    if (verified != X509_V_OK) {
      ERR_clear_error();
      return absl::UnavailableError(absl::StrCat(
          with, " failed: its certificate: ", X509_verify_cert_error_string(verified)));
    }
    absl::Status s = AwaitSsl(ssl.get(), r, err, fd_, deadline, "TLS handshake with", peer_);
    if (absl::StrContains(s.message(), "closed the connection")) {
      return absl::UnavailableError(absl::StrCat(s.message(), " during the TLS handshake"));
    }
    return s;
  }
  SSL_set_app_data(ssl.get(), nullptr);  // `rule` ends here
  // The callback ran at the leaf and passed (it alone sets rule.identity); checked again from the
  // outcome so that no path through OpenSSL skips it.
  if (SSL_get_verify_result(ssl.get()) != X509_V_OK ||
      SSL_get0_peer_certificate(ssl.get()) == nullptr || rule.identity.empty() ||
      SSL_version(ssl.get()) < TLS1_3_VERSION) {
    return absl::PermissionDeniedError(
        absl::StrCat(with, ": the peer's certificate was not verified"));
  }
  ssl_ = std::move(ssl);
  identity_ = rule.identity;
  peer_nodes_ = std::move(rule.nodes);
  if (accepting) {
    const std::byte accepted = kTlsAccepted;
    return SendAll({&accepted, 1}, deadline);
  }
  std::byte answer{};
  if (absl::Status s = RecvAll({&answer, 1}, deadline); !s.ok()) {
    ssl_.reset();
    return absl::Status(
        s.code(), absl::StrCat(peer_, " did not accept this node's certificate: ", s.message()));
  }
  if (answer != kTlsAccepted) {
    ssl_.reset();
    return absl::UnavailableError(absl::StrCat(with, ": an unexpected answer"));
  }
  return absl::OkStatus();
}

absl::Status DataStream::AcceptTls(TlsContext& tls, absl::Time deadline) {
  return Handshake(tls, /*accepting=*/true, -1, deadline);
}

absl::Status DataStream::ConnectTls(TlsContext& tls, int32_t node, absl::Time deadline) {
  return Handshake(tls, /*accepting=*/false, node, deadline);
}

absl::Status DataStream::SendAll(std::span<const std::byte> data, absl::Time deadline) {
  if (ssl_ == nullptr) return refit::SendAll(fd_, data, deadline, peer_);
  size_t done = 0;
  while (done < data.size()) {
    ERR_clear_error();
    errno = 0;
    size_t n = 0;
    const int r = SSL_write_ex(ssl_.get(), data.data() + done, data.size() - done, &n);
    const int err = errno;
    if (r == 1) {
      done += n;
      continue;
    }
    REFIT_RETURN_IF_ERROR(AwaitSsl(ssl_.get(), r, err, fd_, deadline, "sending to", peer_));
  }
  return absl::OkStatus();
}

absl::Status DataStream::RecvAll(std::span<std::byte> data, absl::Time deadline) {
  if (ssl_ == nullptr) return refit::RecvAll(fd_, data, deadline, peer_);
  size_t done = 0;
  while (done < data.size()) {
    ERR_clear_error();
    errno = 0;
    size_t n = 0;
    const int r = SSL_read_ex(ssl_.get(), data.data() + done, data.size() - done, &n);
    const int err = errno;
    if (r == 1) {
      done += n;
      continue;
    }
    REFIT_RETURN_IF_ERROR(AwaitSsl(ssl_.get(), r, err, fd_, deadline, "receiving from", peer_));
  }
  return absl::OkStatus();
}

}  // namespace refit
