// The CUDA copy kernels against the CPU reference on random plans (casts, strides, ranks up to 4,
// odd sizes and odd staging alignments): every staging byte of every message and every
// destination byte must match. And the quantizing units (fp8 on the way: kQuantize, kScale;
// block fp8 and MXFP8; bf16, fp16 and fp32 sources) against the host twin, RunCopyWorkOnHost,
// bit for bit, on adversarial and random blocks (tests tagged [fp8]). Fails where no GPU is
// present (tagged "gpu": CI leaves it out).
#include "kernels/copy_kernels.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_check.h"
#include "kernels/quant_test_cases.h"
#include "kernels/test_plans.h"
#include "plan/convert.h"
#include "plan/flat_range.h"
#include "plan/fp8_block.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "tests/gpu/needs_gpu.h"

namespace refit {
namespace {

struct DeviceLayout {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  explicit DeviceLayout(const Layout& l) {
    for (const Buffer& b : l.buffers)
      buffers.push_back(std::make_unique<DeviceBuffer>(static_cast<size_t>(b.NumBytes())));
  }
  BufferAddresses addresses() const {
    BufferAddresses a;
    for (const auto& b : buffers) a.push_back(b->address());
    return a;
  }
  void Upload(const HostBuffers& h) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      REFIT_CUDA_CHECK(cudaMemcpy(buffers[i]->get(), h.storage[i].data(), h.storage[i].size(),
                                  cudaMemcpyHostToDevice));
    }
  }
  void Download(HostBuffers& h) const {
    for (size_t i = 0; i < buffers.size(); ++i) {
      REFIT_CUDA_CHECK(cudaMemcpy(h.storage[i].data(), buffers[i]->get(), h.storage[i].size(),
                                  cudaMemcpyDeviceToHost));
    }
  }
};

int aligned_launches = 0;     // launches through the aligned kernel (AlignedOnly)
int quantizing_launches = 0;  // launches with the quantizing kernel (LaunchCopyItems' `quantizing`)
// Whether work with quantizing items runs them in the quantizing kernel: -1 every other
// pair of launches of such work (both must give the same bytes), 0 never, 1 always.
int quantizing_mode = -1;

void Run(const CopyWork& w, cudaStream_t stream) {
  // Every other launch in the spread unit order: both orders must give the same bytes.
  static int launches = 0;
  // And, of works the aligned kernel can run (AlignedOnly: the backend launches it for them), every
  // other pair of launches through the general kernel: both kernels must give the same bytes.
  const int k = launches++;
  const bool spread = k % 2 == 1;
  const bool aligned = AlignedOnly(w) && (k / 2) % 2 == 0;
  if (aligned) ++aligned_launches;
  const bool quantizing =
      HasQuantizing(w) && (quantizing_mode < 0 ? (k / 4) % 2 == 0 : quantizing_mode == 1);
  if (quantizing) ++quantizing_launches;
  // Work without quantizing units: every other four pairs of launches through the copy kernel
  // built without quantizing code (as the cuda backend launches it), both must give the same
  // bytes. And the quantizing kernel's two builds by turns, whatever the units: the same bytes.
  const QuantizingUnits units_mode =
      quantizing ? (quantizing_launches % 2 == 1 ? QuantizingUnits::kInQuantizingKernel
                                                 : QuantizingUnits::kInMxQuantizingKernel)
      : !HasQuantizing(w) && (k / 8) % 2 == 0 ? QuantizingUnits::kNone
                                              : QuantizingUnits::kInCopyKernel;
  // As the cuda backend uploads it: with the quantizing kernel, no units for scales twins write.
  const std::vector<int64_t> units = quantizing ? QuantizingLaunchUnits(w) : w.unit_begin;
  DeviceBuffer items(w.items.size() * sizeof(CopyItem)), begin(units.size() * sizeof(int64_t));
  REFIT_CUDA_CHECK(cudaMemcpy(items.get(), w.items.data(), items.size(), cudaMemcpyHostToDevice));
  REFIT_CUDA_CHECK(cudaMemcpy(begin.get(), units.data(), begin.size(), cudaMemcpyHostToDevice));
  REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<const CopyItem*>(items.get()),
                                   static_cast<const int64_t*>(begin.get()),
                                   static_cast<int>(w.items.size()), units.back(), stream, spread,
                                   aligned, nullptr, 0, units_mode));
  REFIT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

