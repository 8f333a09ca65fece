// How fast one GPU copies through memory another process exported: refitd reaches
// workers' weights through legacy CUDA IPC handles (cudaMalloc memory: PyTorch's caching
// allocator) or CUDA VMM file descriptors (expandable segments, engines' sleep modes), and a
// colocated refit on IPC memory ran at a third of the speed it reached on VMM memory.
// A child process allocates a source and a destination of each kind and exports them; this
// process imports them as refitd does (cudaIpcOpenMemHandle; cuMemImportFromShareableHandle +
// cuMemMap) and times, per size, the copy engine (cudaMemcpyAsync) and refit's copy kernel
// (LaunchCopyItems, one item, 16 KiB units) on its own memory, IPC memory and VMM memory, and
// with one end imported and the other its own. Medians of --repeat after 3 warm-up runs; one
// JSON line per (size, memory, method).
// With --src/--dst (a colocated refit's layouts, every worker on GPU 0): refit's own direct work
// (DirectWork, one launch per stage) on each worker's buffers in one allocation per worker, as
// sim-worker-cuda holds them (buffers 256-byte aligned, back to back), allocated here, or by the
// child and imported through IPC, the allocation's size as is or rounded up to 2 MiB.
// Then, on its own memory: how long the host takes to see a 1 GiB copy done after the GPU
// finished it, by cudaStreamQuery in a loop, cudaEventQuery, cudaStreamSynchronize, and a flag
// the GPU writes into mapped host memory; and how soon the GPU sees a word the host writes into
// mapped host memory (host_word: what lets an armed round go).
//   ipc_copy_bench [--max-mib 8192] [--sizes-mib 64,1024,8192] [--repeat 7] [--src T.json --dst
//   I.json]
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/copy_items.h"
#include "kernels/copy_kernels.h"
#include "plan/planner.h"
#include "proto/layout_codec.h"

