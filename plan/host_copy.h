// The CPU reference data plane: executes a plan's messages on host memory exactly as the GPU data
// plane does (pack a message's descriptors into staging at the wire dtype, move the staging,
// unpack into destinations). The host backend and the verifier run it; GPU kernel tests compare
// against it.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "plan/plan.h"

namespace refit {

// One byte span per buffer of a layout, indexed like Layout::buffers.
using BufferMemory = std::vector<std::span<std::byte>>;

// Gathers `m`'s descriptors into `staging` (resized to m.bytes).
void PackMessage(const Plan& plan, const Message& m, const BufferMemory& src,
                 const BufferMemory& dst, std::vector<std::byte>& staging);
// Scatters `staging` (as produced by PackMessage) into the destinations of `m`.
void UnpackMessage(const Plan& plan, const Message& m, std::span<const std::byte> staging,
                   const BufferMemory& dst);

// Checks that every descriptor stays inside its buffers: a plan from another version or a
// corrupted message must not write out of bounds.
absl::Status CheckDescriptorBounds(const Plan& plan, const BufferMemory& src,
                                   const BufferMemory& dst);

// Runs every message, stage by stage.
void ExecuteOnHost(const Plan& plan, const BufferMemory& src, const BufferMemory& dst);

}  // namespace refit