TEST_CASE("GPU pack and unpack match the CPU reference byte for byte") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
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
        REFIT_CUDA_CHECK(cudaMemcpy(packed.data(), reinterpret_cast<void*>(at), packed.size(),
                                    cudaMemcpyDeviceToHost));
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
  WARN("checked " << messages << " messages, " << bytes << " bytes on the GPU; " << aligned_launches
                  << " launches so far through the aligned kernel");
  cudaStreamDestroy(stream);
}

// The daemon launches one kernel per step with tens of thousands of small items; then each warp's
// lanes resolve a batch of up to 32 units at once. The random plans above are too small for that,
// so here every message of many plans is packed, then unpacked, in one launch each, one element
// per unit: hundreds of thousands of units, the last batch partial.
TEST_CASE("one launch of hundreds of thousands of units matches the CPU reference") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
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
      packed.push_back(
          {&run, &m, staging_bytes + static_cast<int64_t>(seed % 7)});  // odd alignments
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
    AppendWork(PackWork(p.run->t.plan, *p.m, dsrc[r]->addresses(), ddst[r]->addresses(), at, 2),
               pack);
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
    REFIT_CUDA_CHECK(cudaMemcpy(got.data(), reinterpret_cast<void*>(staging.address() + p.offset),
                                got.size(), cudaMemcpyDeviceToHost));
    REQUIRE(got == wants[i]);
  }
  Run(unpack, stream);
  for (size_t i = 0; i < packed.size(); ++i) {
    UnpackMessage(packed[i].run->t.plan, *packed[i].m, wants[i],
                  runs[run_index(packed[i].run)]->ref.memory);
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    ddst[r]->Download(runs[r]->got);
    for (size_t b = 0; b < runs[r]->t.dst.buffers.size(); ++b)
      REQUIRE(runs[r]->ref.storage[b] == runs[r]->got.storage[b]);
  }
  cudaStreamDestroy(stream);
}

// Device memory shaped like host memory (a layout's buffers, a destination's scratch after them).
struct DeviceMemory {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  explicit DeviceMemory(const BufferMemory& like) {
    for (const auto& span : like) buffers.push_back(std::make_unique<DeviceBuffer>(span.size()));
  }
  BufferAddresses addresses() const {
    BufferAddresses a;
    for (const auto& b : buffers) a.push_back(b->address());
    return a;
  }
  void Upload(const BufferMemory& h) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      REFIT_CUDA_CHECK(
          cudaMemcpy(buffers[i]->get(), h[i].data(), h[i].size(), cudaMemcpyHostToDevice));
    }
  }
  void Download(const BufferMemory& h) const {
    for (size_t i = 0; i < buffers.size(); ++i) {
      REFIT_CUDA_CHECK(
          cudaMemcpy(h[i].data(), buffers[i]->get(), h[i].size(), cudaMemcpyDeviceToHost));
    }
  }
};

struct DestinationMemory {
  HostBuffers buffers;
  std::vector<std::vector<std::byte>> scratch;
  DestinationMemory(const Layout& l, const Plan& plan) : buffers(l) {
    scratch = AllocateScratch(plan, buffers.memory);
    PoisonDestinations(buffers.memory);
  }
  bool operator==(const DestinationMemory& o) const {
    return buffers.storage == o.buffers.storage && scratch == o.scratch;
  }
};

std::vector<std::byte> Download(uint64_t at, size_t bytes) {
  std::vector<std::byte> out(bytes);
  REFIT_CUDA_CHECK(
      cudaMemcpy(out.data(), reinterpret_cast<const void*>(at), bytes, cudaMemcpyDeviceToHost));
  return out;
}

