// A host data-plane connection: plain TCP, or mutual TLS over it (docs/SECURITY.md), with
// reads and writes that end by a deadline.
//
// TLS here is OpenSSL's, used directly: gRPC's TLS covers only gRPC channels, and the data plane
// is a raw TCP stream of frames. Both ends present a certificate of the cluster CA (TLS 1.3 at
// least); the accepting side requires the client's identity (CN or a DNS SAN) to be
// `refit-node-<digits>`, the connecting side requires the server's to be `refit-node-<the node
// it dials>`, exactly. After its checks the accepting side writes one byte, which the connecting
// side awaits: in TLS 1.3 a client finishes its handshake before the server has judged its
// certificate, and without it a refused sender would write a whole round into a connection that
// is thrown away, and learn nothing.
#pragma once

#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tls_config.h"
#include "daemon/base/socket.h"

namespace refit {

struct SslCtxDeleter {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};
struct SslDeleter {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};
// SSL_new takes its own reference to the context: a connection keeps the context it began with
// alive after a reload replaced it.
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxDeleter>;
using SslPtr = std::unique_ptr<SSL, SslDeleter>;

// Builds the data plane's context from the three files; an error names the file at fault.
absl::StatusOr<SslCtxPtr> MakeDataTlsContext(const TlsConfig& config);

// The data plane's TLS context, rebuilt when any of its files changes (mtime, size or inode),
// checked at most every `config.reload`. New connections use the newest context that loaded; a
// bad new file keeps the old one (logged once per change).
class TlsContext {
 public:
  static absl::StatusOr<std::unique_ptr<TlsContext>> Load(const TlsConfig& config);
  // A connection's TLS state on the current context (reloaded first if due).
  absl::StatusOr<SslPtr> NewSsl() ABSL_LOCKS_EXCLUDED(mu_);
  int64_t reloads() const ABSL_LOCKS_EXCLUDED(mu_);  // contexts replaced since Load

 private:
  struct Stamp {
    struct timespec mtime {};
    off_t size = -1;
    ino_t inode = 0;
    bool operator==(const Stamp& o) const;
  };
  using Stamps = std::array<Stamp, 3>;  // cert, key, ca
  explicit TlsContext(const TlsConfig& config) : config_(config) {}
  Stamps Read() const;
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TlsConfig config_;
  mutable absl::Mutex mu_;
  SslCtxPtr ctx_ ABSL_GUARDED_BY(mu_);
  Stamps loaded_ ABSL_GUARDED_BY(mu_);  // the files as they were when ctx_ was built
  Stamps failed_ ABSL_GUARDED_BY(mu_);  // the last files that did not load (logged once)
  absl::Time next_check_ ABSL_GUARDED_BY(mu_);
  int64_t reloads_ ABSL_GUARDED_BY(mu_) = 0;
};

// One connection, used by one thread at a time; only Shutdown may come from another.
class DataStream {
 public:
  DataStream() = default;
  // Plain TCP over `fd`; `peer` names the other end in errors ("node 1 (10.0.0.2:7071)").
  DataStream(Fd fd, std::string peer) : fd_(std::move(fd)), peer_(std::move(peer)) {}
  DataStream(DataStream&&) = default;
  DataStream& operator=(DataStream&&) = default;

  // Makes this stream TLS, handshake and checks done by `deadline`, as the accepting side (the
  // client must be a node; `identity()` is then its name) or the connecting side (the server
  // must be node `node`). UNAVAILABLE on a broken handshake, DEADLINE_EXCEEDED, or
  // PERMISSION_DENIED when a certificate verifies but names someone else.
  absl::Status AcceptTls(TlsContext& tls, absl::Time deadline);
  absl::Status ConnectTls(TlsContext& tls, int32_t node, absl::Time deadline);

  // Write or read exactly the span, or fail: DEADLINE_EXCEEDED, or UNAVAILABLE when the peer
  // closed the connection or it broke (the message names the peer).
  absl::Status SendAll(std::span<const std::byte> data, absl::Time deadline);
  absl::Status RecvAll(std::span<std::byte> data, absl::Time deadline);

  const Fd& fd() const { return fd_; }
  bool valid() const { return fd_.valid(); }
  bool tls() const { return ssl_ != nullptr; }
  const std::string& peer() const { return peer_; }
  const std::string& identity() const { return identity_; }
  // Accepting side, after AcceptTls: every node the client's certificate names (usually one). A
  // receiver takes from this connection only messages sent by one of them.
  const std::vector<int32_t>& peer_nodes() const { return peer_nodes_; }
  // Wakes a thread blocked on this stream; the descriptor stays owned.
  void Shutdown() { fd_.Shutdown(); }
  // Ends this side's writing (the peer reads the end of the stream); reading goes on. Plain TCP
  // and TLS alike: no close_notify, as in Close.
  void ShutdownWrite() { shutdown(fd_.get(), SHUT_WR); }
  void Close() {
    ssl_.reset();  // no close_notify: the peer learns of the end from the socket's
    fd_.Close();
  }

 private:
  absl::Status Handshake(TlsContext& tls, bool accept, int32_t node, absl::Time deadline);

  Fd fd_;
  SslPtr ssl_;
  std::string peer_;
  std::string identity_;
  std::vector<int32_t> peer_nodes_;
};

}  // namespace refit
