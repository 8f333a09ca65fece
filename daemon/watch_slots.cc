#include "daemon/watch_slots.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/security/loopback_owner.h"

namespace refit {

WatchCaller WatchCallerOf(const Caller& caller) {
  if (caller.authenticated) {
    if (const std::optional<int32_t> node = NodeOf(caller)) {
      return {absl::StrCat("node ", *node), absl::StrCat("node ", *node, "'s daemon"), false};
    }
    // Sorted: the same certificate names the same caller, whatever order gRPC lists them in.
    std::vector<std::string> names = caller.names;
    std::sort(names.begin(), names.end());
    const std::string shown =
        caller.names.empty() ? std::string("(no name)") : caller.names.front();
    return {absl::StrCat("certificate ", absl::StrJoin(names, ",")),
            absl::StrCat("certificate \"", shown, "\"")};
  }
  if (caller.unix_socket && caller.uid.has_value()) {
    return {absl::StrCat("uid ", *caller.uid),
            absl::StrCat("uid ", *caller.uid, " on the worker socket")};
  }
  if (caller.unix_socket) {
    return {"unix", "the callers on the worker socket whose user is not known"};
  }
  const absl::StatusOr<Endpoint> peer = ParseGrpcPeer(caller.peer);
  if (peer.ok() && IsLoopback(*peer)) {
    return {"loopback", "this daemon's own user (loopback, without TLS)", false};
  }
  // Another host's (a listener opened by --insecure-listen), or a peer gRPC did not name.
  std::string host = peer.ok() ? peer->ToString() : caller.peer;
  if (peer.ok()) host = host.substr(0, host.rfind(':'));  // every connection of one host
  return {absl::StrCat("host ", host), absl::StrCat("host ", host)};
}

WatchSlots::Slot::~Slot() {
  if (slots_ != nullptr) slots_->Release(key_);
}

WatchSlots::Slot& WatchSlots::Slot::operator=(Slot&& o) noexcept {
  if (this != &o) {
    if (slots_ != nullptr) slots_->Release(key_);  // this one's slot goes back
    slots_ = o.slots_;
    key_ = std::move(o.key_);
    o.slots_ = nullptr;
  }
  return *this;
}

absl::StatusOr<WatchSlots::Slot> WatchSlots::Acquire(const WatchCaller& caller) {
  absl::MutexLock lock(&mu_);
  if (open_ >= total_) {
    // Named, the callers holding most: who to ask to close one.
    std::vector<const Held*> holders;
    for (const auto& [key, held] : by_caller_) holders.push_back(&held);
    std::sort(holders.begin(), holders.end(),
              [](const Held* a, const Held* b) { return a->streams > b->streams; });
    std::string most;
    for (size_t i = 0; i < holders.size() && i < 3; ++i)
      absl::StrAppend(&most, i > 0 ? ", " : "", holders[i]->name, ": ", holders[i]->streams);
    return absl::ResourceExhaustedError(
        absl::StrCat("WatchRounds: ", total_,
                     " streams are open on this daemon already, the most it serves (held most by ",
                     most, "); close one"));
  }
  Held& held = by_caller_[caller.key];
  if (caller.capped && held.streams >= per_caller_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("WatchRounds: ", caller.name, " holds ", held.streams,
                     " streams on this daemon already, the most one caller may "
                     "hold at once; close one"));
  }
  held.name = caller.name;
  ++held.streams;
  ++open_;
  return Slot(this, caller.key);
}

void WatchSlots::Release(const std::string& key) {
  absl::MutexLock lock(&mu_);
  --open_;
  if (auto it = by_caller_.find(key); it != by_caller_.end() && --it->second.streams == 0)
    by_caller_.erase(it);
}

int WatchSlots::open() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

int WatchSlots::held_by(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = by_caller_.find(key);
  return it == by_caller_.end() ? 0 : it->second.streams;
}

}  // namespace refit