namespace {

#define CHECK_CUDA(x)                                                                         \
  do {                                                                                        \
    const cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CHECK_CU(x)                                                           \
  do {                                                                        \
    const CUresult r_ = (x);                                                  \
    if (r_ != CUDA_SUCCESS) {                                                 \
      std::fprintf(stderr, "%s:%d %s: CUresult %d\n", __FILE__, __LINE__, #x, \
                   static_cast<int>(r_));                                     \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

// What the child hands over: two IPC handles (source, destination) and two VMM descriptors.
struct Exported {
  cudaIpcMemHandle_t ipc[2];
  size_t vmm_bytes = 0;
};

// Layout mode: per worker of both layouts, its allocation's handle, as is and rounded to 2 MiB.
constexpr int kMaxWorkers = 64;
struct ExportedWorkers {
  int n = 0;
  cudaIpcMemHandle_t exact[kMaxWorkers];
  cudaIpcMemHandle_t rounded[kMaxWorkers];
};

// One allocation per worker: its buffers back to back, each 256-byte aligned (sim-worker-cuda's).
struct WorkerBytes {
  std::vector<int64_t> total;  // per worker (src workers first, then dst)
  std::vector<std::vector<int64_t>>
      offsets;  // per layout, per buffer: its offset in its worker's allocation
  std::vector<std::vector<int>> owner;  // per layout, per buffer: index into total
};

WorkerBytes Allocations(const refit::Layout& src, const refit::Layout& dst) {
  WorkerBytes w;
  int base = 0;
  for (const refit::Layout* l : {&src, &dst}) {
    std::vector<int64_t> used(l->workers.size(), 0);
    w.offsets.emplace_back();
    w.owner.emplace_back();
    for (const refit::Buffer& b : l->buffers) {
      w.offsets.back().push_back(used[b.worker]);
      w.owner.back().push_back(base + b.worker);
      used[b.worker] += (b.NumBytes() + 255) / 256 * 256;
    }
    for (int64_t u : used) w.total.push_back(std::max<int64_t>(u, 256));
    base += static_cast<int>(l->workers.size());
  }
  return w;
}

int64_t Round2M(int64_t b) { return (b + (2 << 20) - 1) / (2 << 20) * (2 << 20); }

struct LayoutCase {
  refit::Layout src, dst;
  refit::Plan plan;
  WorkerBytes workers;
};

void SendWithFds(int sock, const void* data, size_t size, const int* fds, int n) {
  iovec iov{const_cast<void*>(data), size};
  char control[CMSG_SPACE(sizeof(int) * 2)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * n);
  cmsghdr* h = CMSG_FIRSTHDR(&msg);
  h->cmsg_level = SOL_SOCKET;
  h->cmsg_type = SCM_RIGHTS;
  h->cmsg_len = CMSG_LEN(sizeof(int) * n);
  std::memcpy(CMSG_DATA(h), fds, sizeof(int) * n);
  if (sendmsg(sock, &msg, 0) != static_cast<ssize_t>(size)) std::exit(1);
}

void ReceiveWithFds(int sock, void* data, size_t size, int* fds, int n) {
  iovec iov{data, size};
  char control[CMSG_SPACE(sizeof(int) * 2)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  if (recvmsg(sock, &msg, MSG_WAITALL) != static_cast<ssize_t>(size)) {
    std::fprintf(stderr, "the exporting child died\n");
    std::exit(1);
  }
  cmsghdr* h = CMSG_FIRSTHDR(&msg);
  if (h == nullptr || h->cmsg_type != SCM_RIGHTS) std::exit(1);
  std::memcpy(fds, CMSG_DATA(h), sizeof(int) * n);
}

CUmemAllocationProp VmmProp() {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

size_t RoundUp(size_t bytes) {
  CUmemAllocationProp prop = VmmProp();
  size_t g = 0;
  CHECK_CU(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  return (bytes + g - 1) / g * g;
}

// The exporting process: allocates, exports, waits for the importer to finish.
int Child(int sock, size_t bytes, const WorkerBytes* workers) {
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaFree(nullptr));
  if (workers != nullptr) {
    ExportedWorkers x;
    x.n = static_cast<int>(workers->total.size());
    for (int i = 0; i < x.n; ++i) {
      for (bool round : {false, true}) {
        void* p = nullptr;
        const int64_t b = round ? Round2M(workers->total[i]) : workers->total[i];
        CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(b)));
        CHECK_CUDA(cudaMemset(p, 1, static_cast<size_t>(b)));
        CHECK_CUDA(cudaIpcGetMemHandle(round ? &x.rounded[i] : &x.exact[i], p));
      }
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    if (write(sock, &x, sizeof x) != static_cast<ssize_t>(sizeof x)) std::exit(1);
  }
  Exported e;
  int fds[2];
  for (int i = 0; i < 2; ++i) {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, bytes));
    CHECK_CUDA(cudaMemset(p, i, bytes));
    CHECK_CUDA(cudaIpcGetMemHandle(&e.ipc[i], p));
    CUmemAllocationProp prop = VmmProp();
    e.vmm_bytes = RoundUp(bytes);
    CUmemGenericAllocationHandle h;
    CHECK_CU(cuMemCreate(&h, e.vmm_bytes, &prop, 0));
    CHECK_CU(cuMemExportToShareableHandle(&fds[i], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  SendWithFds(sock, &e, sizeof e, fds, 2);
  // Until the importer is finished (or gone): on 'w', some GPU work of this process's own (as a
  // worker writes its weights before a round), answered when it is done.
  void* scratch = nullptr;
  CHECK_CUDA(cudaMalloc(&scratch, 64 << 20));
  char c = 0;
  while (read(sock, &c, 1) == 1 && c == 'w') {
    CHECK_CUDA(cudaMemset(scratch, c, 64 << 20));
    CHECK_CUDA(cudaDeviceSynchronize());
    if (write(sock, &c, 1) != 1) break;
  }
  return 0;
}

float TimeMs(cudaStream_t s, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaEventRecord(a, s));
  fn();
  CHECK_CUDA(cudaEventRecord(b, s));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

struct KernelWork {
  refit::CopyItem* items = nullptr;
  int64_t* begin = nullptr;
  int64_t units = 0;
};

// One bf16 item of `bytes`, cut into 16 KiB units, as DirectWork cuts one contiguous run.
KernelWork OneItem(uint64_t src, uint64_t dst, size_t bytes) {
  refit::CopyItem it;
  it.src = src;
  it.dst = dst;
  it.inner = static_cast<int64_t>(bytes / 2);
  it.segment = 8192;
  it.segments = (it.inner + it.segment - 1) / it.segment;
  it.src_dtype = it.dst_dtype = static_cast<uint8_t>(refit::DType::kBF16);
  const int64_t begin[2] = {0, it.Units()};
  KernelWork w;
  w.units = it.Units();
  CHECK_CUDA(cudaMalloc(&w.items, sizeof it));
  CHECK_CUDA(cudaMalloc(&w.begin, sizeof begin));
  CHECK_CUDA(cudaMemcpy(w.items, &it, sizeof it, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(w.begin, begin, sizeof begin, cudaMemcpyHostToDevice));
  return w;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Refit's direct work for one set of worker allocations: one launch per stage, as the cuda
// backend runs a colocated plan.
float TimeDirectWork(const LayoutCase& c, const std::vector<uint64_t>& bases, cudaStream_t stream,
                     int repeat) {
  refit::BufferAddresses sa, da;
  for (size_t b = 0; b < c.src.buffers.size(); ++b)
    sa.push_back(bases[c.workers.owner[0][b]] + c.workers.offsets[0][b]);
  for (size_t b = 0; b < c.dst.buffers.size(); ++b)
    da.push_back(bases[c.workers.owner[1][b]] + c.workers.offsets[1][b]);
  struct Stage {
    refit::CopyItem* items = nullptr;
    int64_t* begin = nullptr;
    int n = 0;
    int64_t units = 0;
    bool spread = false;
    bool aligned = false;
  };
  std::vector<Stage> stages;
  for (int s = 0; s < refit::kMaxStages; ++s) {
    refit::CopyWork w;
    w.unit_begin.push_back(0);
    for (const refit::Message& m : c.plan.messages) {
      if (m.stage == s) refit::AppendWork(refit::DirectWork(c.plan, m, sa, da), w);
    }
    if (w.items.empty()) continue;
    Stage st;
    CHECK_CUDA(cudaMalloc(&st.items, w.items.size() * sizeof(refit::CopyItem)));
    CHECK_CUDA(cudaMalloc(&st.begin, w.unit_begin.size() * sizeof(int64_t)));
    CHECK_CUDA(cudaMemcpy(st.items, w.items.data(), w.items.size() * sizeof(refit::CopyItem),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(st.begin, w.unit_begin.data(), w.unit_begin.size() * sizeof(int64_t),
                          cudaMemcpyHostToDevice));
    st.n = static_cast<int>(w.items.size());
    st.units = w.unit_begin.back();
    st.spread = refit::SpreadPays(w);
    st.aligned = refit::AlignedOnly(w);
    stages.push_back(st);
  }
  std::vector<float> t;
  for (int r = 0; r < repeat + 3; ++r) {
    const float k = TimeMs(stream, [&] {
      for (const Stage& st : stages)
        CHECK_CUDA(refit::LaunchCopyItems(st.items, st.begin, st.n, st.units, stream, st.spread,
                                          st.aligned));
    });
    if (r >= 3) t.push_back(k);
  }
  for (Stage& st : stages) cudaFree(st.items), cudaFree(st.begin);
  return Median(t);
}

void TimeLayouts(const LayoutCase& c, const ExportedWorkers& x, cudaStream_t stream, int repeat) {
  const size_t n = c.workers.total.size();
  std::vector<uint64_t> own(n), own2m(n), ipc(n), ipc2m(n);
  for (size_t i = 0; i < n; ++i) {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(c.workers.total[i])));
    own[i] = reinterpret_cast<uint64_t>(p);
    CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(Round2M(c.workers.total[i]))));
    own2m[i] = reinterpret_cast<uint64_t>(p);
    CHECK_CUDA(cudaIpcOpenMemHandle(&p, x.exact[i], cudaIpcMemLazyEnablePeerAccess));
    ipc[i] = reinterpret_cast<uint64_t>(p);
    CHECK_CUDA(cudaIpcOpenMemHandle(&p, x.rounded[i], cudaIpcMemLazyEnablePeerAccess));
    ipc2m[i] = reinterpret_cast<uint64_t>(p);
  }
  const int64_t bytes = c.plan.stats.bytes_total;
  std::vector<float> tc;
  for (int r = 0; r < repeat + 3; ++r) {
    const float ms = TimeMs(stream, [&] {
      CHECK_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(own2m[n - 1]),
                                 reinterpret_cast<void*>(own2m[0]),
                                 static_cast<size_t>(std::min<int64_t>(
                                     bytes, std::min(c.workers.total[0], c.workers.total[n - 1]))),
                                 cudaMemcpyDeviceToDevice, stream));
    });
    if (r >= 3) tc.push_back(ms);
  }
  const int64_t memcpy_bytes =
      std::min<int64_t>(bytes, std::min(c.workers.total[0], c.workers.total[n - 1]));
  const double ceiling_ms =
      Median(tc) * static_cast<double>(bytes) / static_cast<double>(memcpy_bytes);
  for (auto [name, bases] : {std::pair{"own", &own}, std::pair{"own_2mib", &own2m},
                             std::pair{"ipc", &ipc}, std::pair{"ipc_2mib", &ipc2m}}) {
    const float ms = TimeDirectWork(c, *bases, stream, repeat);
    std::printf(
        "{\"bench\":\"ipc_copy_layout\",\"bytes\":%lld,\"memory\":\"%s\",\"runs\":%d,\"kernel_ms\":"
        "%.4f,"
        "\"ceiling_ms\":%.4f,\"of_ceiling\":%.3f}\n",
        static_cast<long long>(bytes), name, repeat, ms, ceiling_ms, ceiling_ms / ms);
    std::fflush(stdout);
  }
}

// How long after the GPU finished a 1 GiB copy the host sees it, by each way of looking: the
// host's time from just before the launch to seeing it done, minus the GPU's own time for the
// copy (events around it on the stream); medians.
void TimeSync(int sock, uint64_t a, uint64_t b, size_t bytes, cudaStream_t stream, int repeat) {
  KernelWork w = OneItem(a, b, bytes);
  int* flag = nullptr;
  CHECK_CUDA(cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped));
  int* device_flag = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(&device_flag, flag, 0));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  using Clock = std::chrono::steady_clock;
  auto us = [](Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); };
  // From the fifth: stream queries again, right after the other process ran GPU work of its own
  // (the GPU switches between processes' contexts: what a refit pays after the workers' PREPARE);
  // the same with the copy engine instead of the kernel (does it switch as slowly?); and with a
  // small kernel of this process's own run to completion first (the switch taken before the copy,
  // as refitd could while it waits for TRANSFER).
  const char* methods[] = {"stream_query_spin",
                           "event_query_spin",
                           "stream_synchronize",
                           "mapped_flag_spin",
                           "stream_query_after_other_process",
                           "memcpy_after_other_process",
                           "after_other_process_and_a_small_kernel"};
  KernelWork small = OneItem(a, b, 4096);
  for (int m = 0; m < 7; ++m) {
    std::vector<float> late, launch, query;
    for (int r = 0; r < repeat + 3; ++r) {
      *const_cast<volatile int*>(flag) = 0;
      CHECK_CUDA(cudaStreamSynchronize(stream));
      if (m >= 4) {
        char c = 'w';
        if (write(sock, &c, 1) != 1 || read(sock, &c, 1) != 1) std::exit(1);
      }
      if (m == 6) {
        CHECK_CUDA(refit::LaunchCopyItems(small.items, small.begin, 1, small.units, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
      }
      const auto t0 = Clock::now();
      CHECK_CUDA(cudaEventRecord(e0, stream));
      if (m == 5) {
        CHECK_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(b), reinterpret_cast<void*>(a), bytes,
                                   cudaMemcpyDeviceToDevice, stream));
      } else {
        CHECK_CUDA(refit::LaunchCopyItems(w.items, w.begin, 1, w.units, stream));
      }
      CHECK_CUDA(cudaEventRecord(e1, stream));
      if (m == 3) {
        CHECK_CU(cuStreamWriteValue32(stream, reinterpret_cast<CUdeviceptr>(device_flag),
                                      static_cast<cuuint32_t>(r + 1),
                                      CU_STREAM_WRITE_VALUE_DEFAULT));
      }
      const auto t1 = Clock::now();
      int polls = 0;
      if (m == 0 || m >= 4) {
        while (cudaStreamQuery(stream) == cudaErrorNotReady) ++polls;
      } else if (m == 1) {
        while (cudaEventQuery(e1) == cudaErrorNotReady) ++polls;
      } else if (m == 2) {
        CHECK_CUDA(cudaStreamSynchronize(stream));
      } else {
        while (*const_cast<volatile int*>(flag) != r + 1) ++polls;
      }
      const auto t2 = Clock::now();
      CHECK_CUDA(cudaStreamSynchronize(stream));
      float gpu_ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&gpu_ms, e0, e1));
      if (r >= 3) {
        late.push_back(static_cast<float>(us(t2 - t0) - gpu_ms * 1e3));
        launch.push_back(static_cast<float>(us(t1 - t0)));
        query.push_back(polls > 0 ? static_cast<float>(us(t2 - t1) / polls) : 0.0f);
      }
    }
    std::printf(
        "{\"bench\":\"host_sees_done\",\"method\":\"%s\",\"bytes\":%zu,\"runs\":%d,\"host_minus_"
        "gpu_us\":%.1f,"
        "\"launch_us\":%.1f,\"us_per_poll\":%.2f}\n",
        methods[m], bytes, repeat, Median(late), Median(launch), Median(query));
    std::fflush(stdout);
  }
  cudaFreeHost(flag);
  cudaFree(small.items);
  cudaFree(small.begin);
}

