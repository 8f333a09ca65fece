// sim-worker: a stand-in trainer or inference process for the local cluster and its tests. It
// holds one worker of a layout file in shared memory and registers it with its node's refitd.
// Trainer: on PREPARE(v) fills its pieces with the values of version v (a function of tensor,
// element and v). Inference: poisons its buffers at start; on COMMIT(v) checks every byte of
// its buffers (pieces hold version v's values, padding is still poison) and reports the result.
//
// With --same-data (benchmarks of big models): every round carries version 1's values, so the
// trainer fills once; the inference side checks its first commit fully and every later one byte
// for byte against that verified copy. Destinations are poisoned at every PREPARE either way.
//
// sim-worker-cuda holds its buffers on the GPU, in one cudaMalloc allocation (exported by CUDA
// IPC), or with --vmm in CUDA VMM memory (cuMemCreate, shareable as POSIX file descriptors, in
// chunks of --vmm-chunk-mb mapped back to back, as PyTorch's expandable segments do), exported as
// file descriptors over the daemon's handle socket.
//
// SIM_WORKER_VMM=1 in the environment makes --vmm the default (sim-worker-cuda).
//
//   sim-worker --daemon unix:/tmp/refitd-2.sock --group policy --role inference
//              --layout engine.json --worker vllm-dp0-tp1 --report /tmp/w.log
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/worker/worker_client.h"
#include "common/cli_flags.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"
#ifdef REFIT_SIM_WORKER_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include "client/worker/cuda_export.h"
#endif

namespace {
std::mutex report_mu;
std::string report_path;

void Report(const std::string& line) {
  std::lock_guard<std::mutex> lock(report_mu);
  std::fprintf(stderr, "sim-worker: %s\n", line.c_str());
  if (!report_path.empty()) std::ofstream(report_path, std::ios::app) << line << "\n";
}
}  // namespace

