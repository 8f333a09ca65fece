// The CUDA copy kernels against the CPU reference on random plans (casts, strides, ranks up to 4,
// odd sizes and odd staging alignments): every staging byte of every message and every
// destination byte must match. And the quantizing units (fp8 on the way: kQuantize, kScale;
// block fp8 and MXFP8; bf16, fp16 and fp32 sources) against the host twin, RunCopyWorkOnHost,
// bit for bit, on adversarial and random blocks (tests tagged [fp8]). Skips, passing, where no
// GPU is present.
#include "kernels/copy_kernels.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_check.h"
#include "kernels/test_plans.h"
#include "plan/convert.h"
#include "plan/flat_range.h"
#include "plan/fp8_block.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
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
  // Every other launch in the spread unit order: both orders must give the same bytes.
  static int launches = 0;
  const bool spread = launches++ % 2 == 1;
  REFIT_CUDA_CHECK(LaunchCopyItems(static_cast<const CopyItem*>(items.get()), static_cast<const int64_t*>(begin.get()),
                                   static_cast<int>(w.items.size()), w.unit_begin.back(), stream, spread));
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

// ---- Plans with quantizing descriptors, and adversarial sources for them. ----
// (The same helpers are in copy_items_test.cc and copy_kernels_test.cc; AddQuantized and
// AddFlatShard are plan/quantize_plan_test.cc's.)

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A quantized destination tensor split along `dim` at `boundaries` (block multiples): part i on
// worker prefix+i holds its codes and the scales of its blocks, each in a buffer of its own.
void AddQuantized(Layout& layout, const std::string& name, Dims shape, QuantFormat format, int64_t block_rows,
                  int64_t block_cols, int dim, const std::vector<int64_t>& boundaries,
                  const std::vector<testing::Placement>& placement, const std::string& prefix) {
  const Quantization q = Quantization::Of(format, name, block_rows, block_cols);
  int32_t w = -1, s = -1;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    if (layout.tensors[i].name == name) w = static_cast<int32_t>(i);
    if (layout.tensors[i].name == q.scale) s = static_cast<int32_t>(i);
  }
  const int64_t block[2] = {q.block_rows, q.block_cols};
  const Dims grid{CeilDiv(shape[0], block[0]), CeilDiv(shape[1], block[1])};
  if (w < 0) {
    w = layout.AddTensor(name, shape, DType::kF8E4M3);
    layout.tensors[w].quant = q;
    s = layout.AddTensor(q.scale, grid, q.ScaleDType());
  }
  for (size_t i = 0; i + 1 < boundaries.size(); ++i) {
    const std::string wname = absl::StrCat(prefix, i);
    int32_t worker = -1;
    for (size_t k = 0; k < layout.workers.size(); ++k) {
      if (layout.workers[k].name == wname) worker = static_cast<int32_t>(k);
    }
    if (worker < 0) worker = layout.AddWorker(wname, placement[i].node, placement[i].gpu);
    Box box = Box::Whole(shape);
    box.origin[dim] = boundaries[i];
    box.shape[dim] = boundaries[i + 1] - boundaries[i];
    const int32_t codes = layout.AddBuffer(worker, name, DType::kF8E4M3, box.shape_dims());
    layout.AddPiece(w, box, codes, Box::Whole(box.shape_dims()));
    Box blocks = Box::Whole(grid);
    blocks.origin[dim] = boundaries[i] / block[dim];
    blocks.shape[dim] = CeilDiv(boundaries[i + 1], block[dim]) - blocks.origin[dim];
    const int32_t scales = layout.AddBuffer(worker, q.scale, q.ScaleDType(), blocks.shape_dims());
    layout.AddPiece(s, blocks, scales, Box::Whole(blocks.shape_dims()));
  }
}

// An FSDP flat shard: tensor elements [begin, end) in row-major order, in one flat buffer.
void AddFlatShard(Layout& layout, int32_t tensor, int32_t worker, int64_t begin, int64_t end) {
  const LogicalTensor& t = layout.tensors[tensor];
  const int32_t buffer = layout.AddBuffer(worker, absl::StrCat(t.name, "@", begin), t.dtype, Dims{end - begin});
  int64_t at = 0;
  for (const Box& b : FlatRangeToBoxes(t.shape, begin, end)) {
    layout.AddPiece(tensor, b, buffer, Box::FromDims(Dims{at}, Dims{b.NumElements()}));
    at += b.NumElements();
  }
}

