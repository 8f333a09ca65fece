// The ceilings of a 2-GPU node, measured: copy-engine peer copy GPU0 -> GPU1, the copy kernel
// reading GPU0's memory from GPU1 (what the cuda backend does inside a node), and a local
// device-to-device copy; also both directions at once by copy engine, and NCCL send/recv
// GPU0 -> GPU1 (one process, ncclCommInitAll: what NCCL itself reaches on this link), the same
// with both buffers registered (ncclMemAlloc + ncclCommRegister: NCCL moves user buffer to user
// buffer, no copy through its FIFO), and NCCL's rate when --bytes is cut into operations of
// 1 MiB .. --bytes in one group (what the executor issues: many operations per step). Medians
// of --repeat runs after 3 warm-up runs; one JSON line.
//   peer_bench [--bytes 1073741824] [--repeat 10]
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "kernels/copy_kernels.h"
#include "kernels/cuda_check.h"

namespace refit {
namespace {

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<float> Time(int runs, cudaStream_t s, const std::function<void()>& fn) {
  std::vector<float> out;
  cudaEvent_t a, b;
  REFIT_CUDA_CHECK(cudaEventCreate(&a));
  REFIT_CUDA_CHECK(cudaEventCreate(&b));
  for (int r = 0; r < runs + 3; ++r) {
    REFIT_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    REFIT_CUDA_CHECK(cudaEventRecord(b, s));
    REFIT_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    REFIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 3) out.push_back(ms);
  }
  return out;
}

// Wall-clock milliseconds of `fn` (which must end synchronized), medians after 3 warm-ups.
std::vector<float> WallTime(int runs, const std::function<void()>& fn) {
  std::vector<float> out;
  for (int r = 0; r < runs + 3; ++r) {
    const absl::Time t0 = absl::Now();
    fn();
    if (r >= 3) out.push_back(static_cast<float>(absl::ToDoubleMilliseconds(absl::Now() - t0)));
  }
  return out;
}

void NcclCheck(ncclResult_t r) {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "peer_bench: NCCL: %s\n", ncclGetErrorString(r));
    std::exit(1);
  }
}

