// The host data plane: buffers in POSIX shared memory; messages between daemons over TCP, one
// message at a time per connection (staging bounded by the plan's max_message_bytes per
// connection), packed and unpacked with the CPU reference of plan/host_copy.h.
//
// Connections, and what bounds them:
// - Incoming: one reader thread per accepted connection (a small stack), at most
//   `max_incoming` at once. Anyone who can connect could otherwise hold those places for good,
//   so every connection has deadlines: its first frame must begin within `first_byte_timeout`
//   of its accept (or of its TLS handshake), and a connection idle between frames longer than
//   `idle_timeout` is closed. One more connection than `max_incoming` evicts the connection
//   idle the longest (one that never carried a frame first: a node's pooled connection has);
//   only when every connection is inside a frame is the new one closed at once, with a
//   (rate-limited) log line. A connection that closes or fails releases its descriptor and its
//   thread (joined by the acceptor as soon as it ends). An accept error (EMFILE, ENFILE,
//   ENOBUFS...) is logged (rate-limited) and retried after `accept_backoff`: the node keeps
//   accepting.
// - An idle connection is closed gracefully: its write side first (the sender sees the end
//   before it reuses the connection, and dials afresh), while a frame the sender had already
//   begun to write is still read for kIdleCloseGrace (host_backend.cc): closing at once would
//   lose a frame that raced the close without an error on either side.
// - Outgoing: one cached connection per peer address, reused from round to round; dropped when a
//   send on it fails, when it is found closed by the peer before reuse (its receiver closes it
//   after idle_timeout: the frame goes on a fresh connection), and after any round that
//   did not succeed here (so that nothing of an aborted round is ever followed by a new round on
//   the same connection).
// - Frames carry (group, round id, message, bytes). A frame of a round that is over here
//   (finished, aborted, cancelled before it ran) or older than the group's round running here
//   is read to its end and dropped: its connection stays in step and nothing of it reaches
//   memory. A frame of a round not yet running here waits for it (`frame_wait`). Anything that
//   breaks a frame off (a peer gone mid-frame, a malformed header, a deadline, a Cancel while the
//   frame is arriving) closes the connection: a half-received frame never desynchronises it. A
//   message broken off is not by itself a failure of the receiver's round: its sender sends it
//   again on a fresh connection, or reports its own failure (the round's true reason).
// - When Transfer returns, nothing writes into the round's memory any more.
// - With `tls` configured, every data connection is mutual TLS (data_stream.h): a sender accepts
//   only the certificate of the node it dials, a receiver only nodes' certificates. The receiver's
//   handshake runs on the connection's reader thread, by `handshake_timeout`, so a peer that stalls
//   or fails it holds nothing but its own thread; at most `max_handshaking` connections are in
//   their handshake at once, a newer one cutting the oldest off (idle connections cannot fill the
//   slots). A frame whose message the plan has another node send than the one the client's
//   certificate names, or that the round does not have, closes the connection before any of it
//   lands and fails no round (a node can neither write another's weights nor abort rounds with
//   frames it does not send); only the message's own sender fails the round with a bad frame of it
//   (the wrong size, not for this node). Without `tls`, plain TCP, and any bad frame of a running
//   round fails it.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"
#include "common/tls_config.h"
#include "daemon/base/socket.h"
#include "daemon/dataplane/backend.h"
#include "daemon/dataplane/host/data_frame.h"
#include "daemon/dataplane/host/data_stream.h"
#include "daemon/security/loopback_owner.h"

