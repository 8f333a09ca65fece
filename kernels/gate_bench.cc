// How soon work launched ahead runs once the host lets it go (an armed colocated
// round). Per mode, one copy of --bytes through LaunchCopyItems, launched ahead behind a gate,
// then, after --idle-us, let go by the host's store into mapped host memory; the host spins on
// the copy's end event. Reports, medians of --repeat after 3 warm-up runs: from the store to the
// host seeing the copy done (let_go_to_done_us), the copy's own GPU time between its events
// (copy_us), and the difference (overhead_us: the gate's wake-up, the launches after it, the
// host seeing it done). Modes:
//   wait_gate:    cuStreamWaitValue32 on the word, then LaunchGate's kernel (refitd today);
//   wait_only:    cuStreamWaitValue32, the gate set to go before it (no kernel between);
//   spin_gate_N:  LaunchWaitingGate, its thread reading the word every N ns (no stream wait);
//   unarmed:      nothing ahead: the host launches the copy when it lets go.
//   gate_bench [--bytes 1048576,1073741824] [--repeat 20] [--idle-us 2000] [--sleep-ns 0,200,1000]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/copy_kernels.h"
#include "kernels/cuda_check.h"

namespace refit {
namespace {

using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double NowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Copy {
  DeviceBuffer src, dst, items, units;
  int64_t total_units = 0;
  explicit Copy(size_t bytes)
      : src(bytes), dst(bytes), items(sizeof(CopyItem)), units(2 * sizeof(int64_t)) {
    CopyItem it;
    it.src = src.address();
    it.dst = dst.address();
    it.inner = static_cast<int64_t>(bytes / 2);
    it.src_dtype = it.dst_dtype = 0;  // bf16
    it.segment = 8192;                // 16 KiB units, as refitd cuts long runs
    it.segments = (it.inner + it.segment - 1) / it.segment;
    total_units = it.Units();
    const int64_t begin[2] = {0, total_units};
    REFIT_CUDA_CHECK(cudaMemcpy(items.get(), &it, sizeof it, cudaMemcpyHostToDevice));
    REFIT_CUDA_CHECK(cudaMemcpy(units.get(), begin, sizeof begin, cudaMemcpyHostToDevice));
    REFIT_CUDA_CHECK(cudaMemset(src.get(), 1, bytes));
  }
  void Launch(cudaStream_t s, const uint32_t* gate, uint32_t go) const {
    REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<CopyItem*>(items.get()),
                                     static_cast<int64_t*>(units.get()), 1, total_units, s, true,
                                     true, gate, go));
  }
};

