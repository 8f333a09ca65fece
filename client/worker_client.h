// The worker library: a trainer or inference process registers its buffers and pieces with its
// node's refitd, exposes their memory (POSIX shared memory on the host backend), and receives the
// round events through callbacks. The daemon reads and writes the memory itself; the worker's
// process copies nothing.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/shared_memory.h"
#include "plan/layout.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

struct WorkerCallbacks {
  // PREPARE(version). Trainer: make the weights version `version` and leave them untouched until
  // the round ends. Inference: stop reading the weights. Return an error to refuse the round.
  std::function<absl::Status(int64_t version)> on_prepare;
  // COMMIT(version): the round succeeded. Inference: the buffers hold `version`; resume.
  std::function<void(int64_t version)> on_commit;
  // ABORT: the round failed. Inference: the buffers hold no complete version.
  std::function<void(int64_t round_id, const std::string& reason)> on_abort;
};

class WorkerClient {
 public:
  // `layout` holds this worker only (its buffers and pieces) and the tensors they name.
  // `daemon` is "unix:/tmp/refitd-0.sock" or "host:port".
  // `memory`: one exported handle per buffer (e.g. ExportCudaBuffer) for memory the worker
  // allocated itself; empty: the library allocates host shared memory (buffer() gives it).
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
  // Unregisters and ends the session.
  absl::Status Unregister();

 private:
  WorkerClient() = default;
  void SessionLoop();

  std::string worker_id_;
  v1::Role role_ = v1::ROLE_UNSPECIFIED;
  // The library's host memory: one shared-memory object for all of the worker's buffers (one
  // mapping in the daemon, however many buffers: Linux caps a process at 65,530 mappings).
  SharedMemory arena_;
  std::vector<std::span<std::byte>> buffers_;
  WorkerCallbacks callbacks_;
  std::unique_ptr<v1::RefitWorker::Stub> stub_;
  grpc::ClientContext session_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::RoundEvent>> session_;
  std::thread session_thread_;
  std::atomic<int64_t> version_{0};
  std::atomic<bool> closed_{false};
};

}  // namespace refit
