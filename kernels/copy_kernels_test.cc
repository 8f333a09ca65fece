// The CUDA copy kernels against the CPU reference on random plans (casts, strides, ranks up to 4,
// odd sizes and odd staging alignments): every staging byte of every message and every
// destination byte must match. Skips, passing, where no GPU is present.
#include "kernels/copy_kernels.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <memory>

#include "kernels/cuda_check.h"
#include "kernels/test_plans.h"
#include "plan/verify.h"

namespace refit {
namespace {

struct DeviceLayout {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  explicit DeviceLayout(const Layout& l) {
    for (const Buffer& b : l.buffers) buffers.push_back(std::make_unique<DeviceBuffer>(static_cast<size_t>(b.NumBytes())));
  }
  BufferAddresses addresses() const {
    BufferAddresses a;
    for (const auto& b : buffers) a.push_back(b->address());
    return a;
  }
  void Upload(const HostBuffers& h) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      REFIT_CUDA_CHECK(cudaMemcpy(buffers[i]->get(), h.storage[i].data(), h.storage[i].size(), cudaMemcpyHostToDevice));
    }
  }
  void Download(HostBuffers& h) const {
    for (size_t i = 0; i < buffers.size(); ++i) {
      REFIT_CUDA_CHECK(cudaMemcpy(h.storage[i].data(), buffers[i]->get(), h.storage[i].size(), cudaMemcpyDeviceToHost));
    }
  }
};

void Run(const CopyWork& w, cudaStream_t stream) {
  DeviceBuffer items(w.items.size() * sizeof(CopyItem)), begin(w.unit_begin.size() * sizeof(int64_t));
  REFIT_CUDA_CHECK(cudaMemcpy(items.get(), w.items.data(), items.size(), cudaMemcpyHostToDevice));
  REFIT_CUDA_CHECK(cudaMemcpy(begin.get(), w.unit_begin.data(), begin.size(), cudaMemcpyHostToDevice));
  REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<const CopyItem*>(items.get()), static_cast<const int64_t*>(begin.get()),
                                   static_cast<int>(w.items.size()), w.unit_begin.back(), stream));
  REFIT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

TEST_CASE("GPU pack and unpack match the CPU reference byte for byte") {
  if (GpuCount() == 0) {
    WARN("no GPU here: skipped");
    return;
  }
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  int64_t messages = 0, bytes = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    TestRun run(seed);
    auto& [t, src, ref, got, spec] = run;
    DeviceLayout dsrc(t.src), ddst(t.dst);
    dsrc.Upload(src);
    ddst.Upload(got);
    for (int stage = 0; stage < kMaxStages; ++stage) {
      for (const Message& m : t.plan.messages) {
        if (m.stage != stage) continue;
        std::vector<std::byte> want;
        PackMessage(t.plan, m, src.memory, ref.memory, want);
        DeviceBuffer staging(static_cast<size_t>(m.bytes) + 16);
        const uint64_t at = staging.address() + seed % 7;  // odd alignments too
        const int64_t segment = seed % 2 ? 64 : 16384;
        Run(PackWork(t.plan, m, dsrc.addresses(), ddst.addresses(), at, segment), stream);
        std::vector<std::byte> packed(want.size());
        REFIT_CUDA_CHECK(cudaMemcpy(packed.data(), reinterpret_cast<void*>(at), packed.size(), cudaMemcpyDeviceToHost));
        INFO("seed " << seed << " message of " << m.bytes << " bytes");
        REQUIRE(packed == want);
        UnpackMessage(t.plan, m, want, ref.memory);
        Run(UnpackWork(t.plan, m, at, ddst.addresses(), segment), stream);
        ++messages;
        bytes += m.bytes;
      }
    }
    ddst.Download(got);
    for (size_t b = 0; b < t.dst.buffers.size(); ++b) REQUIRE(ref.storage[b] == got.storage[b]);
    auto checked = CheckDestinations(t.src, t.dst, spec, got.memory);
    INFO(checked.status().message());
    REQUIRE(checked.ok());
  }
  WARN("checked " << messages << " messages, " << bytes << " bytes on the GPU");
  cudaStreamDestroy(stream);
}

