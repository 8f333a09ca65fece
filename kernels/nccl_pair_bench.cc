// NCCL send/recv GPU0 -> GPU1 between two processes, as two refit daemons on one host use it
// (peer_bench's NCCL figure is one process driving both GPUs). The ceiling of the disaggregated
// benchmark, and what changes it: operations of 64 MiB instead of one, buffers registered with
// NCCL, and our copy kernel running on both GPUs at the same time (as pack and unpack do in the
// pipelined executor: do they slow the wire? and if NCCL's stream has the GPU's highest
// priority?). Process 1 (the receiver) prints one JSON line of
// medians over --repeat runs after 3 warm-up runs; a received buffer is checked byte for byte.
//   nccl_pair_bench [--bytes 1073741824] [--repeat 10]
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>

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

void Check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "nccl_pair_bench: %s: %s\n", what, ncclGetErrorString(r));
    std::exit(1);
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One rank's side: `bytes` from rank 0 to rank 1, cut into `op_bytes` operations in one group.
void Move(int rank, ncclComm_t comm, char* buffer, int64_t bytes, int64_t op_bytes,
          cudaStream_t s) {
  Check(ncclGroupStart(), "ncclGroupStart");
  for (int64_t at = 0; at < bytes; at += op_bytes) {
    const size_t n = static_cast<size_t>(std::min(op_bytes, bytes - at));
    Check(rank == 0 ? ncclSend(buffer + at, n, ncclUint8, 1, comm, s)
                    : ncclRecv(buffer + at, n, ncclUint8, 0, comm, s),
          "send/recv");
  }
  Check(ncclGroupEnd(), "ncclGroupEnd");
}

// Wall-clock GB/s of `fn` (which ends synchronized); the pairing of sends and receives keeps the
// two processes in step.
double Rate(int repeat, int64_t bytes, const std::function<void()>& fn) {
  std::vector<double> ms;
  for (int r = 0; r < repeat + 3; ++r) {
    const absl::Time t0 = absl::Now();
    fn();
    if (r >= 3) ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
  }
  return bytes / 1e6 / Median(ms);
}