// Hand-built items (kernels/test_plans.h: short rows of odd widths at odd offsets, thousands of
// tiny items, conversions of short rows, 3-loop and transposed strides, tiles ending inside items
// with the next item right after, long runs whose ends differ in alignment, random ones): the
// kernel's bytes against a plain element loop and the host twin, destinations poisoned, every
// byte (gaps and neighbours included). Each case in its own launch, then all in one.
TEST_CASE("GPU tiled and run items match a plain loop byte for byte") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const std::vector<ItemCase> cases = MakeItemCases(400, 7);
  struct OnDevice {
    std::unique_ptr<DeviceBuffer> src, dst;
  };
  std::vector<OnDevice> on(cases.size());
  auto upload = [&](size_t i) {
    const ItemCase& c = cases[i];
    if (!on[i].src) {
      on[i].src = std::make_unique<DeviceBuffer>(c.src.size());
      on[i].dst = std::make_unique<DeviceBuffer>(static_cast<size_t>(c.dst_bytes));
      REFIT_CUDA_CHECK(
          cudaMemcpy(on[i].src->get(), c.src.data(), c.src.size(), cudaMemcpyHostToDevice));
    }
    REFIT_CUDA_CHECK(cudaMemset(on[i].dst->get(), static_cast<int>(kPoison), on[i].dst->size()));
  };
  std::vector<std::vector<std::byte>> wants;
  int64_t units = 0, bytes = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const ItemCase& c = cases[i];
    INFO(c.name << ", segment bytes " << c.segment_bytes);
    wants.push_back(ReferenceCopy(c));
    // The host twin at host addresses of the same alignment.
    AlignedBytes hsrc(c.src.size(), std::byte{0}), hdst(static_cast<size_t>(c.dst_bytes), kPoison);
    std::memcpy(hsrc.data, c.src.data(), c.src.size());
    RunCopyWorkOnHost(ItemCaseWork(c, hsrc.address(), hdst.address()));
    REQUIRE(std::memcmp(hdst.data, wants[i].data(), wants[i].size()) == 0);
    upload(i);
    const CopyWork w = ItemCaseWork(c, on[i].src->address(), on[i].dst->address());
    Run(w, stream);
    const std::vector<std::byte> got = Download(on[i].dst->address(), wants[i].size());
    size_t wrong = 0, first = 0;
    for (size_t b = 0; b < got.size(); ++b) {
      if (got[b] != wants[i][b] && wrong++ == 0) first = b;
    }
    INFO(wrong << " wrong bytes, the first at " << first);
    REQUIRE(wrong == 0);
    units += w.unit_begin.back();
    bytes += c.dst_bytes;
  }
  // All cases in one launch: many units per warp's batch, tiles and runs of every kind mixed.
  CopyWork all;
  all.unit_begin = {0};
  for (size_t i = 0; i < cases.size(); ++i) {
    upload(i);
    AppendWork(ItemCaseWork(cases[i], on[i].src->address(), on[i].dst->address()), all);
  }
  Run(all, stream);
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].name << " in the one launch");
    REQUIRE(Download(on[i].dst->address(), wants[i].size()) == wants[i]);
  }
  WARN("checked " << cases.size() << " cases, " << units << " units, " << bytes
                  << " destination bytes on the GPU");
  cudaStreamDestroy(stream);
}

TEST_CASE("GPU quantizing units match the host twin bit for bit on adversarial plans", "[fp8]") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  int64_t messages = 0, quantizing = 0;
  for (QuantCase& qc : QuantCases(60)) {
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      INFO(qc.name << ", fill " << seed);
      HostBuffers src(qc.src);
      const FillSpec spec = MakeFillSpec(qc.src, qc.dst, seed);
      if (seed == 1)
        FillSources(qc.src, spec, src.memory);
      else
        FillAdversarial(qc.src, qc.dst, src.memory, seed, qc.block_rows, qc.block_cols);
      DeviceMemory dsrc(src.memory);
      dsrc.Upload(src.memory);
      // Staged: the host twin on host memory, the kernel on the GPU, the same work.
      DestinationMemory host(qc.dst, qc.plan), got(qc.dst, qc.plan);
      DeviceMemory ddst(host.buffers.memory);
      ddst.Upload(host.buffers.memory);  // poison
      for (int stage = 0; stage < kMaxStages; ++stage) {
        for (const Message& m : qc.plan.messages) {
          if (m.stage != stage) continue;
          const int64_t segment = seed % 2 ? 64 : 16384;
          std::vector<std::byte> staging(static_cast<size_t>(m.bytes) + 16, kPoison);
          const uint64_t at = reinterpret_cast<uint64_t>(staging.data()) + seed % 7;
          RunCopyWorkOnHost(
              PackWork(qc.plan, m, src.addresses(), host.buffers.addresses(), at, segment));
          DeviceBuffer dstaging(static_cast<size_t>(m.bytes) + 16);
          const uint64_t dat = dstaging.address() + seed % 7;  // odd alignments too
          Run(PackWork(qc.plan, m, dsrc.addresses(), ddst.addresses(), dat, segment), stream);
          REQUIRE(Download(dat, static_cast<size_t>(m.bytes)) ==
                  std::vector<std::byte>(staging.begin() + seed % 7,
                                         staging.begin() + seed % 7 + m.bytes));
          RunCopyWorkOnHost(UnpackWork(qc.plan, m, at, host.buffers.addresses(), segment));
          Run(UnpackWork(qc.plan, m, dat, ddst.addresses(), segment), stream);
          ++messages;
          for (int64_t k = 0; k < m.num_descriptors; ++k)
            quantizing += qc.plan.descriptor(m, k).Quantizes();
        }
      }
      ddst.Download(got.buffers.memory);
      REQUIRE(host == got);
      if (seed == 1) {
        auto checked = CheckDestinations(qc.src, qc.dst, spec, got.buffers.memory);
        INFO(checked.status().message());
        REQUIRE(checked.ok());
      }
      // Direct: codes and scales straight into the destinations.
      DestinationMemory host2(qc.dst, qc.plan), got2(qc.dst, qc.plan);
      DeviceMemory ddst2(host2.buffers.memory);
      ddst2.Upload(host2.buffers.memory);
      for (int stage = 0; stage < kMaxStages; ++stage) {
        for (const Message& m : qc.plan.messages) {
          if (m.stage != stage) continue;
          RunCopyWorkOnHost(
              DirectWork(qc.plan, m, src.addresses(), host2.buffers.addresses(), 128));
          Run(DirectWork(qc.plan, m, dsrc.addresses(), ddst2.addresses(), 128), stream);
        }
      }
      ddst2.Download(got2.buffers.memory);
      REQUIRE(host2 == got2);
      REQUIRE(host2 == host);
    }
  }
  WARN("checked " << messages << " messages (" << quantizing
                  << " quantizing descriptors) on the GPU, " << quantizing_launches
                  << " launches so far with the quantizing kernel");
  REQUIRE(quantizing_launches > 0);
  cudaStreamDestroy(stream);
}

