// Copy items against the CPU reference (plan/host_copy.h): packing and unpacking every message
// of real plans through items gives the same bytes, for casts, strides, ranks and odd sizes; and
// for plans that quantize to fp8 on the way (kQuantize, kScale; block fp8 and MXFP8) on
// adversarial sources.
#include "kernels/copy_items.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
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

TEST_CASE("items pack and unpack exactly like the CPU reference") {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    TestRun run(seed);
    auto& [t, src, ref, got, spec] = run;
    for (int stage = 0; stage < kMaxStages; ++stage) {
      for (const Message& m : t.plan.messages) {
        if (m.stage != stage) continue;
        std::vector<std::byte> want, staging(static_cast<size_t>(m.bytes) + 16);
        PackMessage(t.plan, m, src.memory, ref.memory, want);
        // Staging at an odd address: the kernels must not assume alignment.
        const uint64_t at = reinterpret_cast<uint64_t>(staging.data()) + (seed % 3);
        CopyWork pack = PackWork(t.plan, m, src.addresses(), got.addresses(), at, 64);
        REQUIRE(pack.bytes == m.bytes);
        RunCopyWorkOnHost(pack);
        REQUIRE(std::memcmp(want.data(), reinterpret_cast<const void*>(at), want.size()) == 0);
        UnpackMessage(t.plan, m, want, ref.memory);
        RunCopyWorkOnHost(UnpackWork(t.plan, m, at, got.addresses(), 64));
      }
    }
    for (size_t b = 0; b < t.dst.buffers.size(); ++b) {
      INFO("seed " << seed << " buffer " << b);
      REQUIRE(ref.storage[b] == got.storage[b]);
    }
    auto checked = CheckDestinations(t.src, t.dst, spec, got.memory);
    INFO(checked.status().message());
    REQUIRE(checked.ok());
  }
}