struct QuantCase {
  std::string name;
  Layout src, dst;
  Plan plan;
  int64_t block_rows = 0, block_cols = 0;  // of the quantized tensors (the fill's block classes)
};

QuantCase Finish(std::string name, Layout src, Layout dst, int64_t br, int64_t bc, int64_t max_message_bytes) {
  QuantCase c{std::move(name), std::move(src), std::move(dst), {}, br, bc};
  REQUIRE(ValidateLayout(c.src, "source").ok());
  REQUIRE(ValidateLayout(c.dst, "destination").ok());
  PlanOptions options;
  options.max_message_bytes = max_message_bytes;
  options.topology.gpus_per_node = 8;
  auto plan = MakePlan(c.src, c.dst, options);
  INFO(c.name << ": " << plan.status().message());
  REQUIRE(plan.ok());
  c.plan = *std::move(plan);
  return c;
}

// Fixed cases (both ops, both formats, bf16 / fp16 / fp32 sources, whole blocks quantized in the
// pack step, cut blocks gathered into scratch and quantized from there in stage 1, partial edge
// blocks, NVLink fan-out of codes, colocated, copy descriptors beside them), then random ones.
std::vector<QuantCase> QuantCases(int random_trials) {
  using testing::AddSplitTensor;
  using testing::EvenSplit;
  std::vector<QuantCase> cases;
  const DType floats[] = {DType::kBF16, DType::kF16, DType::kF32};
  for (DType from : floats) {
    for (int64_t max_message : {int64_t{64} << 20, int64_t{5000}}) {
      Layout src, dst;
      AddSplitTensor(src, "w", Dims{300, 200}, from, 0, {0, 128, 300}, {{0, 0}, {0, 1}}, "t");
      AddQuantized(dst, "w", Dims{300, 200}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256, 300}, {{1, 0}, {1, 1}}, "e");
      AddSplitTensor(src, "b", Dims{37, 50}, DType::kF32, 0, {0, 37}, {{0, 0}}, "t");
      AddSplitTensor(dst, "b", Dims{37, 50}, DType::kBF16, 1, {0, 20, 50}, {{1, 0}, {1, 1}}, "e");
      cases.push_back(Finish(absl::StrCat("whole blocks from ", DTypeName(from), " max ", max_message), src, dst, 128,
                             128, max_message));
    }
    {
      Layout src, dst;  // FSDP2 over 4 ranks: every block cut in two, gathered into scratch
      AddSplitTensor(src, "w", Dims{256, 256}, from, 0, EvenSplit(256, 4), {{0, 0}, {0, 1}, {0, 2}, {0, 3}}, "f");
      AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 128, 256}, {{1, 0}, {1, 1}}, "tp");
      cases.push_back(Finish(absl::StrCat("gathered from ", DTypeName(from)), src, dst, 128, 128, int64_t{64} << 20));
    }
    {
      Layout src, dst;  // MXFP8, a column cut inside a block, small messages
      AddSplitTensor(src, "w", Dims{64, 100}, from, 1, {0, 50, 100}, {{0, 0}, {0, 1}}, "t");
      AddQuantized(dst, "w", Dims{64, 100}, QuantFormat::kMxfp8, 1, 32, 1, {0, 64, 100}, {{1, 0}, {1, 1}}, "e");
      cases.push_back(Finish(absl::StrCat("mxfp8 from ", DTypeName(from)), src, dst, 1, 32, 300));
    }
    {
      Layout src, dst;  // MXFP8 whole rows: thousands of 1x32 units; replicas fanned out by NVLink
      AddSplitTensor(src, "w", Dims{96, 1000}, from, 0, {0, 40, 96}, {{0, 0}, {0, 1}}, "t");
      AddQuantized(dst, "w", Dims{96, 1000}, QuantFormat::kMxfp8, 1, 32, 0, {0, 96}, {{1, 0}}, "a");
      AddQuantized(dst, "w", Dims{96, 1000}, QuantFormat::kMxfp8, 1, 32, 0, {0, 96}, {{1, 1}}, "b");
      cases.push_back(Finish(absl::StrCat("mxfp8 rows from ", DTypeName(from)), src, dst, 1, 32, int64_t{64} << 20));
    }
  }
  {
    Layout src, dst;  // FSDP flat ranges: whole and cut blocks
    const Dims shape{384, 256};
    const int32_t t = src.AddTensor("w", shape, DType::kBF16);
    const std::vector<int64_t> cuts = {0, 40000, 70001, 384 * 256};
    for (size_t r = 0; r + 1 < cuts.size(); ++r) {
      AddFlatShard(src, t, src.AddWorker(absl::StrCat("fsdp", r), 0, static_cast<int32_t>(r)), cuts[r], cuts[r + 1]);
    }
    AddQuantized(dst, "w", shape, QuantFormat::kBlockFp8, 128, 128, 1, {0, 128, 256}, {{1, 0}, {1, 1}}, "tp");
    cases.push_back(Finish("flat ranges", src, dst, 128, 128, int64_t{64} << 20));
  }
  {
    Layout src, dst;  // colocated: the pack step quantizes locally
    AddSplitTensor(src, "w", Dims{128, 512}, DType::kF32, 1, {0, 256, 512}, {{0, 0}, {0, 1}}, "t");
    AddQuantized(dst, "w", Dims{128, 512}, QuantFormat::kBlockFp8, 128, 128, 1, {0, 256, 512}, {{0, 0}, {0, 1}}, "e");
    cases.push_back(Finish("colocated", src, dst, 128, 128, int64_t{64} << 20));
  }
  std::mt19937_64 rng(23);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int trial = 0; trial < random_trials; ++trial) {
    const bool mx = uniform(0, 3) == 0;
    const int64_t br = mx ? 1 : uniform(1, 3) * 4, bc = mx ? 32 : uniform(1, 3) * 4;
    const Dims shape{uniform(1, 40), uniform(1, 70)};
    Layout src, dst;
    const int32_t t = src.AddTensor("w", shape, floats[uniform(0, 2)]);
    for (int replica = 0; replica < 2; ++replica) {
      const int parts = static_cast<int>(uniform(1, 4));
      std::vector<int64_t> cuts = {0, shape[0] * shape[1]};
      for (int k = 1; k < parts; ++k) cuts.push_back(uniform(0, shape[0] * shape[1]));
      std::sort(cuts.begin(), cuts.end());
      for (size_t k = 0; k + 1 < cuts.size(); ++k) {
        if (cuts[k] == cuts[k + 1]) continue;
        const int32_t worker = src.AddWorker(absl::StrCat("r", replica, "_", k), static_cast<int32_t>(uniform(0, 2)),
                                             static_cast<int32_t>(uniform(0, 3)));
        AddFlatShard(src, t, worker, cuts[k], cuts[k + 1]);
      }
    }
    const int replicas = static_cast<int>(uniform(1, 2));
    for (int replica = 0; replica < replicas; ++replica) {
      const int dim = static_cast<int>(uniform(0, 1));
      const int64_t block = dim == 0 ? br : bc;
      const int64_t blocks = CeilDiv(shape[dim], block);
      std::vector<int64_t> b = {0};
      const int64_t cut = uniform(0, blocks);
      if (cut > 0 && cut < blocks) b.push_back(cut * block);
      b.push_back(shape[dim]);
      std::vector<testing::Placement> at;
      for (size_t k = 0; k + 1 < b.size(); ++k) {
        at.push_back({static_cast<int32_t>(uniform(0, 2)), static_cast<int32_t>(uniform(0, 3))});
      }
      AddQuantized(dst, "w", shape, mx ? QuantFormat::kMxfp8 : QuantFormat::kBlockFp8, br, bc, dim, b, at,
                   absl::StrCat("e", replica, "_"));
    }
    cases.push_back(Finish(absl::StrCat("random ", trial, " ", shape.ToString(), " block ", br, "x", bc), src, dst, br,
                           bc, uniform(0, 1) ? 64 : int64_t{1} << 20));
  }
  return cases;
}

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The element's bits in `dt` (bf16, fp16, fp32): `v` rounded, or special patterns.
uint32_t BitsOf(float v, DType dt) {
  uint32_t u = 0;
  ConvertElements(reinterpret_cast<const std::byte*>(&v), DType::kF32, reinterpret_cast<std::byte*>(&u), dt, 1);
  return u;
}
uint32_t SignOf(DType dt) { return dt == DType::kF32 ? 0x80000000u : 0x8000u; }
uint32_t MantissaOf(DType dt) { return dt == DType::kF32 ? 0x7FFFFFu : dt == DType::kBF16 ? 0x7Fu : 0x3FFu; }
uint32_t InfOf(DType dt) { return dt == DType::kF32 ? 0x7F800000u : dt == DType::kBF16 ? 0x7F80u : 0x7C00u; }
uint32_t MaxOf(DType dt) { return dt == DType::kF32 ? 0x7F7FFFFFu : dt == DType::kBF16 ? 0x7F7Fu : 0x7BFFu; }
uint32_t NanOf(DType dt, uint64_t h) {  // any sign, any payload
  return ((h & 1) ? SignOf(dt) : 0) | InfOf(dt) | (((h >> 1) & MantissaOf(dt)) | ((MantissaOf(dt) + 1) >> 1));
}