int main(int argc, char** argv) {
  using namespace refit;
  std::string daemon, group = "policy", role_name, layout_path, worker_name, peer_layout_path;
  int64_t prepare_delay_ms = 0;
  double register_timeout_s = 10;
  bool same_data = false;
#ifdef REFIT_SIM_WORKER_CUDA
  // The environment sets the default, so that the GPU cluster scripts run on VMM memory as they
  // are: SIM_WORKER_VMM=1 bash tests/gpu/colocated.sh.
  bool vmm =
      std::getenv("SIM_WORKER_VMM") != nullptr && std::string(std::getenv("SIM_WORKER_VMM")) == "1";
#else
  bool vmm = false;
#endif
  int64_t vmm_chunk_mb = 20;
  CliFlags flags("sim-worker", "--daemon ADDR --role trainer|inference --layout F --worker NAME");
  flags.String("daemon", &daemon, "the node's refitd: unix:/tmp/refitd-<node>.sock or host:port");
  flags.String("group", &group, "model group");
  flags.String("role", &role_name, "trainer or inference");
  flags.String("layout", &layout_path, "the side's layout JSON (from refit-layout)");
  flags.String("worker", &worker_name, "which worker of the layout this process is");
  flags.String("report", &report_path, "append one line per round event here");
  flags.Int("prepare-delay-ms", &prepare_delay_ms,
            "wait this long before confirming PREPARE (tests)");
  flags.Double("register-timeout", &register_timeout_s,
               "seconds to wait for the daemon to accept the registration");
  flags.String(
      "peer-layout", &peer_layout_path,
      "the other side's layout JSON: values and checks follow the conversions between the two (fp8 "
      "destinations are checked against the CPU reference quantizing each weight whole); without "
      "it both "
      "sides must share dtypes");
  flags.Bool("same-data", &same_data,
             "every round carries version 1's values (fill once, compare to a verified copy)");
  flags.Bool(
      "vmm", &vmm,
      "sim-worker-cuda: buffers in CUDA VMM memory (cuMemCreate), handed over as file descriptors");
  flags.Int("vmm-chunk-mb", &vmm_chunk_mb,
            "with --vmm: MiB per physical allocation (rounded up to the granularity)");
  flags.Parse(argc, argv);
  if (daemon.empty() || layout_path.empty() || worker_name.empty()) {
    flags.Fail("--daemon, --layout and --worker are required");
  }
  if (role_name != "trainer" && role_name != "inference")
    flags.Fail("--role must be trainer or inference");
  const v1::Role role = role_name == "trainer" ? v1::TRAINER : v1::INFERENCE;
  auto side = ReadLayoutFile(layout_path, role_name);
  if (!side.ok()) flags.Fail(std::string(side.status().message()));
  auto found = side->worker_index.find(worker_name);
  if (found == side->worker_index.end())
    flags.Fail(absl::StrCat("no worker \"", worker_name, "\" in ", layout_path));
  Layout mine = WorkerLayout(*side, found->second);
  if (auto s = ValidateLayout(mine, role_name); !s.ok()) flags.Fail(std::string(s.message()));
  std::optional<Layout> peer;
  if (!peer_layout_path.empty()) {
    auto p = ReadLayoutFile(peer_layout_path, role_name == "trainer" ? "inference" : "trainer");
    if (!p.ok()) flags.Fail(std::string(p.status().message()));
    peer = *std::move(p);
  }
  // The source layout whose values the check expects: the trainers' (every tensor, any worker's
  // WorkerLayout keeps them all).
  const Layout& source_side = role_name == "trainer" || !peer ? mine : *peer;

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::unique_ptr<WorkerClient> client;
  BufferMemory memory;  // what FillSources / CheckDestinations see: host memory
#ifdef REFIT_SIM_WORKER_CUDA
  // The weights live on the GPU, all buffers in one allocation (as in PyTorch's caching
  // allocator, buffers sit at offsets from its base); host copies are for filling and checking.
  const int gpu = mine.workers[0].gpu;
  if (cudaSetDevice(gpu) != cudaSuccess) flags.Fail(absl::StrCat("no GPU ", gpu));
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const Buffer& b : mine.buffers) {
    offsets.push_back(total);
    total += (b.NumBytes() + 255) / 256 * 256;
  }
  char* device = nullptr;
  total = std::max<int64_t>(total, 256);
  if (!vmm) {
    // A whole number of 2 MiB pages, as PyTorch's caching allocator sizes its segments: another
    // process imports an allocation of any other size through CUDA IPC with small pages, and a
    // colocated refit's copy kernel ran at a third of its speed on it (docs/BENCHMARKS.md, session
    // 15).
    total = (total + (int64_t{2} << 20) - 1) / (int64_t{2} << 20) * (int64_t{2} << 20);
    if (cudaMalloc(&device, total) != cudaSuccess) flags.Fail("cudaMalloc failed");
  } else {
    // Physical allocations of --vmm-chunk-mb, mapped back to back in one reserved range: what
    // PyTorch's expandable segments do, shareable as POSIX file descriptors.
    if (cudaFree(nullptr) != cudaSuccess) flags.Fail(absl::StrCat("no CUDA context on GPU ", gpu));
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    if (cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
        CUDA_SUCCESS) {
      flags.Fail("cuMemGetAllocationGranularity failed");
    }
    const size_t chunk =
        (static_cast<size_t>(std::max<int64_t>(vmm_chunk_mb, 1)) * (1 << 20) + granularity - 1) /
        granularity * granularity;
    const size_t chunks = (static_cast<size_t>(total) + chunk - 1) / chunk;
    CUdeviceptr base = 0;
    if (cuMemAddressReserve(&base, chunks * chunk, 0, 0, 0) != CUDA_SUCCESS)
      flags.Fail("cuMemAddressReserve failed");
    for (size_t c = 0; c < chunks; ++c) {
      CUmemGenericAllocationHandle h;
      if (cuMemCreate(&h, chunk, &prop, 0) != CUDA_SUCCESS) flags.Fail("cuMemCreate failed");
      if (cuMemMap(base + c * chunk, chunk, 0, h, 0) != CUDA_SUCCESS) flags.Fail("cuMemMap failed");
      cuMemRelease(h);  // the mapping keeps it until the process exits
    }
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (cuMemSetAccess(base, chunks * chunk, &access, 1) != CUDA_SUCCESS)
      flags.Fail("cuMemSetAccess failed");
    device = reinterpret_cast<char*>(base);
    Report(absl::StrCat("vmm: ", chunks, " allocations of ", chunk, " bytes"));
  }
  std::vector<std::vector<std::byte>> host(mine.buffers.size());
  std::vector<CudaBufferRef> refs;
  for (size_t b = 0; b < mine.buffers.size(); ++b) {
    host[b].resize(static_cast<size_t>(mine.buffers[b].NumBytes()));
    memory.emplace_back(host[b].data(), host[b].size());
    refs.push_back({device + offsets[b], mine.buffers[b].NumBytes(), mine.buffers[b].name});
  }
  auto exported_or = ExportCudaBuffers(refs);
  if (!exported_or.ok()) flags.Fail(std::string(exported_or.status().message()));
  CudaExport exported_cuda = *std::move(exported_or);  // owns the VMM descriptors (kept open)
  ConnectOptions options;
  options.memory.memory = exported_cuda.memory;
  options.memory.vmm_ranges = exported_cuda.vmm_ranges;
  options.memory.fds = exported_cuda.fds;
  options.memory.gpu_uuid = exported_cuda.gpu_uuid;
  auto to_device = [&] {
    for (size_t b = 0; b < host.size(); ++b)
      cudaMemcpy(device + offsets[b], host[b].data(), host[b].size(), cudaMemcpyHostToDevice);
  };
  auto to_host = [&] {
    for (size_t b = 0; b < host.size(); ++b)
      cudaMemcpy(host[b].data(), device + offsets[b], host[b].size(), cudaMemcpyDeviceToHost);
  };
  auto poison = [&] {
    cudaMemset(device, static_cast<int>(kPoison), total);
    cudaDeviceSynchronize();
  };
  const bool own_memory = true;
