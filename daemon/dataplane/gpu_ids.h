// GPUs named the way a worker can name them: by UUID ("GPU-1b2c3d4e-...", what `nvidia-smi -L`
// prints) or by PCI bus id ("0000:3b:00.0"). A worker runs under its own CUDA_VISIBLE_DEVICES, so
// its CUDA index means nothing to the daemon; these names are the same in every process.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace refit {

// One GPU this daemon serves.
struct GpuName {
  int32_t index = 0;       // the daemon's CUDA index
  std::string uuid;        // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lowercase hex
  std::string pci_bus_id;  // as cudaDeviceGetPCIBusId writes it, e.g. "0000:3B:00.0"
};

// "GPU-" and the 16 bytes of cudaDeviceProp.uuid in nvidia-smi's 8-4-4-4-12 grouping.
std::string FormatGpuUuid(std::span<const unsigned char, 16> bytes);

// The index of the GPU `name` denotes: a UUID (case-insensitive, "GPU-" prefix optional) or a PCI
// bus id (case-insensitive; the domain may be omitted, "3b:00.0", or have 8 digits as nvidia-smi
// prints it). INVALID_ARGUMENT listing the GPUs served when none matches.
absl::StatusOr<int32_t> FindGpu(std::span<const GpuName> gpus, const std::string& name);

}  // namespace refit
