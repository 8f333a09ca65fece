#include "daemon/worker_session.h"

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"

namespace refit {

absl::Status RunWorkerSession(WorkerRegistry& registry, grpc::ServerContext* context,
                              grpc::ServerReaderWriter<v1::RoundEvent, v1::WorkerMessage>* stream,
                              const std::function<void(const std::string& id, const std::string& reason)>& lost) {
  v1::WorkerMessage hello;
  if (!stream->Read(&hello) || hello.kind_case() != v1::WorkerMessage::kHello) {
    return absl::InvalidArgumentError("a session starts with hello(worker_id)");
  }
  auto attached = registry.Attach(hello.hello());
  if (!attached.ok()) return attached.status();
  std::shared_ptr<LocalWorker> w = *std::move(attached);
  // Reads on their own thread; this one writes. A worker's session ending means the worker is gone.
  std::atomic<bool> reader_done{false};
  std::thread reader([&] {
    v1::WorkerMessage m;
    while (stream->Read(&m)) registry.Record(*w, m);
    reader_done = true;
    registry.WakeSession(*w);
  });
  while (true) {
    std::optional<v1::RoundEvent> event = registry.NextEvent(*w, absl::Milliseconds(200), &reader_done);
    if (registry.stopping() || registry.Gone(*w) || reader_done || context->IsCancelled()) break;
    if (!event.has_value()) continue;
    if (!stream->Write(*event)) break;
  }
  context->TryCancel();  // unblocks the reader's Read
  reader.join();
  if (!registry.Gone(*w)) lost(w->id, "its session ended (process exited or connection lost)");
  return absl::OkStatus();
}

}  // namespace refit
