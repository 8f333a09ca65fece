// The worker library: a trainer or inference process registers its buffers and pieces with its
// node's refitd, exposes their memory (host shared memory, CUDA IPC handles or CUDA VMM
// allocations), and receives the round events through callbacks. The daemon reads and writes the
// memory itself; the worker's process copies nothing.
//
// Memory travels as file descriptors (the library's own host memory, a sealed memfd; CUDA VMM
// allocations), handed to the daemon over its handle socket before registering
// (daemon/README.md); every registration makes such a delivery, even of no descriptor (CUDA IPC
// memory), because it is how the daemon learns which process (uid) registers. Register answers a
// session key, which the session's hello and Unregister present: nobody else can end or take
// over this worker's registration. The session is watched by gRPC keepalive: a daemon that dies or
// freezes is noticed within about two seconds (connected() turns false, on_disconnected is called).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/worker/callback_thread.h"
#include "common/shared_memory.h"
#include "plan/layout.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

// The callbacks run one at a time, in the order of the events, on a thread of the library's own
// (never the caller's, never the session's reader: a callback may take as long as the phase's
// deadline allows without the session being taken for lost). A callback may call Unregister();
// it must not destroy the client.
struct WorkerCallbacks {
  // PREPARE(version). Trainer: make the weights version `version` and leave them untouched until
  // the round ends. Inference: stop reading the weights. Return an error to refuse the round: the
  // daemon aborts it at once, with the error's message as the reason.
  std::function<absl::Status(int64_t version)> on_prepare;
  // COMMIT(version): the round succeeded. Inference: the buffers hold `version`; resume.
  std::function<void(int64_t version)> on_commit;
  // ABORT: the round failed. Inference: the buffers hold no complete version.
  std::function<void(int64_t round_id, const std::string& reason)> on_abort;
  // The session ended without Unregister: the daemon died, froze (no keepalive answer), or
  // dropped the worker. The daemon no longer knows this worker. A round the worker was in
  // counts as aborted (on_abort first; an engine's version() is 0). Unless
  // ConnectOptions::reconnect is off, the library then registers again by itself, as soon as
  // the daemon is back, and calls on_reconnected.
  std::function<void(const std::string& why)> on_disconnected;
  std::function<void(const std::string& worker_id)> on_reconnected;
};

// Memory a worker exported itself (e.g. ExportCudaBuffers in client/worker/cuda_export.h).
struct WorkerMemory {
  std::vector<v1::BufferMemory> memory;  // one per buffer of the layout, in order
  std::vector<v1::VmmRange> vmm_ranges;  // what memory's cuda_vmm entries index
  // Handed over before registering, in this order (the indices the memory refers to). The
  // caller's: they stay open (a restarted daemon needs them again).
  std::vector<int> fds;
  std::string
      gpu_uuid;  // the worker's GPU ("GPU-..."); empty: the layout's gpu is the daemon's index
};

struct ConnectOptions {
  absl::Duration timeout = absl::Seconds(10);  // for handing over descriptors and registering
  WorkerMemory memory;  // empty `memory.memory`: the library allocates host shared memory (a memfd)
  // The daemon's handle socket; empty: "<socket>.handles" of a "unix:<socket>" daemon. A daemon
  // reached over TCP (--worker-listen) needs it given: descriptors never travel over TCP.
  std::string handle_socket;
  // Register again after the session is lost (a daemon restarted, or frozen and woken), with the
  // same memory: its descriptors stay open for that (the library's own and the caller's).
  bool reconnect = true;
  // A trainer whose ranks each register: its rank, 0 .. trainer_world_size - 1, and how many
  // there are (0: undeclared). The coordinator then names a rank that is not registered
  // (RegisterWorkerRequest.trainer_rank).
  int32_t trainer_rank = 0;
  int32_t trainer_world_size = 0;
};