#else
  if (vmm) flags.Fail("--vmm needs sim-worker-cuda");
  ConnectOptions options;  // the library allocates shared memory
  const bool own_memory = false;
  auto to_device = [] {};
  auto to_host = [] {};
  auto poison = [&] { PoisonDestinations(memory); };
#endif
  auto spec_for = [&](int64_t version) {
    const uint64_t seed = static_cast<uint64_t>(same_data ? 1 : version);
    if (peer)
      return role_name == "trainer" ? MakeFillSpec(mine, *peer, seed)
                                    : MakeFillSpec(*peer, mine, seed);
    FillSpec spec;
    spec.seed = seed;
    spec.numeric.assign(mine.tensors.size(), false);  // both sides share dtypes in this cluster
    return spec;
  };
  bool filled = false;
  std::vector<std::vector<std::byte>> verified;  // --same-data: the first checked commit's bytes
  WorkerCallbacks callbacks;
  callbacks.on_prepare = [&](int64_t version) {
    // Tests strike while a round waits in PREPARE: this line says it has begun waiting.
    Report(absl::StrCat("preparing ", version));
    if (prepare_delay_ms > 0) absl::SleepFor(absl::Milliseconds(prepare_delay_ms));
    if (role == v1::TRAINER && !(same_data && filled)) {
      FillSources(mine, spec_for(version), memory);  // "the optimizer step"
      to_device();
      filled = true;
    }
    if (role == v1::INFERENCE) poison();
    Report(absl::StrCat("prepare ", version));
    return absl::OkStatus();
  };
  callbacks.on_commit = [&](int64_t version) {
    if (role == v1::TRAINER) {
      Report(absl::StrCat("commit ", version));
      return;
    }
    to_host();
    if (same_data && !verified.empty()) {
      int64_t bytes = 0;
      for (size_t b = 0; b < memory.size(); ++b) {
        if (std::memcmp(memory[b].data(), verified[b].data(), memory[b].size()) != 0) {
          Report(absl::StrCat("commit ", version, " FAIL buffer ", mine.buffers[b].name,
                              " differs from the verified round"));
          return;
        }
        bytes += static_cast<int64_t>(memory[b].size());
      }
      Report(absl::StrCat("commit ", version, " ok ", bytes, " bytes equal to the verified round"));
      return;
    }
    auto checked = CheckDestinations(source_side, mine, spec_for(version), memory);
    if (checked.ok() && same_data) {
      for (const auto& span : memory) verified.emplace_back(span.begin(), span.end());
    }
    if (checked.ok()) {
      Report(absl::StrCat("commit ", version, " ok ", checked->elements_checked, " elements ",
                          checked->padding_bytes_checked, " padding bytes"));
    } else {
      Report(absl::StrCat("commit ", version, " FAIL ", checked.status().message()));
    }
  };
  callbacks.on_abort = [&](int64_t round, const std::string& reason) {
    Report(absl::StrCat("abort round ", round, ": ", reason));
  };
  options.timeout = absl::Seconds(register_timeout_s);
  callbacks.on_disconnected = [&](const std::string& why) {
    Report(absl::StrCat("disconnected: ", why));
  };
  // The library registers again by itself once the daemon is back.
  callbacks.on_reconnected = [&](const std::string& id) {
    Report(absl::StrCat("registered ", id));
  };
  auto connected = WorkerClient::Connect(daemon, group, role, mine, callbacks, std::move(options));
  if (!connected.ok()) {
    std::fprintf(stderr, "sim-worker: %s\n", std::string(connected.status().message()).c_str());
    return 1;
  }
  client = *std::move(connected);
  if (!own_memory) {
    for (size_t b = 0; b < client->num_buffers(); ++b) memory.push_back(client->buffer(b));
  }
  if (role == v1::INFERENCE) {
    PoisonDestinations(memory);
    to_device();
  }
  Report(absl::StrCat("registered ", client->worker_id()));
  int sig = 0;
  sigwait(&signals, &sig);
  client->Unregister().IgnoreError();
  return 0;
}
