// The machines a plan runs on, as the cost model sees them.
#pragma once

#include <cstdint>

namespace refit {

// Bandwidths are per direction, in GB/s (10^9 bytes per second); latencies per message.
// The defaults describe an H100/H200 node: 8 GPUs on NVLink 4, one 400 Gb/s NIC per GPU.
struct Topology {
  int32_t gpus_per_node = 8;
  int32_t nics_per_node = 8;   // GPU g of a node uses NIC g * nics_per_node / gpus_per_node
  double nvlink_gbps = 450.0;  // per GPU, each way
  double nic_gbps = 50.0;      // per NIC, each way
  double local_copy_gbps =
      2000.0;  // a device-to-device copy on one GPU (read + write counted once)
  double network_latency_us = 10.0;
  double nvlink_latency_us = 3.0;

  int32_t NicOf(int32_t gpu) const {
    return gpus_per_node > 0 ? gpu * nics_per_node / gpus_per_node : 0;
  }
};

}  // namespace refit
