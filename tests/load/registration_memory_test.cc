// What a registration costs the daemons stays proportional to its size: one worker
// of 200,000 pieces (about 9 MB on the wire) registers on a node of a two-daemon cluster and
// unregisters (tests/bench/registration_memory.h). Each daemon's resident memory may grow by at
// most 2x the wire size plus 24 MB of slack while it is registered (measured: 1.2x and 1.05x;
// before decoding registrations piece by piece, 34x and 23x; with glibc's fast bins, the
// coordinator 5.8-6.7x in half the runs: the freed decoding stayed resident) and keep at most 2x
// plus 24 MB after it left (before: all of it). Memory, not time: nothing here is timed.
#include "tests/bench/registration_memory.h"

#include <catch2/catch.hpp>

namespace refit {
namespace {

TEST_CASE("a registration's memory is bounded by its wire size, and given back") {
  RegistrationMemoryOptions o;
  o.refitd = "daemon/refitd";
  o.pieces = 200000;
  auto m = MeasureRegistration(o);
  REQUIRE(m.ok());
  const int64_t slack = int64_t{24} << 20;
  INFO("wire " << m->wire_bytes << " B; node +" << m->node.growth() << " (retained "
               << m->node.retained() << "), coordinator +" << m->coordinator.growth()
               << " (retained " << m->coordinator.retained() << ")");
  CHECK(m->wire_bytes > (int64_t{8} << 20));
  for (const DaemonMemory* d : {&m->node, &m->coordinator}) {
    CHECK(d->growth() <= 2 * m->wire_bytes + slack);
    CHECK(d->retained() <= 2 * m->wire_bytes + slack);
  }
}

}  // namespace
}  // namespace refit