// GPU0 -> GPU1 by NCCL: `bytes` cut into operations of `op_bytes`, all in one group.
std::vector<float> NcclSendRecv(int repeat, ncclComm_t comms[2], void* from, void* to,
                                int64_t bytes, int64_t op_bytes, cudaStream_t s0, cudaStream_t s1) {
  return WallTime(repeat, [&] {
    NcclCheck(ncclGroupStart());
    for (int64_t at = 0; at < bytes; at += op_bytes) {
      const size_t n = static_cast<size_t>(std::min(op_bytes, bytes - at));
      REFIT_CUDA_CHECK(cudaSetDevice(0));
      NcclCheck(ncclSend(static_cast<char*>(from) + at, n, ncclUint8, 1, comms[0], s0));
      REFIT_CUDA_CHECK(cudaSetDevice(1));
      NcclCheck(ncclRecv(static_cast<char*>(to) + at, n, ncclUint8, 0, comms[1], s1));
    }
    NcclCheck(ncclGroupEnd());
    REFIT_CUDA_CHECK(cudaStreamSynchronize(s0));
    REFIT_CUDA_CHECK(cudaStreamSynchronize(s1));
  });
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  int64_t bytes = int64_t{1} << 30;
  int repeat = 10;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--bytes") bytes = std::atoll(argv[i + 1]);
    if (std::string(argv[i]) == "--repeat") repeat = std::max(1, std::atoi(argv[i + 1]));
  }
  if (GpuCount() < 2) {
    std::fprintf(stderr, "peer_bench: needs 2 GPUs\n");
    return 1;
  }
  REFIT_CUDA_CHECK(cudaSetDevice(1));
  cudaError_t e = cudaDeviceEnablePeerAccess(0, 0);
  if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) REFIT_CUDA_CHECK(e);
  cudaGetLastError();
  REFIT_CUDA_CHECK(cudaSetDevice(0));
  DeviceBuffer on0(bytes);
  REFIT_CUDA_CHECK(cudaMemset(on0.get(), 1, bytes));
  REFIT_CUDA_CHECK(cudaSetDevice(1));
  DeviceBuffer on1(bytes), other1(bytes);
  cudaStream_t s;
  REFIT_CUDA_CHECK(cudaStreamCreate(&s));
  // One item: the whole buffer as one run, in 16 KiB units, read from GPU0 by GPU1's kernel.
  CopyItem it;
  it.src = on0.address();
  it.dst = on1.address();
  it.inner = bytes / 2;
  it.src_dtype = it.dst_dtype = 0;  // bf16
  it.segment = 8192;
  it.segments = (it.inner + it.segment - 1) / it.segment;
  const int64_t begin[2] = {0, it.Units()};
  DeviceBuffer items(sizeof it), units(sizeof begin);
  REFIT_CUDA_CHECK(cudaMemcpy(items.get(), &it, sizeof it, cudaMemcpyHostToDevice));
  REFIT_CUDA_CHECK(cudaMemcpy(units.get(), begin, sizeof begin, cudaMemcpyHostToDevice));
  const auto peer = Time(repeat, s, [&] {
    REFIT_CUDA_CHECK(cudaMemcpyPeerAsync(on1.get(), 1, on0.get(), 0, bytes, s));
  });
  const auto kernel = Time(repeat, s, [&] {
    REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<CopyItem*>(items.get()),
                                     static_cast<int64_t*>(units.get()), 1, it.Units(), s));
  });
  const auto local = Time(repeat, s, [&] {
    REFIT_CUDA_CHECK(cudaMemcpyAsync(other1.get(), on1.get(), bytes, cudaMemcpyDeviceToDevice, s));
  });
  // Both directions at once (the colocated case moves data both ways).
  REFIT_CUDA_CHECK(cudaSetDevice(0));
  cudaError_t e0 = cudaDeviceEnablePeerAccess(1, 0);
  if (e0 != cudaSuccess && e0 != cudaErrorPeerAccessAlreadyEnabled) REFIT_CUDA_CHECK(e0);
  cudaGetLastError();
  DeviceBuffer back0(bytes);
  cudaStream_t s0;
  REFIT_CUDA_CHECK(cudaStreamCreate(&s0));
  const auto bidir = WallTime(repeat, [&] {
    REFIT_CUDA_CHECK(cudaMemcpyPeerAsync(on1.get(), 1, on0.get(), 0, bytes, s));
    REFIT_CUDA_CHECK(cudaMemcpyPeerAsync(back0.get(), 0, other1.get(), 1, bytes, s0));
    REFIT_CUDA_CHECK(cudaStreamSynchronize(s));
    REFIT_CUDA_CHECK(cudaStreamSynchronize(s0));
  });
  // NCCL send/recv GPU0 -> GPU1: one operation, then cut into smaller operations.
  ncclComm_t comms[2];
  const int devices[2] = {0, 1};
  NcclCheck(ncclCommInitAll(comms, 2, devices));
  const auto nccl = NcclSendRecv(repeat, comms, on0.get(), on1.get(), bytes, bytes, s0, s);
  std::string by_op_size;
  for (int64_t op = int64_t{1} << 20; op < bytes; op *= 4) {
    const auto t =
        NcclSendRecv(std::max(3, repeat / 2), comms, on0.get(), on1.get(), bytes, op, s0, s);
    by_op_size += (by_op_size.empty() ? "" : ",") + std::string("\"") + std::to_string(op) +
                  "\":" + std::to_string(bytes / 1e9 / (Median(t) / 1e3));
  }
  // The same with both buffers allocated by NCCL and registered with the communicators.
  void* reg0 = nullptr;
  void* reg1 = nullptr;
  void* handles[2] = {nullptr, nullptr};
  REFIT_CUDA_CHECK(cudaSetDevice(0));
  NcclCheck(ncclMemAlloc(&reg0, static_cast<size_t>(bytes)));
  REFIT_CUDA_CHECK(cudaMemset(reg0, 1, bytes));
  NcclCheck(ncclCommRegister(comms[0], reg0, static_cast<size_t>(bytes), &handles[0]));
  REFIT_CUDA_CHECK(cudaSetDevice(1));
  NcclCheck(ncclMemAlloc(&reg1, static_cast<size_t>(bytes)));
  REFIT_CUDA_CHECK(
      cudaMemset(reg1, 0, bytes));  // poisoned: the check below must see every byte arrive
  NcclCheck(ncclCommRegister(comms[1], reg1, static_cast<size_t>(bytes), &handles[1]));
  const auto registered = NcclSendRecv(repeat, comms, reg0, reg1, bytes, bytes, s0, s);
  const auto registered_64m =
      NcclSendRecv(repeat, comms, reg0, reg1, bytes, std::min<int64_t>(bytes, 64 << 20), s0, s);
  // Registered buffers must arrive intact (a broken registration would not fail otherwise).
  std::vector<unsigned char> check(static_cast<size_t>(bytes));
  REFIT_CUDA_CHECK(cudaMemcpy(check.data(), reg1, bytes, cudaMemcpyDeviceToHost));
  const bool registered_exact =
      std::all_of(check.begin(), check.end(), [](unsigned char c) { return c == 1; });
  ncclCommDeregister(comms[0], handles[0]);
  ncclCommDeregister(comms[1], handles[1]);
  ncclMemFree(reg0);
  ncclMemFree(reg1);
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  const double gb = bytes / 1e9;
  std::printf(
      "{\"bytes\":%lld,\"runs\":%d,\"peer_copy_engine_ms\":%.3f,\"peer_copy_engine_gbps\":%.1f,"
      "\"peer_kernel_ms\":%.3f,\"peer_kernel_gbps\":%.1f,\"kernel_vs_copy_engine\":%.3f,"
      "\"local_d2d_ms\":%.3f,\"local_d2d_gbps\":%.1f,\"bidirectional_copy_engine_gbps_each_way\":%."
      "1f,"
      "\"nccl_send_recv_ms\":%.3f,\"nccl_send_recv_gbps\":%.1f,\"nccl_gbps_by_op_bytes\":{%s},"
      "\"nccl_registered_gbps\":%.1f,\"nccl_registered_64m_ops_gbps\":%.1f,\"nccl_registered_"
      "exact\":%s}\n",
      (long long)bytes, repeat, Median(peer), gb / (Median(peer) / 1e3), Median(kernel),
      gb / (Median(kernel) / 1e3), Median(peer) / Median(kernel), Median(local),
      gb / (Median(local) / 1e3), gb / (Median(bidir) / 1e3), Median(nccl),
      gb / (Median(nccl) / 1e3), by_op_size.c_str(), gb / (Median(registered) / 1e3),
      gb / (Median(registered_64m) / 1e3), registered_exact ? "true" : "false");
  return registered_exact ? 0 : 1;
}