// A normal value: random sign and mantissa, exponent in [lo, hi].
float Normal(uint64_t h, int lo, int hi) {
  const float m = 1.0f + static_cast<float>((h >> 8) & 0x7FFFFF) / 8388608.0f;
  const float v = std::ldexp(m, lo + static_cast<int>((h >> 40) % static_cast<uint64_t>(hi - lo + 1)));
  return (h & 1) ? -v : v;
}

constexpr int kBlockClasses = 12;

// Element bits of block class `cls` (a function of the block), `h` the element's hash, `origin`
// whether it is the block's first element:
//   0 zeros (both signs)          1 any bit pattern            2 subnormals of the dtype
//   3 amax 448 (scale 1), exact e4m3 values and the ties between them (round to even)
//   4 amax in [256, 512) * 2^e: MXFP8's values past 448 * X saturate; block fp8 rounds near 448
//   5 NaN (both signs) among normals    6 +-inf among normals    7 one huge value (the dtype's max)
//   8 nothing finite (scale 1)    9 tiny normals (amax / 448 below FLT_MIN)   10, 11 normals
uint32_t AdversarialBits(DType dt, int cls, uint64_t h, bool origin) {
  const uint32_t sign = (h & 1) ? SignOf(dt) : 0;
  switch (cls) {
    case 0: return sign;
    case 1: return static_cast<uint32_t>(h >> 16) & (dt == DType::kF32 ? 0xFFFFFFFFu : 0xFFFFu);
    case 2: return sign | (static_cast<uint32_t>(h >> 8) & MantissaOf(dt));
    case 3: {
      if (origin) return BitsOf((h & 1) ? -448.0f : 448.0f, dt);
      const uint8_t k = static_cast<uint8_t>((h >> 8) % 0x7E);  // a finite code below 448
      const float lo = E4M3ToFloat(k), hi = E4M3ToFloat(static_cast<uint8_t>(k + 1));
      const float v = (h >> 20) % 3 == 0 ? lo : (h >> 20) % 3 == 1 ? (lo + hi) / 2 : std::nextafter((lo + hi) / 2, hi);
      return BitsOf((h & 2) ? -v : v, dt);
    }
    case 4: {
      const int e = static_cast<int>((h >> 50) % 9) - 4;
      const float v = std::ldexp(origin ? 256.0f + static_cast<float>((h >> 8) % 256) : 448.0f + static_cast<float>((h >> 8) % 64), e);
      return BitsOf((h & 1) ? -v : v, dt);
    }
    case 5: return (h >> 8) % 4 == 0 ? NanOf(dt, h >> 10) : BitsOf(Normal(h, -6, 6), dt);
    case 6: return (h >> 8) % 4 == 0 ? sign | InfOf(dt) : BitsOf(Normal(h, -6, 6), dt);
    case 7: return origin ? sign | MaxOf(dt) : BitsOf(Normal(h, -10, 4), dt);
    case 8: return (h >> 8) % 2 == 0 ? NanOf(dt, h >> 10) : sign | InfOf(dt);
    case 9: return BitsOf(Normal(h, -126, -118), dt);
    default: return BitsOf(Normal(h, -20, 20), dt);
  }
}