// The daemon launches one kernel per step with tens of thousands of small items; then each warp's
// lanes resolve a batch of up to 32 units at once. The random plans above are too small for that,
// so here every message of many plans is packed, then unpacked, in one launch each, one element
// per unit: hundreds of thousands of units, the last batch partial.
TEST_CASE("one launch of hundreds of thousands of units matches the CPU reference") {
  if (GpuCount() == 0) {
    WARN("no GPU here: skipped");
    return;
  }
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  std::vector<std::unique_ptr<TestRun>> runs;
  std::vector<std::unique_ptr<DeviceLayout>> dsrc, ddst;
  CopyWork pack, unpack;
  pack.unit_begin = {0};
  unpack.unit_begin = {0};
  struct Packed {
    const TestRun* run;
    const Message* m;
    int64_t offset;  // in staging
  };
  std::vector<Packed> packed;
  int64_t staging_bytes = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    runs.push_back(std::make_unique<TestRun>(seed));
    const TestRun& run = *runs.back();
    for (const Message& m : run.t.plan.messages) {
      packed.push_back({&run, &m, staging_bytes + static_cast<int64_t>(seed % 7)});  // odd alignments
      staging_bytes += m.bytes + 16;
    }
  }
  DeviceBuffer staging(static_cast<size_t>(staging_bytes));
  for (size_t r = 0; r < runs.size(); ++r) {
    dsrc.push_back(std::make_unique<DeviceLayout>(runs[r]->t.src));
    ddst.push_back(std::make_unique<DeviceLayout>(runs[r]->t.dst));
    dsrc.back()->Upload(runs[r]->src);
    ddst.back()->Upload(runs[r]->got);
  }
  auto run_index = [&](const TestRun* run) {
    for (size_t r = 0; r < runs.size(); ++r) {
      if (runs[r].get() == run) return r;
    }
    return size_t{0};
  };
  for (const Packed& p : packed) {
    const size_t r = run_index(p.run);
    const uint64_t at = staging.address() + static_cast<uint64_t>(p.offset);
    AppendWork(PackWork(p.run->t.plan, *p.m, dsrc[r]->addresses(), ddst[r]->addresses(), at, 2), pack);
    AppendWork(UnpackWork(p.run->t.plan, *p.m, at, ddst[r]->addresses(), 2), unpack);
  }
  INFO(pack.unit_begin.back() << " units to pack, " << unpack.unit_begin.back() << " to unpack");
  REQUIRE(pack.unit_begin.back() > 32 * 8192);  // batches of 32 units
  REQUIRE(pack.unit_begin.back() % 32 != 0);    // and a partial last batch
  Run(pack, stream);
  // Every message's staging against the CPU's packing of it, all packed before anything is
  // unpacked, on both sides (relays of later stages read destinations, still poison here).
  std::vector<std::vector<std::byte>> wants(packed.size());
  for (size_t i = 0; i < packed.size(); ++i) {
    const Packed& p = packed[i];
    PackMessage(p.run->t.plan, *p.m, p.run->src.memory, p.run->ref.memory, wants[i]);
    std::vector<std::byte> got(wants[i].size());
    REFIT_CUDA_CHECK(cudaMemcpy(got.data(), reinterpret_cast<void*>(staging.address() + p.offset), got.size(),
                                cudaMemcpyDeviceToHost));
    REQUIRE(got == wants[i]);
  }
  Run(unpack, stream);
  for (size_t i = 0; i < packed.size(); ++i) {
    UnpackMessage(packed[i].run->t.plan, *packed[i].m, wants[i], runs[run_index(packed[i].run)]->ref.memory);
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    ddst[r]->Download(runs[r]->got);
    for (size_t b = 0; b < runs[r]->t.dst.buffers.size(); ++b) REQUIRE(runs[r]->ref.storage[b] == runs[r]->got.storage[b]);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace refit