// Quantizing units mixed with copy units in one launch, hundreds of thousands of units (batches
// of 32 per warp, the last partial): every message's staging against the host twin's.
TEST_CASE("one launch mixing quantizing and copy units matches the host twin", "[fp8]") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  std::vector<QuantCase> cases = QuantCases(20);
  std::vector<std::unique_ptr<TestRun>> runs;
  for (uint64_t seed = 1; seed <= 30; ++seed) runs.push_back(std::make_unique<TestRun>(seed));
  struct Side {
    std::unique_ptr<HostBuffers> src;
    std::unique_ptr<DestinationMemory> dst;
    std::unique_ptr<DeviceMemory> dsrc, ddst;
  };
  std::vector<Side> sides;
  int64_t staging_bytes = 0;
  std::vector<std::pair<const Plan*, const Message*>> packed;
  auto add = [&](const Layout& src_layout, const Layout& dst_layout, const Plan& plan, auto fill) {
    Side s;
    s.src = std::make_unique<HostBuffers>(src_layout);
    fill(*s.src);
    s.dst = std::make_unique<DestinationMemory>(dst_layout, plan);
    s.dsrc = std::make_unique<DeviceMemory>(s.src->memory);
    s.dsrc->Upload(s.src->memory);
    s.ddst = std::make_unique<DeviceMemory>(s.dst->buffers.memory);
    s.ddst->Upload(s.dst->buffers.memory);
    sides.push_back(std::move(s));
    for (const Message& m : plan.messages) {
      if (m.stage == 0) packed.push_back({&plan, &m}), staging_bytes += m.bytes + 16;
    }
  };
  for (QuantCase& qc : cases) {
    add(qc.src, qc.dst, qc.plan, [&](HostBuffers& h) {
      FillAdversarial(qc.src, qc.dst, h.memory, 5, qc.block_rows, qc.block_cols);
    });
  }
  for (auto& run : runs)
    add(run->t.src, run->t.dst, run->t.plan,
        [&](HostBuffers& h) { FillSources(run->t.src, run->spec, h.memory); });
  std::vector<std::byte> host_staging(static_cast<size_t>(staging_bytes), kPoison);
  DeviceBuffer staging(static_cast<size_t>(staging_bytes));
  REFIT_CUDA_CHECK(cudaMemset(staging.get(), 0xA5, staging.size()));
  CopyWork host, device;
  host.unit_begin = device.unit_begin = {0};
  int64_t offset = 0;
  size_t side = 0, in_side = 0;
  std::vector<const Plan*> plan_of_side;
  for (QuantCase& qc : cases) plan_of_side.push_back(&qc.plan);
  for (auto& run : runs) plan_of_side.push_back(&run->t.plan);
  for (const auto& [plan, m] : packed) {
    while (plan != plan_of_side[side]) ++side, in_side = 0;
    const Side& s = sides[side];
    const int64_t at = offset + (static_cast<int64_t>(in_side++) % 7);
    AppendWork(PackWork(*plan, *m, s.src->addresses(), s.dst->buffers.addresses(),
                        reinterpret_cast<uint64_t>(host_staging.data()) + at, 2),
               host);
    AppendWork(
        PackWork(*plan, *m, s.dsrc->addresses(), s.ddst->addresses(), staging.address() + at, 2),
        device);
    offset += m->bytes + 16;
  }
  int64_t quantizing_units = 0,
          quantizing_rows = 0;  // rows of units: MXFP8 units are tiles of Mxfp8UnitRows rows
  for (size_t i = 0; i < device.items.size(); ++i) {
    const CopyItem& it = device.items[i];
    if (!it.Quantizes()) continue;
    quantizing_units += it.Units();
    quantizing_rows += it.Units() * it.RowsPerUnit();
  }
  INFO(device.unit_begin.back() << " units, " << quantizing_units << " quantizing ("
                                << quantizing_rows << " rows)");
  REQUIRE(device.unit_begin.back() > 32 * 8192);
  REQUIRE(quantizing_units > 500);  // 897: MXFP8's units are tiles of up to 16384 elements
  REQUIRE(quantizing_rows > 10000);
  RunCopyWorkOnHost(host);
  for (int mode : {0, 1}) {  // the copy kernel's quantizing units, then the quantizing kernel's
    INFO((mode == 1 ? "with" : "without") << " the quantizing kernel");
    quantizing_mode = mode;
    REFIT_CUDA_CHECK(cudaMemset(staging.get(), 0xA5, staging.size()));
    Run(device, stream);
    quantizing_mode = -1;
    REQUIRE(Download(staging.address(), staging.size()) == host_staging);
  }
  cudaStreamDestroy(stream);
}