TEST_CASE("direct items (no staging) give the CPU reference's destinations") {
  for (uint64_t seed = 100; seed <= 130; ++seed) {
    TestRun run(seed);
    auto& [t, src, ref, got, spec] = run;
    ExecuteOnHost(t.plan, src.memory, ref.memory);
    for (int stage = 0; stage < kMaxStages; ++stage) {
      for (const Message& m : t.plan.messages) {
        if (m.stage == stage) RunCopyWorkOnHost(DirectWork(t.plan, m, src.addresses(), got.addresses(), 128));
      }
    }
    for (size_t b = 0; b < t.dst.buffers.size(); ++b) REQUIRE(ref.storage[b] == got.storage[b]);
  }
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

// Destination memory with the plan's scratch buffers after the layout's.
struct DestinationMemory {
  HostBuffers buffers;
  std::vector<std::vector<std::byte>> scratch;
  DestinationMemory(const Layout& l, const Plan& plan) : buffers(l) {
    scratch = AllocateScratch(plan, buffers.memory);
    PoisonDestinations(buffers.memory);
  }
  bool operator==(const DestinationMemory& o) const { return buffers.storage == o.buffers.storage && scratch == o.scratch; }
};

// The units of quantizing items: one per block, never a block split.
void CheckQuantizingUnits(const Plan& plan, const Message& m, const CopyWork& w) {
  size_t item = 0;
  for (int64_t k = 0; k < m.num_descriptors; ++k) {
    const CopyDescriptor& d = plan.descriptor(m, k);
    const CopyItem& it = w.items[item++];
    CHECK(it.Quantizes() == d.Quantizes());
    if (!d.Quantizes()) continue;
    CHECK(it.Units() == CeilDiv(d.count[0], d.block_rows) * CeilDiv(d.inner, d.block_cols));
    CHECK(it.block_rows == d.block_rows);
    CHECK(it.block_cols == d.block_cols);
  }
  CHECK(item == w.items.size());
}

TEST_CASE("quantizing items pack, unpack and copy directly exactly like the CPU reference") {
  int64_t quantizing = 0, scales = 0, from_scratch = 0, messages = 0;
  for (QuantCase& qc : QuantCases(40)) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      INFO(qc.name << ", fill " << seed);
      HostBuffers src(qc.src);
      // Fill 1: the verifier's values (so the whole-tensor reference checks the result too);
      // then adversarial blocks.
      const FillSpec spec = MakeFillSpec(qc.src, qc.dst, seed);
      if (seed == 1) FillSources(qc.src, spec, src.memory);
      else FillAdversarial(qc.src, qc.dst, src.memory, seed, qc.block_rows, qc.block_cols);
      // Staged: pack, then unpack, stage by stage.
      DestinationMemory ref(qc.dst, qc.plan), got(qc.dst, qc.plan);
      for (int stage = 0; stage < kMaxStages; ++stage) {
        for (const Message& m : qc.plan.messages) {
          if (m.stage != stage) continue;
          std::vector<std::byte> want, staging(static_cast<size_t>(m.bytes) + 16, kPoison);
          PackMessage(qc.plan, m, src.memory, ref.buffers.memory, want);
          const uint64_t at = reinterpret_cast<uint64_t>(staging.data()) + (seed % 3);  // odd addresses
          const int64_t segment = seed % 2 ? 64 : 16384;
          CopyWork pack = PackWork(qc.plan, m, src.addresses(), got.buffers.addresses(), at, segment);
          REQUIRE(pack.bytes == m.bytes);
          CheckQuantizingUnits(qc.plan, m, pack);
          RunCopyWorkOnHost(pack);
          REQUIRE(std::memcmp(want.data(), reinterpret_cast<const void*>(at), want.size()) == 0);
          REQUIRE(staging[static_cast<size_t>(m.bytes) + (seed % 3)] == kPoison);  // nothing past the message
          UnpackMessage(qc.plan, m, want, ref.buffers.memory);
          CopyWork unpack = UnpackWork(qc.plan, m, at, got.buffers.addresses(), segment);
          REQUIRE(unpack.bytes == m.bytes);
          RunCopyWorkOnHost(unpack);
          ++messages;
          for (int64_t k = 0; k < m.num_descriptors; ++k) {
            const CopyDescriptor& d = qc.plan.descriptor(m, k);
            quantizing += d.Quantizes(), scales += d.op == CopyOp::kScale, from_scratch += d.Quantizes() && d.src_is_destination;
          }
        }
      }
      REQUIRE(ref == got);
      if (seed == 1) {
        auto checked = CheckDestinations(qc.src, qc.dst, spec, got.buffers.memory);
        INFO(checked.status().message());
        REQUIRE(checked.ok());
      }
      // Direct: every message straight from its sources to its destinations.
      DestinationMemory ref2(qc.dst, qc.plan), got2(qc.dst, qc.plan);
      ExecuteOnHost(qc.plan, src.memory, ref2.buffers.memory);
      for (int stage = 0; stage < kMaxStages; ++stage) {
        for (const Message& m : qc.plan.messages) {
          if (m.stage == stage) RunCopyWorkOnHost(DirectWork(qc.plan, m, src.addresses(), got2.buffers.addresses(), 128));
        }
      }
      REQUIRE(ref2 == got2);
      REQUIRE(ref2 == ref);
    }
  }
  // Both ops ran, and quantization from gathered scratch (stage 1) too.
  CHECK(quantizing > scales);
  CHECK(scales > 0);
  CHECK(from_scratch > 0);
  WARN(messages << " messages, " << quantizing << " quantizing descriptors (" << scales << " of scales, "
                << from_scratch << " from scratch)");
}

// One MXFP8 item of 1x32 blocks whose first element is 256 (so X = 1 while every |x| < 512):
// its codes are FloatToE4M3(x) itself, for every value of `values`.
CopyItem SweepItem(const std::vector<float>& rows, std::vector<uint8_t>& codes) {
  CopyDescriptor d;
  d.op = CopyOp::kQuantize;
  d.quant_format = static_cast<uint8_t>(QuantFormat::kMxfp8);
  d.block_rows = 1;
  d.block_cols = 32;
  d.src_dtype = DType::kF32;
  d.dst_dtype = DType::kF8E4M3;
  d.outer_rank = 1;
  d.count[0] = static_cast<int64_t>(rows.size() / 32);
  d.inner = 32;
  d.src_stride[0] = 32;
  d.dst_stride[0] = 32;
  codes.assign(rows.size(), 0);
  CopyWork w;
  AppendPackItem(d, {reinterpret_cast<uint64_t>(rows.data())}, {}, reinterpret_cast<uint64_t>(codes.data()), 16384, w);
  return w.items[0];
}

