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

// One byte span per buffer of a layout, indexed like Layout::buffers; a destination's has the
// plan's scratch buffers after them (Plan::first_scratch_buffer).
using BufferMemory = std::vector<std::span<std::byte>>;

// The quantizing ops (kQuantize, kScale) of descriptor `d` on host memory: reads its region from
// `src` (the region's first element; rows d.src_stride[0] apart), writes codes to `codes` (rows
// `code_stride` apart) and scales to `scales` (block rows `scale_stride` elements apart); either
// may be null. The CPU reference every data plane matches bit for bit.
void QuantizeRegion(const CopyDescriptor& d, const std::byte* src, uint8_t* codes,
                    int64_t code_stride, std::byte* scales, int64_t scale_stride);

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

// Host memory for the plan's scratch buffers, appended to `dst` (which must hold exactly the
// destination layout's buffers): the storage behind the spans.
std::vector<std::vector<std::byte>> AllocateScratch(const Plan& plan, BufferMemory& dst);

// Runs every message, stage by stage. `dst` includes the scratch buffers.
void ExecuteOnHost(const Plan& plan, const BufferMemory& src, const BufferMemory& dst);

}  // namespace refit