// The quantizing kernel converts finite quotients with the hardware's instruction: it must be
// the port of FloatToE4M3 (which the sweep below checks against the CPU's) for every one.
TEST_CASE("GPU hardware e4m3 conversion is FloatToE4M3 for every finite fp32", "[fp8]") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  DeviceBuffer counters(16);
  const uint32_t init[4] = {0, 0, 0xFFFFFFFFu, 0};
  REFIT_CUDA_CHECK(cudaMemcpy(counters.get(), init, sizeof(init), cudaMemcpyHostToDevice));
  auto* base = static_cast<unsigned char*>(counters.get());
  REFIT_CUDA_CHECK(CheckE4M3Conversion(reinterpret_cast<unsigned long long*>(base),
                                       reinterpret_cast<uint32_t*>(base + 8), nullptr));
  REFIT_CUDA_CHECK(cudaDeviceSynchronize());
  uint32_t got[4];
  REFIT_CUDA_CHECK(cudaMemcpy(got, counters.get(), sizeof(got), cudaMemcpyDeviceToHost));
  const uint64_t mismatches = got[0] | static_cast<uint64_t>(got[1]) << 32;
  INFO(mismatches << " patterns differ, the first 0x" << std::hex << got[2]);
  REQUIRE(mismatches == 0);
}

// The sweep (kernels/copy_items_test.cc has its host side): MXFP8 rows of 32 that start with 256,
// so X = 1 and the codes are FloatToE4M3(x) for every |x| < 512, every rounding boundary of e4m3
// and its neighbours, NaNs and infs of both signs; and block fp8 rows that start with 448 (scale
// exactly 1) over the values up to 448.
std::vector<float> SweepValues(uint32_t stride, float lead, float limit) {
  std::vector<float> v;
  auto add = [&](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isfinite(f) && std::fabs(f) > limit) return;
    if (v.size() % 32 == 0) v.push_back(lead);
    v.push_back(f);
  };
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (int k = 0; k < 0x7F; ++k) {
      const float lo = E4M3ToFloat(static_cast<uint8_t>(k)),
                  hi = k == 0x7E ? 464.0f : E4M3ToFloat(static_cast<uint8_t>(k + 1));
      for (float m : {(lo + hi) / 2, lo}) {
        uint32_t mid;
        std::memcpy(&mid, &m, 4);
        for (int32_t delta = -8; delta <= 8; ++delta)
          add(sign | static_cast<uint32_t>(static_cast<int32_t>(mid) + delta));
      }
    }
    for (float f : {464.0f, 480.0f, 496.0f, 511.99f}) {
      uint32_t b;
      std::memcpy(&b, &f, 4);
      for (int32_t delta = -8; delta <= 8; ++delta)
        add(sign | static_cast<uint32_t>(static_cast<int32_t>(b) + delta));
    }
    for (uint32_t bits = 0; bits < 0x44000000u; bits += stride) add(sign | bits);  // up to 512
    for (uint32_t bits :
         {0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0x00000001u, 0x007FFFFFu})
      add(sign | bits);
  }
  while (v.size() % 32 != 0) v.push_back(-0.0f);
  return v;
}

