// Gives freed heap memory back to the system soon after something large was freed.
// A registration of 10^6 pieces goes through transient messages of hundreds of MB (the request
// gRPC decoded, a node's snapshot for its sync, the coordinator's decoded sync), freed in many
// small chunks that glibc keeps: the daemon's resident memory stayed at every peak it reached.
// RequestTrim is cheap and may be called anywhere: a thread of this file's own calls
// malloc_trim(0) once no request came for 200 ms, outside every lock of the caller. Callers ask
// when the large thing is gone or about to be (a registration's session attached, after its
// sync; a worker dropped; a sync applied, whose request gRPC frees once the handler returns).
#pragma once

#include <cstdint>

namespace refit {

// Registrations this large (bytes on the wire) or larger ask for a trim when they come and go.
inline constexpr int64_t kTrimAfterBytes = int64_t{1} << 20;

void RequestTrim();

}  // namespace refit