int Run(const std::vector<int64_t>& sizes, int repeat, int idle_us,
        const std::vector<int64_t>& sleeps) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  REFIT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 11070,
                                                    cudaEnableDefault, &found));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "gate_bench: no cuStreamWaitValue32\n");
    return 1;
  }
  const auto wait_value = reinterpret_cast<WaitValueFn>(fn);
  uint32_t *word = nullptr, *decided = nullptr, *word_d = nullptr, *decided_d = nullptr;
  REFIT_CUDA_CHECK(cudaHostAlloc(&word, sizeof(uint32_t), cudaHostAllocMapped));
  REFIT_CUDA_CHECK(cudaHostAlloc(&decided, sizeof(uint32_t), cudaHostAllocMapped));
  REFIT_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&word_d), word, 0));
  REFIT_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&decided_d), decided, 0));
  DeviceBuffer gate(sizeof(uint32_t));
  auto* gate_d = static_cast<uint32_t*>(gate.get());
  cudaStream_t s;
  REFIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t start, end;
  REFIT_CUDA_CHECK(cudaEventCreate(&start));
  REFIT_CUDA_CHECK(cudaEventCreate(&end));
  auto wait = [&](uint32_t value) {
    if (wait_value(s, reinterpret_cast<CUdeviceptr>(word_d), value, CU_STREAM_WAIT_VALUE_GEQ) !=
        CUDA_SUCCESS) {
      std::fprintf(stderr, "gate_bench: cuStreamWaitValue32 failed\n");
      std::abort();
    }
  };
  std::vector<std::string> modes = {"unarmed", "wait_gate", "wait_only"};
  for (int64_t ns : sleeps) modes.push_back("spin_gate_" + std::to_string(ns));
  uint32_t go = 2;
  for (int64_t bytes : sizes) {
    Copy copy(static_cast<size_t>(bytes));
    for (const std::string& mode : modes) {
      std::vector<double> total, gpu;
      for (int r = 0; r < repeat + 3; ++r) {
        go += 2;
        const bool armed = mode != "unarmed";
        if (mode == "wait_gate") {
          wait(go);
          REFIT_CUDA_CHECK(LaunchGate(word_d, go, gate_d, decided_d, s));
        } else if (mode == "wait_only") {
          REFIT_CUDA_CHECK(cudaMemcpyAsync(gate_d, &go, sizeof go, cudaMemcpyHostToDevice, s));
          wait(go);
        } else if (armed) {
          const unsigned ns =
              static_cast<unsigned>(std::atoll(mode.c_str() + std::string("spin_gate_").size()));
          REFIT_CUDA_CHECK(LaunchWaitingGate(word_d, go, gate_d, decided_d, ns, s));
        }
        if (armed) {
          REFIT_CUDA_CHECK(cudaEventRecord(start, s));
          copy.Launch(s, gate_d, go);
          REFIT_CUDA_CHECK(cudaEventRecord(end, s));
        }
        // The workers preparing: the GPU idle, the armed work waiting.
        std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
        const double t0 = NowUs();
        if (armed) {
          std::atomic_thread_fence(std::memory_order_seq_cst);
          *reinterpret_cast<volatile uint32_t*>(word) = go;
          std::atomic_thread_fence(std::memory_order_seq_cst);
        } else {
          REFIT_CUDA_CHECK(cudaEventRecord(start, s));
          copy.Launch(s, nullptr, 0);
          REFIT_CUDA_CHECK(cudaEventRecord(end, s));
        }
        cudaError_t q;
        while ((q = cudaEventQuery(end)) == cudaErrorNotReady) {
        }
        REFIT_CUDA_CHECK(q);
        const double t1 = NowUs();
        float ms = 0;
        REFIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
        if (r >= 3) total.push_back(t1 - t0), gpu.push_back(ms * 1e3);
      }
      std::vector<double> over;
      for (size_t i = 0; i < total.size(); ++i) over.push_back(total[i] - gpu[i]);
      std::printf(
          "{\"bench\":\"gate\",\"mode\":\"%s\",\"bytes\":%lld,\"runs\":%d,\"idle_us\":%d,"
          "\"let_go_to_done_us\":%.2f,\"copy_us\":%.2f,\"overhead_us\":%.2f}\n",
          mode.c_str(), static_cast<long long>(bytes), repeat, idle_us, Median(total), Median(gpu),
          Median(over));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {1 << 20, 1 << 30}, sleeps = {0, 200, 1000};
  int repeat = 20, idle_us = 2000;
  auto list = [](const char* value) {
    std::vector<int64_t> out;
    for (absl::string_view s : absl::StrSplit(value, ',')) {
      int64_t v = 0;
      if (absl::SimpleAtoi(s, &v) && v >= 0) out.push_back(v);
    }
    return out;
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--bytes")
      sizes = list(argv[i + 1]);
    else if (flag == "--sleep-ns")
      sleeps = list(argv[i + 1]);
    else if (flag == "--repeat")
      repeat = std::max(1, std::atoi(argv[i + 1]));
    else if (flag == "--idle-us")
      idle_us = std::max(0, std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "gate_bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (refit::GpuCount() == 0) {
    std::fprintf(stderr, "gate_bench: no GPU\n");
    return 1;
  }
  return refit::Run(sizes, repeat, idle_us, sleeps);
}
