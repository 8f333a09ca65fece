// Large arrays the planner fills once (descriptors, message indices): backed by 2 MiB pages where
// the kernel allows it. Writing fresh memory costs a page fault per 4 KiB page, and on VMs whose
// page tables are shadowed by the host each fault costs several microseconds: several seconds for
// the ~1 GB of a frontier model's descriptors, against a fraction of a second in 2 MiB pages.
#pragma once

#include <cstddef>

namespace refit {

// Advises the kernel to back the whole 2 MiB pages inside [data, data + bytes) with huge pages
// (transparent huge pages, MADV_HUGEPAGE). Only advice: contents are unchanged, and where the
// kernel refuses, memory stays in 4 KiB pages.
void AdviseHugePages(const void* data, size_t bytes);

}  // namespace refit
