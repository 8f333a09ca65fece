// The node's peak while a large worker registers stays within a small multiple of the
// registration's wire size: one worker of 400,000 pieces (about 19 MB on the wire), sent encoded by
// the worker library (RegisterWorkerRequest.worker_encoded), registers on a node of a two-daemon
// cluster (tests/bench/registration_memory.h). The node's VmHWM may exceed its resident size
// before registering by at most 4x the wire size plus 16 MB of slack (gRPC's buffers, thread
// arenas; measured 4.1x). Before the worker was sent encoded, gRPC decoded it into a message per
// buffer, piece and box: about 16x (docs/BENCHMARKS.md, "Registration memory while registering:
// the request as gRPC decodes it"). The coordinator's peak, as it takes the node's sync of that
// worker, is bounded the same way (measured 3.1x): the sync carries each worker encoded
// (worker_encoded), where before the coordinator decoded it as messages, 14.4x.
// Memory, not time: nothing here is timed.
#include <catch2/catch.hpp>

#include "tests/bench/registration_memory.h"

namespace refit {
namespace {

TEST_CASE(
    "a node's and its coordinator's peaks while a large worker registers are a few times its wire "
    "size") {
  RegistrationMemoryOptions o;
  o.refitd = "daemon/refitd";
  o.pieces = 400000;
  o.settle_seconds = 1.0;
  auto m = MeasureRegistration(o);
  REQUIRE(m.ok());
  const int64_t slack = int64_t{16} << 20;
  INFO("wire " << m->wire_bytes << " B; node peak +" << m->node.peak() << " ("
               << static_cast<double>(m->node.peak()) / static_cast<double>(m->wire_bytes)
               << "x), coordinator peak +" << m->coordinator.peak() << " ("
               << static_cast<double>(m->coordinator.peak()) / static_cast<double>(m->wire_bytes)
               << "x)");
  REQUIRE(m->wire_bytes > (int64_t{16} << 20));
  CHECK(m->node.peak() <= 4 * m->wire_bytes + slack);
  CHECK(m->coordinator.peak() <= 4 * m->wire_bytes + slack);
}

}  // namespace
}  // namespace refit