namespace refit {

struct HostBackendOptions {
  // Incoming data connections served at once (one reader thread each); one more evicts the
  // connection idle the longest, or is refused when all are inside a frame.
  int max_incoming = 512;
  // A new connection's first frame must begin within this of its accept (of its TLS handshake,
  // with TLS): a sender dials only when it has a frame to send.
  absl::Duration first_byte_timeout = absl::Seconds(10);
  // A connection idle between frames for longer is closed by its reader (the sender dials
  // again for its next frame). Rounds minutes apart reconnect each time: a TCP (and TLS)
  // handshake, milliseconds.
  absl::Duration idle_timeout = absl::Seconds(120);
  // How long a frame of a round that has not started here waits for it before its connection
  // is dropped (peers begin a round at slightly different times).
  absl::Duration frame_wait = absl::Seconds(30);
  // After an accept error, the acceptor waits this long before it accepts again.
  absl::Duration accept_backoff = absl::Milliseconds(100);
  // Rounds remembered as over (their late frames are dropped), the oldest forgotten first.
  int ended_rounds = 1024;
  // Mutual TLS on every data connection when enabled() (DaemonConfig::tls); else plain TCP.
  TlsConfig tls;
  // Without TLS: the users whose loopback connections are admitted, both ways (a connection
  // accepted from, or made to, a socket another user owns is closed at once). Null: anyone's.
  std::shared_ptr<const LoopbackUsers> local_users;
  // TLS: a new connection's handshake must be done within this (or frame_wait, if shorter), and
  // at most `max_handshaking` connections are in their handshake at once (0: half of
  // max_incoming): one more cuts off the oldest of them, so that connections that never
  // handshake (anyone can open them) can neither hold the slots for long nor crowd out a node's.
  absl::Duration handshake_timeout = absl::Seconds(5);
  int max_handshaking = 0;
  // A shared-memory object handed over (MapBuffers) larger than this is refused: no worker has
  // more memory to share, and a sparse one (a memfd truncated to terabytes) would take that much
  // of the daemon's address space. 0: the machine's physical memory (sysconf); tests set less.
  int64_t physical_memory_bytes = 0;
  // Bytes of shared memory mapped at once, all workers' objects together; more is refused
  // (RESOURCE_EXHAUSTED) until some are unmapped. 0: twice physical_memory_bytes.
  int64_t max_mapped_bytes = 0;
};

// Counters of the data connections, for tests and logs.
struct HostConnectionStats {
  int64_t open_incoming = 0;        // accepted and being read now (one thread each)
  int64_t reader_threads = 0;       // reader threads not yet joined (open_incoming + ending ones)
  int64_t in_frame = 0;             // connections inside a frame now (never evicted)
  int64_t accepted = 0;             // since start
  int64_t refused = 0;              // over max_incoming, every connection inside a frame
  int64_t evicted = 0;              // closed, idle, for a newer connection over max_incoming
  int64_t first_byte_timeouts = 0;  // closed: no frame began within first_byte_timeout
  int64_t idle_closed = 0;          // closed: idle between frames for idle_timeout
  int64_t accept_errors = 0;
  int64_t stale_frames = 0;    // frames of rounds over here, read and dropped
  int64_t tls_refused = 0;     // incoming connections whose TLS handshake or peer failed
  int64_t user_refused = 0;    // without TLS: incoming connections of a user not admitted
  int64_t handshaking = 0;     // TLS: accepted, handshake not done yet
  int64_t handshakes_cut = 0;  // TLS: cut off in their handshake for a newer one (max_handshaking)
  int64_t tls_reloads = 0;     // TLS contexts replaced since start (rotated files)
  // TLS: a frame of a message that the certificate's node does not send in the plan (another
  // node's, or one the round does not have): dropped with its connection, failing no round.
  int64_t forged_frames = 0;
  int64_t cached_outgoing = 0;
};

class HostBackend : public DataBackend {
 public:
  // Listens for peers on `listen_address` ("host:0" picks a port).
  static absl::StatusOr<std::unique_ptr<HostBackend>> Start(const std::string& listen_address);
  static absl::StatusOr<std::unique_ptr<HostBackend>> Start(const std::string& listen_address,
                                                            const HostBackendOptions& options);
  ~HostBackend() override;

  std::string name() const override { return "host"; }
  std::string data_address() const override { return address_; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory& memory,
                                                    int64_t bytes) override;
  // Shared memory by name (Map) or by descriptor (SharedMemory.fd): a descriptor's object is
  // mapped whole, as large as fstat says (never as the worker claims), once per object.
  absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> MapBuffers(
      const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
      std::span<const Fd> fds) override;
  absl::StatusOr<int32_t> GpuIndex(const std::string& name) override;
  // Host memory: the host data plane reads and writes it directly.
  absl::StatusOr<std::unique_ptr<MappedBuffer>> AllocateScratch(const Worker& worker,
                                                                int64_t bytes) override;
  absl::StatusOr<TransferStats> Transfer(const TransferJob& job) override;
  // Ends a running Transfer of that round with ABORTED(reason); a round not running here is
  // remembered as over, so that its late frames are dropped.
  void Cancel(const std::string& group, int64_t round_id, const std::string& reason) override;