// Fills every source piece: tensors the destination quantizes get a block class per block of
// block_rows x block_cols (seeded), the others normals (exponents -8..8: exact casts both ways).
void FillAdversarial(const Layout& src, const Layout& dst, const BufferMemory& memory, uint64_t seed, int64_t br,
                     int64_t bc) {
  for (const Piece& p : src.pieces) {
    const LogicalTensor& t = src.tensors[p.tensor];
    auto d = dst.tensor_index.find(t.name);
    const bool quantized = d != dst.tensor_index.end() && dst.tensors[d->second].quant.format != QuantFormat::kNone;
    const Box& box = src.tensor_box(p);
    const Buffer& buffer = src.buffers[p.buffer];
    const PieceView view = *ViewOf(box, src.buffer_box(p), buffer.shape);
    const int size = DTypeSize(t.dtype);
    REQUIRE(box.rank == 2);
    for (int64_t i = 0; i < box.shape[0]; ++i) {
      for (int64_t j = 0; j < box.shape[1]; ++j) {
        const int64_t r = box.origin[0] + i, c = box.origin[1] + j;
        const uint64_t h = Mix(seed ^ Mix(Mix(std::hash<std::string>{}(t.name)) + static_cast<uint64_t>(r * t.shape[1] + c)));
        uint32_t bits;
        if (quantized) {
          const uint64_t block = Mix(seed * 31 + static_cast<uint64_t>((r / br) * 1000003 + c / bc));
          bits = AdversarialBits(t.dtype, static_cast<int>(block % kBlockClasses), h, r % br == 0 && c % bc == 0);
        } else {
          bits = BitsOf(Normal(h, -8, 8), t.dtype);
        }
        std::memcpy(memory[p.buffer].data() + (view.offset + i * view.strides[0] + j * view.strides[1]) * size, &bits,
                    static_cast<size_t>(size));
      }
    }
  }
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
      REFIT_CUDA_CHECK(cudaMemcpy(buffers[i]->get(), h[i].data(), h[i].size(), cudaMemcpyHostToDevice));
    }
  }
  void Download(const BufferMemory& h) const {
    for (size_t i = 0; i < buffers.size(); ++i) {
      REFIT_CUDA_CHECK(cudaMemcpy(h[i].data(), buffers[i]->get(), h[i].size(), cudaMemcpyDeviceToHost));
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
  bool operator==(const DestinationMemory& o) const { return buffers.storage == o.buffers.storage && scratch == o.scratch; }
};

std::vector<std::byte> Download(uint64_t at, size_t bytes) {
  std::vector<std::byte> out(bytes);
  REFIT_CUDA_CHECK(cudaMemcpy(out.data(), reinterpret_cast<const void*>(at), bytes, cudaMemcpyDeviceToHost));
  return out;
}

TEST_CASE("GPU quantizing units match the host twin bit for bit on adversarial plans", "[fp8]") {
  if (GpuCount() == 0) {
    WARN("no GPU here: skipped");
    return;
  }
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  int64_t messages = 0, quantizing = 0;
  for (QuantCase& qc : QuantCases(60)) {
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      INFO(qc.name << ", fill " << seed);
      HostBuffers src(qc.src);
      const FillSpec spec = MakeFillSpec(qc.src, qc.dst, seed);
      if (seed == 1) FillSources(qc.src, spec, src.memory);
      else FillAdversarial(qc.src, qc.dst, src.memory, seed, qc.block_rows, qc.block_cols);
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
          RunCopyWorkOnHost(PackWork(qc.plan, m, src.addresses(), host.buffers.addresses(), at, segment));
          DeviceBuffer dstaging(static_cast<size_t>(m.bytes) + 16);
          const uint64_t dat = dstaging.address() + seed % 7;  // odd alignments too
          Run(PackWork(qc.plan, m, dsrc.addresses(), ddst.addresses(), dat, segment), stream);
          REQUIRE(Download(dat, static_cast<size_t>(m.bytes)) ==
                  std::vector<std::byte>(staging.begin() + seed % 7, staging.begin() + seed % 7 + m.bytes));
          RunCopyWorkOnHost(UnpackWork(qc.plan, m, at, host.buffers.addresses(), segment));
          Run(UnpackWork(qc.plan, m, dat, ddst.addresses(), segment), stream);
          ++messages;
          for (int64_t k = 0; k < m.num_descriptors; ++k) quantizing += qc.plan.descriptor(m, k).Quantizes();
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
          RunCopyWorkOnHost(DirectWork(qc.plan, m, src.addresses(), host2.buffers.addresses(), 128));
          Run(DirectWork(qc.plan, m, dsrc.addresses(), ddst2.addresses(), 128), stream);
        }
      }
      ddst2.Download(got2.buffers.memory);
      REQUIRE(host2 == got2);
      REQUIRE(host2 == host);
    }
  }
  WARN("checked " << messages << " messages (" << quantizing << " quantizing descriptors) on the GPU");
  cudaStreamDestroy(stream);
}