// How soon the GPU sees a word the host writes into mapped host memory (what lets an armed
// round's work go, daemon/dataplane/cuda/cuda_backend.cc): the stream waits for the word
// (cuStreamWaitValue32), then writes a second mapped word back (cuStreamWriteValue32), optionally
// after a one-thread kernel (the armed round's gate); the host writes the first and spins on the
// second. The round trip, less mapped_flag_spin's GPU-to-host part, is the host-to-GPU latency.
// Medians, in us.
void TimeHostWord(cudaStream_t stream, int repeat) {
  uint32_t *word = nullptr, *back = nullptr, *word_dev = nullptr, *back_dev = nullptr,
           *gate = nullptr;
  CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&word), sizeof(uint32_t), cudaHostAllocMapped));
  CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&back), sizeof(uint32_t), cudaHostAllocMapped));
  CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&word_dev), word, 0));
  CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&back_dev), back, 0));
  CHECK_CUDA(cudaMalloc(&gate, sizeof(uint32_t)));
  *reinterpret_cast<volatile uint32_t*>(word) = 0;
  *reinterpret_cast<volatile uint32_t*>(back) = 0;
  using Clock = std::chrono::steady_clock;
  uint32_t value = 0;
  for (int with_gate = 0; with_gate < 2; ++with_gate) {
    std::vector<float> trip;
    for (int r = 0; r < repeat + 3; ++r) {
      ++value;
      CHECK_CU(cuStreamWaitValue32(stream, reinterpret_cast<CUdeviceptr>(word_dev), value,
                                   CU_STREAM_WAIT_VALUE_GEQ));
      if (with_gate) CHECK_CUDA(refit::LaunchGate(word_dev, value, gate, nullptr, stream));
      CHECK_CU(cuStreamWriteValue32(stream, reinterpret_cast<CUdeviceptr>(back_dev), value,
                                    CU_STREAM_WRITE_VALUE_DEFAULT));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the wait in place, the GPU idle
      const auto t0 = Clock::now();
      std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_release);
      while (*const_cast<volatile uint32_t*>(back) != value) {
      }
      const auto t1 = Clock::now();
      if (r >= 3)
        trip.push_back(
            static_cast<float>(std::chrono::duration<double, std::micro>(t1 - t0).count()));
      CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    std::printf("{\"bench\":\"host_word\",\"method\":\"%s\",\"runs\":%d,\"round_trip_us\":%.1f}\n",
                with_gate ? "wait_gate_kernel_write_back" : "wait_write_back", repeat,
                Median(trip));
    std::fflush(stdout);
  }
  cudaFreeHost(word);
  cudaFreeHost(back);
  cudaFree(gate);
}

