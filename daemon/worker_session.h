// A worker's session: the bidirectional stream over which its daemon sends round events
// (PREPARE, COMMIT, ABORT) and the worker answers (prepared, resumed, refused). The session
// ending means the worker is gone.
//
// On gRPC's synchronous API: a reader thread and the handler's thread (the writer) per session.
// The callback API (a ServerBidiReactor, no thread per session) is the goal; converting the
// service is left for later because the unary methods of RefitWorker would have to move to the
// callback API at the same time (one service is either sync or callback), and the session's
// keepalive behaviour has tests of its own (worker_keepalive_test) to re-prove.
#pragma once

#include <functional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "daemon/worker_registry.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

// Serves one session until the worker, its connection or the daemon ends it. `lost(id, reason)`
// runs when the session ended without the worker having unregistered.
absl::Status RunWorkerSession(WorkerRegistry& registry, grpc::ServerContext* context,
                              grpc::ServerReaderWriter<v1::RoundEvent, v1::WorkerMessage>* stream,
                              const std::function<void(const std::string& id, const std::string& reason)>& lost);

}  // namespace refit