class WorkerClient {
 public:
  // `layout` holds this worker only (its buffers and pieces) and the tensors they name.
  // `daemon` is "unix:/tmp/refitd-0.sock" or "host:port".
  static absl::StatusOr<std::unique_ptr<WorkerClient>> Connect(const std::string& daemon,
                                                               const std::string& group,
                                                               v1::Role role, const Layout& layout,
                                                               WorkerCallbacks callbacks,
                                                               ConnectOptions options);
  // `memory`: one exported handle per buffer for memory the worker allocated itself (no
  // descriptors); empty: the library allocates host shared memory (buffer() gives it).
  static absl::StatusOr<std::unique_ptr<WorkerClient>> Connect(
      const std::string& daemon, const std::string& group, v1::Role role, const Layout& layout,
      WorkerCallbacks callbacks, absl::Duration timeout = absl::Seconds(10),
      std::vector<v1::BufferMemory> memory = {});
  ~WorkerClient();  // ends the session; the daemon drops the worker

  // Empty when the worker passed its own memory handles.
  std::span<std::byte> buffer(size_t index) const { return buffers_[index]; }
  size_t num_buffers() const { return buffers_.size(); }
  const std::string& worker_id() const { return worker_id_; }
  // Inference: the last version received completely (0: none). Never a partial one.
  int64_t version() const { return version_; }
  // The session with the daemon is open: false once it ended (see on_disconnected).
  bool connected() const { return connected_; }
  // The current registration's secret (RegisterWorkerResponse.session_key): what the session's
  // hello and Unregister present. This process' own; it must not leave it.
  std::string session_key();
  // Unregisters and ends the session.
  absl::Status Unregister();

 private:
  WorkerClient() = default;
  struct Session;
  void SessionLoop();
  // One session until it ends; returns why it ended. Reads only: each event is handled on
  // `callbacks_thread_`, which also writes the replies.
  std::string RunSession();
  // On `callbacks_thread_`: runs the event's callback and answers on `session`.
  void HandleEvent(Session& session, const v1::RoundEvent& e);
  // Opens a session for the registered worker (false: closed meanwhile, or the daemon did not
  // take it).
  bool OpenSession();
  // Hands the descriptors over again and registers, within `deadline`.
  absl::Status Register(absl::Time deadline);
  // Waits `d` unless the client is closed meanwhile; false when it was.
  bool SleepUnlessClosed(absl::Duration d);
  // The library's host memory for every buffer of `layout` (arena_, buffers_): its descriptor
  // appended to `fds`, each buffer's place in it added to `request`.
  absl::Status AllocateHostMemory(const Layout& layout, v1::RegisterWorkerRequest& request,
                                  std::vector<int>& fds);

  std::string worker_id_;
  v1::Role role_ = v1::ROLE_UNSPECIFIED;
  // The library's host memory: one shared-memory object for all of the worker's buffers (one
  // mapping in the daemon, however many buffers: Linux caps a process at 65,530 mappings).
  SharedMemory arena_;
  std::vector<std::span<std::byte>> buffers_;
  WorkerCallbacks callbacks_;
  std::string daemon_;
  v1::RegisterWorkerRequest request_;  // as registered, without its descriptors' token
  std::vector<int> fds_;               // handed over at every registration (kept open)
  std::string handle_socket_;          // where they are handed over
  std::string session_key_;            // the last registration's (mu_); a new one each time
  absl::Duration timeout_;
  bool reconnect_ = true;
  std::unique_ptr<v1::RefitWorker::Stub> stub_;
  std::mutex mu_;  // session_ and session_key_, replaced at each registration; closed_ changes
  std::condition_variable closing_;
  std::shared_ptr<Session> session_;
  std::thread session_thread_;
  std::atomic<int64_t> version_{0};
  std::atomic<bool> closed_{false};
  std::atomic<bool> connected_{false};
  int64_t open_round_ = -1;  // PREPARE seen, no COMMIT or ABORT yet (callbacks_thread_'s)
  // Last: destroyed (joined) first, while everything its tasks touch still exists.
  CallbackThread callbacks_thread_;
};

// The handle socket of the daemon at `daemon` ("unix:/path" -> "/path.handles"); empty for a
// TCP address.
std::string HandleSocketPath(const std::string& daemon);

// Hands `fds` (still the caller's) to the daemon's handle socket at `path` under a fresh random
// token, waiting until `deadline` for a daemon that is still starting; returns the token to
// register with (RegisterWorkerRequest.fd_token).
absl::StatusOr<std::string> DeliverHandles(const std::string& path, std::span<const int> fds,
                                           absl::Time deadline);

}  // namespace refit