int Run(int rank, int fd, int64_t bytes, int repeat) {
  ncclUniqueId id;
  if (rank == 0) {
    Check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if (write(fd, &id, sizeof id) != sizeof id) return 1;
  } else if (read(fd, &id, sizeof id) != sizeof id) {
    return 1;
  }
  REFIT_CUDA_CHECK(cudaSetDevice(rank));
  ncclComm_t comm;
  Check(ncclCommInitRank(&comm, 2, id, rank), "ncclCommInitRank");
  cudaStream_t s, side, urgent;
  REFIT_CUDA_CHECK(cudaStreamCreate(&s));
  REFIT_CUDA_CHECK(cudaStreamCreate(&side));
  int least = 0, greatest = 0;
  REFIT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  REFIT_CUDA_CHECK(cudaStreamCreateWithPriority(&urgent, cudaStreamNonBlocking, greatest));
  DeviceBuffer plain(bytes);
  REFIT_CUDA_CHECK(cudaMemset(plain.get(), rank == 0 ? 7 : 0, bytes));
  auto* buffer = static_cast<char*>(plain.get());
  auto sync = [&] { REFIT_CUDA_CHECK(cudaStreamSynchronize(s)); };
  const double one = Rate(repeat, bytes, [&] {
    Move(rank, comm, buffer, bytes, bytes, s);
    sync();
  });
  // Every byte of the plain buffer arrived (it was poisoned with 0, sent as 7).
  bool exact = true;
  if (rank == 1) {
    std::vector<char> host(static_cast<size_t>(bytes));
    REFIT_CUDA_CHECK(cudaMemcpy(host.data(), buffer, bytes, cudaMemcpyDeviceToHost));
    exact = std::all_of(host.begin(), host.end(), [](char c) { return c == 7; });
  }
  const double ops64 = Rate(repeat, bytes, [&] {
    Move(rank, comm, buffer, bytes, int64_t{64} << 20, s);
    sync();
  });
  // With our copy kernel moving 1 GiB inside the same GPU on another stream at the same time.
  DeviceBuffer from(bytes), to(bytes);
  CopyItem it;
  it.src = from.address();
  it.dst = to.address();
  it.inner = bytes / 2;
  it.src_dtype = it.dst_dtype = 0;  // bf16
  it.segment = 8192;
  it.segments = (it.inner + it.segment - 1) / it.segment;
  const int64_t begin[2] = {0, it.Units()};
  DeviceBuffer items(sizeof it), units(sizeof begin);
  REFIT_CUDA_CHECK(cudaMemcpy(items.get(), &it, sizeof it, cudaMemcpyHostToDevice));
  REFIT_CUDA_CHECK(cudaMemcpy(units.get(), begin, sizeof begin, cudaMemcpyHostToDevice));
  const double with_copy = Rate(repeat, bytes, [&] {
    REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<CopyItem*>(items.get()),
                                     static_cast<int64_t*>(units.get()), 1, it.Units(), side));
    Move(rank, comm, buffer, bytes, bytes, s);
    sync();
    REFIT_CUDA_CHECK(cudaStreamSynchronize(side));
  });
  // The same, NCCL on a stream of the GPU's highest priority (refitd --nccl-stream-priority): are
  // its blocks then scheduled ahead of the copy kernel's?
  const double with_copy_priority = Rate(repeat, bytes, [&] {
    REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<CopyItem*>(items.get()),
                                     static_cast<int64_t*>(units.get()), 1, it.Units(), side));
    Move(rank, comm, buffer, bytes, bytes, urgent);
    REFIT_CUDA_CHECK(cudaStreamSynchronize(urgent));
    REFIT_CUDA_CHECK(cudaStreamSynchronize(side));
  });
  // Registered: buffers from ncclMemAlloc, registered with the communicator on both sides.
  void* reg = nullptr;
  void* handle = nullptr;
  Check(ncclMemAlloc(&reg, static_cast<size_t>(bytes)), "ncclMemAlloc");
  REFIT_CUDA_CHECK(cudaMemset(reg, rank == 0 ? 7 : 0, bytes));
  Check(ncclCommRegister(comm, reg, static_cast<size_t>(bytes), &handle), "ncclCommRegister");
  const double registered = Rate(repeat, bytes, [&] {
    Move(rank, comm, static_cast<char*>(reg), bytes, bytes, s);
    sync();
  });
  if (rank == 1) {
    std::vector<char> host(static_cast<size_t>(bytes));
    REFIT_CUDA_CHECK(cudaMemcpy(host.data(), reg, bytes, cudaMemcpyDeviceToHost));
    exact = exact && std::all_of(host.begin(), host.end(), [](char c) { return c == 7; });
  }
  ncclCommDeregister(comm, handle);
  ncclMemFree(reg);
  ncclCommDestroy(comm);
  if (rank == 1) {
    std::printf(
        "{\"bytes\":%lld,\"runs\":%d,\"processes\":2,\"nccl_gbps\":%.1f,\"nccl_64m_ops_gbps\":%.1f,"
        "\"nccl_with_copy_kernel_gbps\":%.1f,\"nccl_with_copy_kernel_priority_gbps\":%.1f,"
        "\"nccl_registered_gbps\":%.1f,\"exact\":%s}\n",
        (long long)bytes, repeat, one, ops64, with_copy, with_copy_priority, registered,
        exact ? "true" : "false");
  }
  return exact ? 0 : 1;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  int64_t bytes = int64_t{1} << 30;
  int repeat = 10;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--bytes") bytes = std::atoll(argv[i + 1]);
    if (std::string(argv[i]) == "--repeat") repeat = std::max(1, std::atoi(argv[i + 1]));
  }
  // Fork before any CUDA or NCCL call: the child is rank 1; rank 0 sends it the NCCL id. Each
  // process ends itself after 120 s: a rank whose peer died would otherwise wait in NCCL forever.
  int fds[2];
  if (pipe(fds) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  alarm(120);
  if (child == 0) {
    close(fds[1]);
    return refit::Run(1, fds[0], bytes, repeat);
  }
  close(fds[0]);
  const int rc = refit::Run(0, fds[1], bytes, repeat);
  int status = 0;
  waitpid(child, &status, 0);
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