// Quantizing units mixed with copy units in one launch, hundreds of thousands of units (batches
// of 32 per warp, the last partial): every message's staging against the host twin's.
TEST_CASE("one launch mixing quantizing and copy units matches the host twin", "[fp8]") {
  if (GpuCount() == 0) {
    WARN("no GPU here: skipped");
    return;
  }
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
    add(qc.src, qc.dst, qc.plan, [&](HostBuffers& h) { FillAdversarial(qc.src, qc.dst, h.memory, 5, qc.block_rows, qc.block_cols); });
  }
  for (auto& run : runs) add(run->t.src, run->t.dst, run->t.plan, [&](HostBuffers& h) { FillSources(run->t.src, run->spec, h.memory); });
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
                        reinterpret_cast<uint64_t>(host_staging.data()) + at, 2), host);
    AppendWork(PackWork(*plan, *m, s.dsrc->addresses(), s.ddst->addresses(), staging.address() + at, 2), device);
    offset += m->bytes + 16;
  }
  int64_t quantizing_units = 0;
  for (size_t i = 0; i < device.items.size(); ++i) {
    if (device.items[i].Quantizes()) quantizing_units += device.items[i].Units();
  }
  INFO(device.unit_begin.back() << " units, " << quantizing_units << " quantizing");
  REQUIRE(device.unit_begin.back() > 32 * 8192);
  REQUIRE(quantizing_units > 10000);
  RunCopyWorkOnHost(host);
  Run(device, stream);
  REQUIRE(Download(staging.address(), staging.size()) == host_staging);
  cudaStreamDestroy(stream);
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
      const float lo = E4M3ToFloat(static_cast<uint8_t>(k)), hi = k == 0x7E ? 464.0f : E4M3ToFloat(static_cast<uint8_t>(k + 1));
      for (float m : {(lo + hi) / 2, lo}) {
        uint32_t mid;
        std::memcpy(&mid, &m, 4);
        for (int32_t delta = -8; delta <= 8; ++delta) add(sign | static_cast<uint32_t>(static_cast<int32_t>(mid) + delta));
      }
    }
    for (float f : {464.0f, 480.0f, 496.0f, 511.99f}) {
      uint32_t b;
      std::memcpy(&b, &f, 4);
      for (int32_t delta = -8; delta <= 8; ++delta) add(sign | static_cast<uint32_t>(static_cast<int32_t>(b) + delta));
    }
    for (uint32_t bits = 0; bits < 0x44000000u; bits += stride) add(sign | bits);  // up to 512
    for (uint32_t bits : {0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0x00000001u, 0x007FFFFFu}) add(sign | bits);
  }
  while (v.size() % 32 != 0) v.push_back(-0.0f);
  return v;
}