  HostConnectionStats connection_stats() const;
  std::vector<std::pair<std::string, int64_t>> ConnectionEvents() const override;
  // Bytes of shared memory mapped now (each object once, while any buffer maps it).
  int64_t mapped_bytes() const { return mapped_bytes_->load(); }

 private:
  struct Job;
  struct Connection;
  // At most one line per interval for each kind of repeated complaint, so that a fault that
  // repeats (a flood of bad connections, descriptors running out) cannot flood the log.
  class LogLimiter {
   public:
    // Whether a line may be logged now; if so, `*suffix` counts the ones that were not since.
    bool Allow(std::string* suffix) ABSL_LOCKS_EXCLUDED(mu_);

   private:
    absl::Mutex mu_;
    absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
    int64_t unlogged_ ABSL_GUARDED_BY(mu_) = 0;
  };
  using RoundKey = std::pair<std::string, int64_t>;
  // What the reader of a frame of `key` does with it.
  enum class FrameFate { kDeliver, kDrop, kGiveUp };
  struct Ended {
    uint64_t seq = 0;        // its place in ended_order_
    absl::Status cancelled;  // cancelled before it began here: a Transfer of it ends so
  };

  // What the acceptor does after one accept: go on with its batch, poll again, or stop.
  enum class AcceptNext { kNext, kPoll, kStop };
  // How a frame of a running round ended on its reader.
  enum class Delivery {
    kLanded,          // whole, in the round's memory
    kDropConnection,  // broken off, forged or bad: its connection closes
    kRoundOver,       // the round failed or ended here first: drained like a late frame
  };