// One item over `rows` x `cols` fp32 values in device memory `src` (rows packed), writing codes or
// scales at `dst`, with its host twin at the host addresses.
CopyDescriptor Region(CopyOp op, QuantFormat format, int64_t br, int64_t bc, int64_t rows,
                      int64_t cols, DType from) {
  CopyDescriptor d;
  d.op = op;
  d.quant_format = static_cast<uint8_t>(format);
  d.block_rows = static_cast<uint16_t>(br);
  d.block_cols = static_cast<uint16_t>(bc);
  d.src_dtype = from;
  d.dst_dtype = op == CopyOp::kQuantize         ? DType::kF8E4M3
                : format == QuantFormat::kMxfp8 ? DType::kE8M0
                                                : DType::kF32;
  d.outer_rank = 1;
  d.count[0] = rows;
  d.inner = cols;
  d.src_stride[0] = cols;
  d.dst_stride[0] = op == CopyOp::kQuantize ? cols : CeilDiv(cols, bc);
  return d;
}

// Packs `d` from `values` (host bytes of d.src_dtype) on the host twin and on the GPU; the two
// outputs must be equal. Returns the output.
std::vector<std::byte> PackBoth(const CopyDescriptor& d, const std::vector<std::byte>& values,
                                cudaStream_t stream) {
  DeviceBuffer dsrc(values.size()), dout(static_cast<size_t>(d.WireBytes()) + 8);
  REFIT_CUDA_CHECK(cudaMemcpy(dsrc.get(), values.data(), values.size(), cudaMemcpyHostToDevice));
  std::vector<std::byte> out(static_cast<size_t>(d.WireBytes()) + 8, kPoison);
  CopyWork host, device;
  AppendPackItem(d, {reinterpret_cast<uint64_t>(values.data())}, {},
                 reinterpret_cast<uint64_t>(out.data()) + 1, 16384, host);
  AppendPackItem(d, {dsrc.address()}, {}, dout.address() + 1, 16384,
                 device);  // odd: scales unaligned
  RunCopyWorkOnHost(host);
  REFIT_CUDA_CHECK(cudaMemset(dout.get(), 0xA5, dout.size()));
  Run(device, stream);
  const std::vector<std::byte> got = Download(dout.address(), dout.size());
  REQUIRE(got == out);
  return out;
}

std::vector<std::byte> AsBytes(const std::vector<float>& v) {
  std::vector<std::byte> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST_CASE("GPU codes are FloatToE4M3 itself across e4m3's range, ties and saturation included",
          "[fp8]") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  for (bool mx : {true, false}) {
    const std::vector<float> values =
        mx ? SweepValues(257, 256.0f, 511.99f) : SweepValues(257, 448.0f, 448.0f);
    const int64_t rows = static_cast<int64_t>(values.size() / 32);
    INFO((mx ? "mxfp8" : "block fp8") << ", " << values.size() << " values");
    const auto codes =
        PackBoth(Region(CopyOp::kQuantize, mx ? QuantFormat::kMxfp8 : QuantFormat::kBlockFp8, 1, 32,
                        rows, 32, DType::kF32),
                 AsBytes(values), stream);
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      if (static_cast<uint8_t>(codes[i + 1]) != FloatToE4M3(values[i]) && wrong++ == 0) first = i;
    }
    INFO(wrong << " wrong, the first " << values[first] << " (index " << first
               << "): " << int{static_cast<uint8_t>(codes[first + 1])} << " for "
               << int{FloatToE4M3(values[first])});
    REQUIRE(wrong == 0);
    const auto scales =
        PackBoth(Region(CopyOp::kScale, mx ? QuantFormat::kMxfp8 : QuantFormat::kBlockFp8, 1, 32,
                        rows, 32, DType::kF32),
                 AsBytes(values), stream);
    if (mx) {
      for (int64_t r = 0; r < rows; ++r) REQUIRE(static_cast<uint8_t>(scales[r + 1]) == 127);
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        float s;
        std::memcpy(&s, scales.data() + 1 + r * 4, 4);
        REQUIRE(s == 1.0f);
      }
    }
  }
  cudaStreamDestroy(stream);
}