int Parent(int sock, size_t max_bytes, const std::vector<size_t>& sizes, int repeat,
           const LayoutCase* layouts) {
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaFree(nullptr));
  ExportedWorkers workers;
  if (layouts != nullptr &&
      recv(sock, &workers, sizeof workers, MSG_WAITALL) != static_cast<ssize_t>(sizeof workers)) {
    std::fprintf(stderr, "the exporting child died\n");
    return 1;
  }
  Exported e;
  int fds[2];
  ReceiveWithFds(sock, &e, sizeof e, fds, 2);
  struct Pair {
    const char* name;
    uint64_t src, dst;
  };
  void* own[2];
  for (void*& p : own) CHECK_CUDA(cudaMalloc(&p, max_bytes));
  void* ipc[2];
  for (int i = 0; i < 2; ++i)
    CHECK_CUDA(cudaIpcOpenMemHandle(&ipc[i], e.ipc[i], cudaIpcMemLazyEnablePeerAccess));
  CUdeviceptr vmm[2];
  for (int i = 0; i < 2; ++i) {
    CUmemGenericAllocationHandle h;
    CHECK_CU(cuMemImportFromShareableHandle(&h,
                                            reinterpret_cast<void*>(static_cast<uintptr_t>(fds[i])),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CHECK_CU(cuMemAddressReserve(&vmm[i], e.vmm_bytes, 0, 0, 0));
    CHECK_CU(cuMemMap(vmm[i], e.vmm_bytes, 0, h, 0));
    CHECK_CU(cuMemRelease(h));
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK_CU(cuMemSetAccess(vmm[i], e.vmm_bytes, &access, 1));
  }
  auto u = [](const void* p) { return reinterpret_cast<uint64_t>(p); };
  const std::vector<Pair> pairs = {
      {"own", u(own[0]), u(own[1])},
      {"ipc", u(ipc[0]), u(ipc[1])},
      {"vmm", vmm[0], vmm[1]},
      {"ipc_to_own", u(ipc[0]), u(own[1])},
      {"own_to_ipc", u(own[0]), u(ipc[1])},
      {"vmm_to_own", vmm[0], u(own[1])},
  };
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (size_t bytes : sizes) {
    for (const Pair& p : pairs) {
      KernelWork w = OneItem(p.src, p.dst, bytes);
      std::vector<float> tk, tc;
      for (int r = 0; r < repeat + 3; ++r) {
        const float c = TimeMs(stream, [&] {
          CHECK_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(p.dst), reinterpret_cast<void*>(p.src),
                                     bytes, cudaMemcpyDeviceToDevice, stream));
        });
        const float k = TimeMs(stream, [&] {
          CHECK_CUDA(refit::LaunchCopyItems(w.items, w.begin, 1, w.units, stream));
        });
        if (r >= 3) tc.push_back(c), tk.push_back(k);
      }
      cudaFree(w.items);
      cudaFree(w.begin);
      for (auto [method, ms] :
           {std::pair{"memcpy", Median(tc)}, std::pair{"copy_kernel", Median(tk)}}) {
        std::printf(
            "{\"bench\":\"ipc_copy\",\"bytes\":%zu,\"memory\":\"%s\",\"method\":\"%s\",\"runs\":%d,"
            "\"median_ms\":%.4f,\"gbps\":%.1f}\n",
            bytes, p.name, method, repeat, ms, bytes / 1e6 / ms);
      }
      std::fflush(stdout);
    }
  }
  if (layouts != nullptr) TimeLayouts(*layouts, workers, stream, repeat);
  TimeSync(sock, u(own[0]), u(own[1]), std::min<size_t>(max_bytes, size_t{1} << 30), stream,
           repeat);
  TimeHostWord(stream, repeat);
  const char done = 'd';
  (void)!write(sock, &done, 1);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t max_mib = 8192;
  std::vector<size_t> sizes;
  int repeat = 7;
  std::string sizes_flag = "64,1024,8192", src_path, dst_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--max-mib")
      max_mib = std::atoll(value.c_str());
    else if (flag == "--sizes-mib")
      sizes_flag = value;
    else if (flag == "--repeat")
      repeat = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--src")
      src_path = value;
    else if (flag == "--dst")
      dst_path = value;
    else {
      std::fprintf(stderr,
                   "usage: ipc_copy_bench [--max-mib N] [--sizes-mib A,B,...] [--repeat N]\n");
      return 2;
    }
  }
  for (absl::string_view s : absl::StrSplit(sizes_flag, ',')) {
    int64_t v = 0;
    if (absl::SimpleAtoi(s, &v) && v > 0)
      sizes.push_back(static_cast<size_t>(std::min(v, max_mib)) << 20);
  }
  if (sizes.empty() || max_mib <= 0) return 2;
  const size_t max_bytes = static_cast<size_t>(max_mib) << 20;
  std::unique_ptr<LayoutCase> layouts;
  if (!src_path.empty() && !dst_path.empty()) {
    auto src = refit::ReadLayoutFile(src_path, "source");
    auto dst = refit::ReadLayoutFile(dst_path, "destination");
    if (!src.ok() || !dst.ok()) {
      std::fprintf(stderr, "%s\n",
                   std::string((src.ok() ? dst.status() : src.status()).message()).c_str());
      return 2;
    }
    refit::PlanOptions options;
    options.topology.gpus_per_node = 1;
    auto plan = refit::MakePlan(*src, *dst, options);
    if (!plan.ok()) {
      std::fprintf(stderr, "%s\n", std::string(plan.status().message()).c_str());
      return 2;
    }
    layouts = std::make_unique<LayoutCase>();
    layouts->src = *std::move(src);
    layouts->dst = *std::move(dst);
    layouts->plan = *std::move(plan);
    layouts->workers = Allocations(layouts->src, layouts->dst);
    if (layouts->workers.total.size() > static_cast<size_t>(kMaxWorkers)) return 2;
  }
  // Fork before either process touches CUDA (a CUDA context does not survive fork).
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    close(sv[0]);
    return Child(sv[1], max_bytes, layouts ? &layouts->workers : nullptr);
  }
  close(sv[1]);
  const int rc = Parent(sv[0], max_bytes, sizes, repeat, layouts.get());
  int status = 0;
  waitpid(child, &status, 0);
  return rc;
}