  explicit HostBackend(const HostBackendOptions& options);
  void AcceptLoop();
  // Accepts one waiting connection and starts its reader (or refuses it).
  AcceptNext AcceptOne() ABSL_LOCKS_EXCLUDED(mu_);
  // An accept failed with errno `err` (descriptors or memory short): logged, counted, and waits
  // accept_backoff (or until stopping) before the acceptor polls again.
  void BackOffAfterAcceptError(int err) ABSL_LOCKS_EXCLUDED(mu_);
  // Without TLS, with local_users: false (logged, counted) when `fd`'s peer is not admitted.
  bool AdmitsLocalUser(const Fd& fd) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts a reader for `fd` (evicting an idle connection over max_incoming), or refuses it.
  AcceptNext ServeConnection(Fd fd, const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // TLS: `incoming` is in its handshake, the oldest in theirs cut off over max_handshaking.
  void BoundHandshakes(Connection* incoming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // options_.max_handshaking, resolved (0: half of max_incoming).
  int MaxHandshaking() const;
  void Reap() ABSL_LOCKS_EXCLUDED(mu_);
  void ReadLoop(Connection* c);
  // TLS: the server side of `c`'s handshake. False (logged) when its reader should end.
  bool HandshakeIncoming(Connection* c) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads the rest of a frame whose first byte is in wire[0], and lands or drops it. False when
  // the connection must close (logged); true when it waits for its next frame.
  bool ReadFrame(DataStream& stream, std::array<std::byte, kFrameHeaderBytes>& wire,
                 std::vector<std::byte>& staging, std::string& group) ABSL_LOCKS_EXCLUDED(mu_);
  // The rest of the header and the group name, by `deadline`; false (logged) if either fails.
  bool ReadFrameHeader(DataStream& stream, std::array<std::byte, kFrameHeaderBytes>& wire,
                       absl::Time deadline, FrameHeader* h, std::string& group);
  Delivery DeliverFrame(DataStream& stream, Job& job, const FrameHeader& h,
                        const std::string& group, std::vector<std::byte>& staging)
      ABSL_LOCKS_EXCLUDED(mu_);
  // TLS: true (counted, logged) when the frame's message is not one the plan has the peer's
  // certificate's node send.
  bool IsForgedFrame(const DataStream& stream, const Plan& plan, const FrameHeader& h,
                     const std::string& group) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads a frame of a round over here to its end and drops it; false (logged) if it broke off.
  bool DropLateFrame(DataStream& stream, const FrameHeader& h, const std::string& group,
                     std::vector<std::byte>& staging) ABSL_LOCKS_EXCLUDED(mu_);
  void EndReader(Connection* c) ABSL_LOCKS_EXCLUDED(mu_);
  // Makes room for one more connection over max_incoming: ends the one idle the longest.
  // False when every connection is inside a frame (or ending already).
  bool EvictIdlest(const std::string& for_peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Connections counted against max_incoming: those not ending already.
  int64_t LiveConnections() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The reader of `c` marks where it is, for the deadlines and for EvictIdlest.
  void MarkInFrame(Connection* c, bool in_frame) ABSL_LOCKS_EXCLUDED(mu_);
  // `c` waited past its deadline for a frame's first byte: counted and logged. True when its
  // reader should go on reading for kIdleCloseGrace (its write side shut), false to end it.
  bool ExpireIdle(Connection* c) ABSL_LOCKS_EXCLUDED(mu_);
  FrameFate FindJob(const RoundKey& key, absl::Time deadline, std::shared_ptr<Job>* job)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Registers the round's job: ALREADY_EXISTS if it runs, its Cancel's status if it was
  // cancelled before it began here.
  absl::Status BeginRound(const RoundKey& key, const std::shared_ptr<Job>& job)
      ABSL_LOCKS_EXCLUDED(mu_);
  // This node's messages stage by stage, each stage once the incoming messages of the stages
  // before it have landed; then waits for the rest.
  absl::Status RunStages(Job& job, TransferStats* stats) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Send(Job& job, const Message& m, int64_t index, std::vector<std::byte>& staging);
  // The round is over here: its late frames are dropped; after a failure, its peers' cached
  // connections go.
  void EndRound(const RoundKey& key, bool ok, const std::vector<std::string>& peers)
      ABSL_LOCKS_EXCLUDED(mu_);
  DataStream TakeCached(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  void RememberEnded(const RoundKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropOutgoing(const std::vector<std::string>& peers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Wake();
  // The object behind descriptor `fd`, sealed and mapped whole once however many descriptors of
  // it arrive: the mapping cached for it, or a new one within the bounds of MapBuffers.
  absl::StatusOr<std::shared_ptr<SharedMemory>> MapObjectOnce(int fd, const std::string& what,
                                                              const std::string& object,
                                                              int64_t bytes)
      ABSL_LOCKS_EXCLUDED(segments_mu_);

  const HostBackendOptions options_;
  std::string address_;
  Fd listener_;                      // non-blocking
  Fd wake_;                          // eventfd: a reader ended, or the backend stops
  std::unique_ptr<TlsContext> tls_;  // null: plain TCP
  std::thread acceptor_;
  LogLimiter accept_errors_log_, refusals_log_, drops_log_, stale_log_, user_refusals_log_,
      idle_log_;

  mutable absl::Mutex mu_;
  absl::CondVar jobs_changed_;  // a job began or ended, a round was cancelled, stopping
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<RoundKey, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<RoundKey, Ended> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<RoundKey, uint64_t>> ended_order_ ABSL_GUARDED_BY(mu_);
  uint64_t ended_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Accepted connections by id, each with its reader thread; ended ones wait in finished_ for
  // the acceptor to join them.
  absl::flat_hash_map<int64_t, std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> finished_ ABSL_GUARDED_BY(mu_);
  int64_t next_connection_ ABSL_GUARDED_BY(mu_) = 0;
  HostConnectionStats counters_ ABSL_GUARDED_BY(mu_);
  // Cached connections by address, the last used at the back. Several rounds (of several groups)
  // may send to one node at once, each on its own connection: every one is kept, up to
  // kMaxCachedPerPeer, since closing a connection just written to can lose its frame (without
  // TLS the receiver checks the sender's uid, which only an open connection still has).
  absl::flat_hash_map<std::string, std::vector<DataStream>> outgoing_ ABSL_GUARDED_BY(mu_);

  // The bounds of MapBuffers (options_'s, resolved), and the bytes mapped now: shared with each
  // mapping's deleter, which may run after this backend is gone.
  int64_t max_object_bytes_ = 0;
  int64_t max_mapped_bytes_ = 0;
  std::shared_ptr<std::atomic<int64_t>> mapped_bytes_ = std::make_shared<std::atomic<int64_t>>(0);

  // Shared-memory objects handed over as descriptors, by (device, inode): one mapping per
  // object, however many descriptors of it arrive, while any buffer maps it. A live mapping pins
  // its inode, so the key cannot be reused.
  absl::Mutex segments_mu_;
  std::map<std::pair<dev_t, ino_t>, std::weak_ptr<SharedMemory>> fd_segments_
      ABSL_GUARDED_BY(segments_mu_);
  size_t fd_maps_since_prune_ ABSL_GUARDED_BY(segments_mu_) = 0;
};

}  // namespace refit