// Millions of random blocks: fp32 bit patterns of every exponent (subnormal amaxes, subnormal
// quotients, scales at the FLT_MIN floor, huge ones), and bf16 / fp16 patterns: the IEEE division
// and the scale rules on the GPU against the host twin.
TEST_CASE("GPU quantization of random blocks of every exponent matches the host twin", "[fp8]") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  std::mt19937_64 rng(99);
  for (DType from : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t rows = 4096,
                  cols = 1024;  // block fp8: 32 x 8 blocks of 128; MXFP8: 131072 blocks
    const int size = DTypeSize(from);
    std::vector<std::byte> values(static_cast<size_t>(rows * cols * size));
    for (int64_t r = 0; r < rows; ++r) {
      // Each row keeps to a band of exponents, so that its blocks' amaxes span all of them.
      const int hi = static_cast<int>(rng() % 270) -
                     140;  // Normal() below: exponents in [hi - 30, hi], clamped
      for (int64_t c = 0; c < cols; ++c) {
        const uint64_t h = rng();
        uint32_t bits;
        if (h % 97 == 0)
          bits = AdversarialBits(from, static_cast<int>((h >> 8) % kBlockClasses), h >> 12, false);
        else
          bits = BitsOf(Normal(h, std::max(hi - 30, -149), std::min(hi, 127)), from);
        std::memcpy(values.data() + (r * cols + c) * size, &bits, static_cast<size_t>(size));
      }
    }
    for (QuantFormat format : {QuantFormat::kBlockFp8, QuantFormat::kMxfp8}) {
      const bool mx = format == QuantFormat::kMxfp8;
      for (CopyOp op : {CopyOp::kQuantize, CopyOp::kScale}) {
        INFO(DTypeName(from) << " " << (mx ? "mxfp8" : "block fp8")
                             << (op == CopyOp::kScale ? " scales" : " codes"));
        PackBoth(Region(op, format, mx ? 1 : 128, mx ? 32 : 128, rows, cols, from), values, stream);
        if (!mx)
          PackBoth(Region(op, format, 1, 32, rows, cols, from), values,
                   stream);  // small block fp8 blocks
      }
    }
  }
  cudaStreamDestroy(stream);
}

// A block far larger than any engine uses (4096 x 4096, uint16's range allows it): one warp's
// unit, the same bytes.
TEST_CASE("GPU quantization of one 4096 x 4096 block matches the host twin", "[fp8]") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const int64_t n = 4096;
  std::vector<std::byte> values(static_cast<size_t>(n * n * 2));
  std::mt19937_64 rng(7);
  for (int64_t i = 0; i < n * n; ++i) {
    const uint32_t bits = BitsOf(Normal(rng(), -12, 6), DType::kBF16);
    std::memcpy(values.data() + i * 2, &bits, 2);
  }
  for (CopyOp op : {CopyOp::kQuantize, CopyOp::kScale}) {
    PackBoth(Region(op, QuantFormat::kBlockFp8, n, n, n, n, DType::kBF16), values, stream);
  }
  cudaStreamDestroy(stream);
}

