#include "client/worker_client.h"

#include "absl/strings/str_cat.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(
    const std::string& daemon, const std::string& group, v1::Role role, const Layout& layout,
    WorkerCallbacks callbacks, absl::Duration timeout, std::vector<v1::BufferMemory> memory) {
  if (layout.workers.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("a worker's layout holds exactly one worker, not ",
                                                   layout.workers.size()));
  }
  std::unique_ptr<WorkerClient> c(new WorkerClient());
  c->role_ = role;
  c->callbacks_ = std::move(callbacks);
  const v1::Layout proto = LayoutToProto(layout);
  v1::RegisterWorkerRequest request;
  request.set_group(group);
  request.set_role(role);
  *request.mutable_tensors() = proto.tensors();
  *request.mutable_worker() = proto.workers(0);
  if (!memory.empty()) {
    if (memory.size() != layout.buffers.size()) {
      return absl::InvalidArgumentError(absl::StrCat(layout.buffers.size(), " buffers but ",
                                                     memory.size(), " memory handles"));
    }
    for (auto& m : memory) *request.add_memory() = std::move(m);
  }
  if (memory.empty() && !layout.buffers.empty()) {
    // Every buffer in one object, each at an offset aligned for any element type.
    constexpr int64_t kAlign = 256;
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (const Buffer& b : layout.buffers) {
      offsets.push_back(total);
      total += (b.NumBytes() + kAlign - 1) / kAlign * kAlign;
    }
    auto shm = SharedMemory::Create(UniqueShmName("buf"), static_cast<size_t>(std::max<int64_t>(total, 1)));
    if (!shm.ok()) return shm.status();
    c->arena_ = *std::move(shm);
    for (size_t i = 0; i < layout.buffers.size(); ++i) {
      v1::SharedMemory* m = request.add_memory()->mutable_shm();
      m->set_name(c->arena_.name());
      m->set_offset(offsets[i]);
      m->set_size(static_cast<int64_t>(c->arena_.bytes().size()));
      c->buffers_.push_back(c->arena_.bytes().subspan(static_cast<size_t>(offsets[i]),
                                                      static_cast<size_t>(layout.buffers[i].NumBytes())));
    }
  }
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(1 << 30);
  c->stub_ = v1::RefitWorker::NewStub(grpc::CreateCustomChannel(daemon, grpc::InsecureChannelCredentials(), args));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout));
    ctx.set_wait_for_ready(true);  // the daemon may still be starting
    v1::RegisterWorkerResponse response;
    auto s = FromGrpc(c->stub_->Register(&ctx, request, &response));
    if (!s.ok()) return s;
    c->worker_id_ = response.worker_id();
  }
  if (!c->buffers_.empty()) c->arena_.Unlink();  // the daemon holds its own mapping now
  c->session_ = c->stub_->Session(&c->session_context_);
  v1::WorkerMessage hello;
  hello.set_hello(c->worker_id_);
  if (!c->session_->Write(hello)) {
    return absl::UnavailableError(absl::StrCat("the daemon at ", daemon, " closed the session"));
  }
  c->session_thread_ = std::thread([p = c.get()] { p->SessionLoop(); });
  return c;
}

void WorkerClient::SessionLoop() {
  v1::RoundEvent e;
  while (session_->Read(&e)) {
    v1::WorkerMessage reply;
    switch (e.kind()) {
      case v1::RoundEvent::PREPARE: {
        if (role_ == v1::INFERENCE) version_ = 0;  // the buffers are about to change
        absl::Status s = callbacks_.on_prepare ? callbacks_.on_prepare(e.version()) : absl::OkStatus();
        if (!s.ok()) continue;  // no confirmation: the round ends at its deadline, naming us
        reply.set_prepared(e.round_id());
        break;
      }
      case v1::RoundEvent::COMMIT:
        if (role_ == v1::INFERENCE) version_ = e.version();
        if (callbacks_.on_commit) callbacks_.on_commit(e.version());
        reply.set_resumed(e.round_id());
        break;
      case v1::RoundEvent::ABORT:
        if (role_ == v1::INFERENCE) version_ = 0;
        if (callbacks_.on_abort) callbacks_.on_abort(e.round_id(), e.reason());
        reply.set_resumed(e.round_id());
        break;
      default:
        continue;
    }
    if (!session_->Write(reply)) break;
  }
}

absl::Status WorkerClient::Unregister() {
  if (closed_.exchange(true)) return absl::OkStatus();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterWorkerRequest request;
  request.set_worker_id(worker_id_);
  v1::UnregisterWorkerResponse response;
  const absl::Status s = FromGrpc(stub_->Unregister(&ctx, request, &response));
  session_context_.TryCancel();
  if (session_thread_.joinable()) session_thread_.join();
  return s;
}

WorkerClient::~WorkerClient() {
  if (!closed_.exchange(true)) session_context_.TryCancel();
  if (session_thread_.joinable()) session_thread_.join();
}

}  // namespace refit