// Values for the e4m3 sweep: every rounding boundary of e4m3 and its neighbours, a stride
// through all of fp32 below 512, both signs, infs and NaNs; laid out in rows of 32 after a 256.
std::vector<float> SweepValues(uint32_t stride) {
  std::vector<float> v;
  auto add = [&](uint32_t bits) {
    if (v.size() % 32 == 0) v.push_back(256.0f);
    float f;
    std::memcpy(&f, &bits, 4);
    v.push_back(f);
  };
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (int k = 0; k < 0x7F; ++k) {
      const float lo = E4M3ToFloat(static_cast<uint8_t>(k)), hi = k == 0x7E ? 464.0f : E4M3ToFloat(static_cast<uint8_t>(k + 1));
      uint32_t mid;
      const float m = (lo + hi) / 2;
      std::memcpy(&mid, &m, 4);
      for (int32_t delta = -8; delta <= 8; ++delta) add(sign | static_cast<uint32_t>(static_cast<int32_t>(mid) + delta));
    }
    for (uint32_t bits = 0; bits < 0x44000000u; bits += stride) add(sign | bits);  // up to 512
    for (uint32_t bits : {0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0x00000001u, 0x007FFFFFu}) add(sign | bits);
  }
  while (v.size() % 32 != 0) v.push_back(-0.0f);
  return v;
}

TEST_CASE("the host twin's codes are FloatToE4M3 itself across e4m3's range") {
  const std::vector<float> values = SweepValues(4099);
  std::vector<uint8_t> codes;
  CopyWork w;
  w.unit_begin = {0};
  const CopyItem it = SweepItem(values, codes);
  w.items = {it};
  w.unit_begin.push_back(it.Units());
  REQUIRE(it.Units() == static_cast<int64_t>(values.size() / 32));
  RunCopyWorkOnHost(w);
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (codes[i] != FloatToE4M3(values[i]) && wrong++ == 0) first = i;
  }
  INFO(wrong << " wrong, the first " << values[first] << " (index " << first << ")");
  REQUIRE(wrong == 0);
}

TEST_CASE("a quantizing descriptor's pack item writes its wire bytes, not its elements at the wire size") {
  CopyDescriptor d;
  d.op = CopyOp::kScale;
  d.quant_format = static_cast<uint8_t>(QuantFormat::kBlockFp8);
  d.block_rows = d.block_cols = 128;
  d.src_dtype = DType::kBF16;
  d.dst_dtype = DType::kF32;
  d.outer_rank = 1;
  d.count[0] = 300;
  d.inner = 200;
  d.src_stride[0] = 200;
  d.dst_stride[0] = 2;
  CopyWork w;
  AppendPackItem(d, {0x1000}, {}, 0x100000, 16384, w);
  CHECK(w.bytes == 3 * 2 * 4);
  CHECK(w.items[0].Units() == 6);
  CopyWork u;
  AppendUnpackItem(d, 0x100000, {0x2000}, 16384, u);
  CHECK(u.bytes == 3 * 2 * 4);
  CHECK_FALSE(u.items[0].Quantizes());
  CHECK(u.items[0].inner == 2);
  CHECK(u.items[0].count[2] == 3);
  CHECK(u.items[0].dst_stride[2] == 2);
  d.op = CopyOp::kQuantize;
  d.dst_dtype = DType::kF8E4M3;
  CopyWork q;
  AppendPackItem(d, {0x1000}, {}, 0x100000, 64, q);
  CHECK(q.bytes == 300 * 200);
  CHECK(q.items[0].Units() == 6);  // whole blocks, whatever the segment size
}

}  // namespace
}  // namespace refit