// MakeItemCases' case of that name.
std::optional<ItemCase> FindItemCase(const std::string& name) {
  for (ItemCase& k : MakeItemCases(0, 11)) {
    if (k.name == name) return std::move(k);
  }
  return std::nullopt;
}

}  // namespace
// The aligned kernel (what the backend launches for AlignedOnly work) and the general one give
// the same bytes on the same aligned work: each through both, in both unit orders.
TEST_CASE("the aligned kernel and the general one agree on aligned work") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const std::optional<ItemCase> c = FindItemCase("long aligned runs");
  REQUIRE(c.has_value());
  const std::vector<std::byte> want = ReferenceCopy(*c);
  DeviceBuffer src(c->src.size()), dst(static_cast<size_t>(c->dst_bytes));
  REFIT_CUDA_CHECK(cudaMemcpy(src.get(), c->src.data(), c->src.size(), cudaMemcpyHostToDevice));
  const CopyWork w = ItemCaseWork(*c, src.address(), dst.address());
  REQUIRE(AlignedOnly(w));
  const int before = aligned_launches;
  for (int round = 0; round < 4; ++round) {
    REFIT_CUDA_CHECK(cudaMemset(dst.get(), static_cast<int>(kPoison), dst.size()));
    Run(w, stream);
    INFO("launch " << round);
    REQUIRE(Download(dst.address(), want.size()) == want);
  }
  CHECK(aligned_launches - before == 2);
  cudaStreamDestroy(stream);
}

// Work launched ahead of its round (LaunchGate, then copies with the gate): it copies when the host
// word says go, and writes nothing when it says the round was called off (go + 1) or holds an
// older round's go; both kernels, gated the same; the gate reports what it decided.
TEST_CASE("gated copies copy only when their host word says go") {
  if (GpuCount() == 0) FAIL(kNeedsGpu);
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const std::optional<ItemCase> c = FindItemCase("long aligned runs");
  REQUIRE(c.has_value());
  const std::vector<std::byte> want = ReferenceCopy(*c);
  DeviceBuffer src(c->src.size()), dst(static_cast<size_t>(c->dst_bytes)), gate(sizeof(uint32_t));
  REFIT_CUDA_CHECK(cudaMemcpy(src.get(), c->src.data(), c->src.size(), cudaMemcpyHostToDevice));
  const CopyWork w = ItemCaseWork(*c, src.address(), dst.address());
  REQUIRE(AlignedOnly(w));
  DeviceBuffer d_items(w.items.size() * sizeof(CopyItem)),
      d_begin(w.unit_begin.size() * sizeof(int64_t));
  REFIT_CUDA_CHECK(
      cudaMemcpy(d_items.get(), w.items.data(), d_items.size(), cudaMemcpyHostToDevice));
  REFIT_CUDA_CHECK(
      cudaMemcpy(d_begin.get(), w.unit_begin.data(), d_begin.size(), cudaMemcpyHostToDevice));
  uint32_t* word = nullptr;
  REFIT_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&word), sizeof(uint32_t), cudaHostAllocMapped));
  uint32_t* word_on_gpu = nullptr;
  REFIT_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&word_on_gpu), word, 0));
  uint32_t* decided = nullptr;
  REFIT_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&decided), sizeof(uint32_t), cudaHostAllocMapped));
  uint32_t* decided_on_gpu = nullptr;
  REFIT_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&decided_on_gpu), decided, 0));
  const std::vector<std::byte> poisoned(want.size(), static_cast<std::byte>(kPoison));
  // (word, go, copies?): go; called off; an older round's go; a word past go (a later round's).
  const std::tuple<uint32_t, uint32_t, bool> runs[] = {
      {6, 6, true}, {7, 6, false}, {4, 6, false}, {9, 8, false}};
  for (const auto& [value, go, copies] : runs) {
    for (bool aligned : {true, false}) {
      REFIT_CUDA_CHECK(cudaMemset(dst.get(), static_cast<int>(kPoison), dst.size()));
      *reinterpret_cast<volatile uint32_t*>(word) = value;
      *reinterpret_cast<volatile uint32_t*>(decided) = 12345;
      REFIT_CUDA_CHECK(
          LaunchGate(word_on_gpu, go, static_cast<uint32_t*>(gate.get()), decided_on_gpu, stream));
      REFIT_CUDA_CHECK(LaunchCopyItems(
          static_cast<const CopyItem*>(d_items.get()), static_cast<const int64_t*>(d_begin.get()),
          static_cast<int>(w.items.size()), w.unit_begin.back(), stream, false, aligned,
          static_cast<const uint32_t*>(gate.get()), go));
      REFIT_CUDA_CHECK(cudaStreamSynchronize(stream));
      INFO("word " << value << " go " << go << " aligned kernel " << aligned);
      CHECK(Download(dst.address(), want.size()) == (copies ? want : poisoned));
      CHECK(*reinterpret_cast<volatile uint32_t*>(decided) == (copies ? go : 0u));
    }
  }
  cudaFreeHost(word);
  cudaFreeHost(decided);
  cudaStreamDestroy(stream);
}

}  // namespace refit