// One item over `rows` x `cols` fp32 values in device memory `src` (rows packed), writing codes or
// scales at `dst`, with its host twin at the host addresses.
CopyDescriptor Region(CopyOp op, QuantFormat format, int64_t br, int64_t bc, int64_t rows, int64_t cols, DType from) {
  CopyDescriptor d;
  d.op = op;
  d.quant_format = static_cast<uint8_t>(format);
  d.block_rows = static_cast<uint16_t>(br);
  d.block_cols = static_cast<uint16_t>(bc);
  d.src_dtype = from;
  d.dst_dtype = op == CopyOp::kQuantize ? DType::kF8E4M3 : format == QuantFormat::kMxfp8 ? DType::kE8M0 : DType::kF32;
  d.outer_rank = 1;
  d.count[0] = rows;
  d.inner = cols;
  d.src_stride[0] = cols;
  d.dst_stride[0] = op == CopyOp::kQuantize ? cols : CeilDiv(cols, bc);
  return d;
}

// Packs `d` from `values` (host bytes of d.src_dtype) on the host twin and on the GPU; the two
// outputs must be equal. Returns the output.
std::vector<std::byte> PackBoth(const CopyDescriptor& d, const std::vector<std::byte>& values, cudaStream_t stream) {
  DeviceBuffer dsrc(values.size()), dout(static_cast<size_t>(d.WireBytes()) + 8);
  REFIT_CUDA_CHECK(cudaMemcpy(dsrc.get(), values.data(), values.size(), cudaMemcpyHostToDevice));
  std::vector<std::byte> out(static_cast<size_t>(d.WireBytes()) + 8, kPoison);
  CopyWork host, device;
  AppendPackItem(d, {reinterpret_cast<uint64_t>(values.data())}, {}, reinterpret_cast<uint64_t>(out.data()) + 1, 16384, host);
  AppendPackItem(d, {dsrc.address()}, {}, dout.address() + 1, 16384, device);  // odd: scales unaligned
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

TEST_CASE("GPU codes are FloatToE4M3 itself across e4m3's range, ties and saturation included", "[fp8]") {
  if (GpuCount() == 0) {
    WARN("no GPU here: skipped");
    return;
  }
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  for (bool mx : {true, false}) {
    const std::vector<float> values = mx ? SweepValues(257, 256.0f, 511.99f) : SweepValues(257, 448.0f, 448.0f);
    const int64_t rows = static_cast<int64_t>(values.size() / 32);
    INFO((mx ? "mxfp8" : "block fp8") << ", " << values.size() << " values");
    const auto codes = PackBoth(Region(CopyOp::kQuantize, mx ? QuantFormat::kMxfp8 : QuantFormat::kBlockFp8, 1, 32, rows, 32,
                                       DType::kF32),
                                AsBytes(values), stream);
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      if (static_cast<uint8_t>(codes[i + 1]) != FloatToE4M3(values[i]) && wrong++ == 0) first = i;
    }
    INFO(wrong << " wrong, the first " << values[first] << " (index " << first << "): "
               << int{static_cast<uint8_t>(codes[first + 1])} << " for " << int{FloatToE4M3(values[first])});
    REQUIRE(wrong == 0);
    const auto scales = PackBoth(Region(CopyOp::kScale, mx ? QuantFormat::kMxfp8 : QuantFormat::kBlockFp8, 1, 32, rows, 32,
                                        DType::kF32),
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
  if (GpuCount() == 0) {
    WARN("no GPU here: skipped");
    return;
  }
  cudaStream_t stream;
  REFIT_CUDA_CHECK(cudaStreamCreate(&stream));
  std::mt19937_64 rng(99);
  for (DType from : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t rows = 4096, cols = 1024;  // block fp8: 32 x 8 blocks of 128; MXFP8: 131072 blocks
    const int size = DTypeSize(from);
    std::vector<std::byte> values(static_cast<size_t>(rows * cols * size));
    for (int64_t r = 0; r < rows; ++r) {
      // Each row keeps to a band of exponents, so that its blocks' amaxes span all of them.
      const int hi = static_cast<int>(rng() % 270) - 140;  // Normal() below: exponents in [hi - 30, hi], clamped
      for (int64_t c = 0; c < cols; ++c) {
        const uint64_t h = rng();
        uint32_t bits;
        if (h % 97 == 0) bits = AdversarialBits(from, static_cast<int>((h >> 8) % kBlockClasses), h >> 12, false);
        else bits = BitsOf(Normal(h, std::max(hi - 30, -149), std::min(hi, 127)), from);
        std::memcpy(values.data() + (r * cols + c) * size, &bits, static_cast<size_t>(size));
      }
    }
    for (QuantFormat format : {QuantFormat::kBlockFp8, QuantFormat::kMxfp8}) {
      const bool mx = format == QuantFormat::kMxfp8;
      for (CopyOp op : {CopyOp::kQuantize, CopyOp::kScale}) {
        INFO(DTypeName(from) << " " << (mx ? "mxfp8" : "block fp8") << (op == CopyOp::kScale ? " scales" : " codes"));
        PackBoth(Region(op, format, mx ? 1 : 128, mx ? 32 : 128, rows, cols, from), values, stream);
        if (!mx) PackBoth(Region(op, format, 1, 32, rows, cols, from), values, stream);  // small block fp8 blocks
      }
    }
  }
  cudaStreamDestroy(stream);
}

// A block far larger than any engine uses (4096 x 4096, uint16's range allows it): one warp's
// unit, the same bytes.
TEST_CASE("GPU quantization of one 4096 x 4096 block matches the host twin", "[fp8]") {
  if (GpuCount() == 0) {
    WARN("no GPU here: skipped");
    return;
  }
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

}  // namespace
}  // namespace refit
