// The ceilings of a 2-GPU node, measured: copy-engine peer copy GPU0 -> GPU1, the copy kernel
// reading GPU0's memory from GPU1 (what the cuda backend does inside a node), and a local
// device-to-device copy. Medians of --repeat runs after 3 warm-up runs; one JSON line.
//   peer_bench [--bytes 1073741824] [--repeat 10]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

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
  const auto peer = Time(repeat, s, [&] { REFIT_CUDA_CHECK(cudaMemcpyPeerAsync(on1.get(), 1, on0.get(), 0, bytes, s)); });
  const auto kernel = Time(repeat, s, [&] {
    REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<CopyItem*>(items.get()), static_cast<int64_t*>(units.get()), 1, it.Units(), s));
  });
  const auto local = Time(repeat, s, [&] { REFIT_CUDA_CHECK(cudaMemcpyAsync(other1.get(), on1.get(), bytes, cudaMemcpyDeviceToDevice, s)); });
  const double gb = bytes / 1e9;
  std::printf("{\"bytes\":%lld,\"runs\":%d,\"peer_copy_engine_ms\":%.3f,\"peer_copy_engine_gbps\":%.1f,"
              "\"peer_kernel_ms\":%.3f,\"peer_kernel_gbps\":%.1f,\"kernel_vs_copy_engine\":%.3f,"
              "\"local_d2d_ms\":%.3f,\"local_d2d_gbps\":%.1f}\n",
              (long long)bytes, repeat, Median(peer), gb / (Median(peer) / 1e3), Median(kernel),
              gb / (Median(kernel) / 1e3), Median(peer) / Median(kernel), Median(local), gb / (Median(local) / 1e3));
  return 0;
}
