// WatchRounds tells its caller when the stream is open (every round state change published from
// then on is sent): the daemon sends this initial metadata before any round. Without it a caller
// cannot tell a stream that is open and quiet from one still on its way, and could start a round
// the stream misses.
#pragma once

namespace refit {

inline constexpr char kWatchOpenKey[] = "refit-watch";
inline constexpr char kWatchOpenValue[] = "open";

}  // namespace refit
