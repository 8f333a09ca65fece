// Copy items against the CPU reference (plan/host_copy.h): packing and unpacking every message
// of real plans through items gives the same bytes, for casts, strides, ranks and odd sizes; and
// for plans that quantize to fp8 on the way (kQuantize, kScale; block fp8 and MXFP8) on
// adversarial sources.
#include "kernels/copy_items.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/quant_test_cases.h"
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
        if (m.stage == stage)
          RunCopyWorkOnHost(DirectWork(t.plan, m, src.addresses(), got.addresses(), 128));
      }
    }
    for (size_t b = 0; b < t.dst.buffers.size(); ++b) REQUIRE(ref.storage[b] == got.storage[b]);
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
  bool operator==(const DestinationMemory& o) const {
    return buffers.storage == o.buffers.storage && scratch == o.scratch;
  }
};

// The units of quantizing items: one per block (MXFP8's one-row blocks: tiles of Mxfp8UnitRows rows
// of Mxfp8UnitCols columns), never a block split.
void CheckQuantizingUnits(const Plan& plan, const Message& m, const CopyWork& w) {
  size_t item = 0;
  for (int64_t k = 0; k < m.num_descriptors; ++k) {
    const CopyDescriptor& d = plan.descriptor(m, k);
    const CopyItem& it = w.items[item++];
    CHECK(it.Quantizes() == d.Quantizes());
    if (!d.Quantizes()) continue;
    const bool mx_rows = d.quant_format == static_cast<uint8_t>(QuantFormat::kMxfp8) &&
                         d.block_rows == 1 && d.block_cols == 32;
    const int64_t cols = mx_rows ? Mxfp8UnitCols(d.inner) : d.block_cols;
    const int64_t rows = mx_rows ? Mxfp8UnitRows(cols) : d.block_rows;
    CHECK(cols % d.block_cols == 0);  // whole blocks
    CHECK(rows * cols <= std::max<int64_t>(kMxfp8UnitElements, d.block_rows * d.block_cols));
    CHECK(it.segment == cols);
    CHECK(it.RowsPerUnit() == rows);
    CHECK(it.Units() == CeilDiv(d.count[0], rows) * CeilDiv(d.inner, cols));
    CHECK(it.block_rows == d.block_rows);
    CHECK(it.block_cols == d.block_cols);
  }
  CHECK(item == w.items.size());
}

// The kScale items of `w` whose scales a twin writes (the quantizing kernel skips their units).
int64_t ScalesWithTwin(const CopyWork& w) {
  int64_t n = 0;
  for (size_t i = 0; i < w.items.size(); ++i) n += ScalesByTwin(w, i);
  return n;
}

// The item of launch unit u as the kernels find it (ItemOf): the last with begin <= u.
size_t ItemOfUnit(const std::vector<int64_t>& begin, int64_t u) {
  return static_cast<size_t>(std::upper_bound(begin.begin(), begin.end() - 1, u) - begin.begin()) -
         1;
}

// QuantizingLaunchUnits: each item's own units, none for scales a twin writes, and every unit of
// the launch found in an item that runs it, at its own index there.
void CheckQuantizingLaunchUnits(const CopyWork& w) {
  const std::vector<int64_t> begin = QuantizingLaunchUnits(w);
  REQUIRE(begin.size() == w.items.size() + 1);
  REQUIRE(begin[0] == 0);
  int64_t elided = 0;
  for (size_t i = 0; i < w.items.size(); ++i) {
    const bool by_twin = ScalesByTwin(w, i);
    CHECK(begin[i + 1] - begin[i] == (by_twin ? 0 : w.items[i].Units()));
    elided += by_twin ? w.items[i].Units() : 0;
  }
  CHECK(begin.back() + elided == w.unit_begin.back());
  for (int64_t u = 0; u < begin.back(); u += 1 + u % 7) {
    const size_t i = ItemOfUnit(begin, u);
    REQUIRE_FALSE(ScalesByTwin(w, i));
    CHECK(u - begin[i] < w.items[i].Units());
  }
}

TEST_CASE("quantizing items pack, unpack and copy directly exactly like the CPU reference") {
  int64_t quantizing = 0, scales = 0, from_scratch = 0, messages = 0, twins = 0;
  for (QuantCase& qc : QuantCases(40)) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      INFO(qc.name << ", fill " << seed);
      HostBuffers src(qc.src);
      // Fill 1: the verifier's values (so the whole-tensor reference checks the result too);
      // then adversarial blocks.
      const FillSpec spec = MakeFillSpec(qc.src, qc.dst, seed);
      if (seed == 1)
        FillSources(qc.src, spec, src.memory);
      else
        FillAdversarial(qc.src, qc.dst, src.memory, seed, qc.block_rows, qc.block_cols);
      // Staged: pack, then unpack, stage by stage.
      DestinationMemory ref(qc.dst, qc.plan), got(qc.dst, qc.plan);
      for (int stage = 0; stage < kMaxStages; ++stage) {
        for (const Message& m : qc.plan.messages) {
          if (m.stage != stage) continue;
          std::vector<std::byte> want, staging(static_cast<size_t>(m.bytes) + 16, kPoison);
          PackMessage(qc.plan, m, src.memory, ref.buffers.memory, want);
          const uint64_t at =
              reinterpret_cast<uint64_t>(staging.data()) + (seed % 3);  // odd addresses
          const int64_t segment = seed % 2 ? 64 : 16384;
          CopyWork pack =
              PackWork(qc.plan, m, src.addresses(), got.buffers.addresses(), at, segment);
          REQUIRE(pack.bytes == m.bytes);
          CheckQuantizingUnits(qc.plan, m, pack);
          RunCopyWorkOnHost(pack);
          REQUIRE(std::memcmp(want.data(), reinterpret_cast<const void*>(at), want.size()) == 0);
          REQUIRE(staging[static_cast<size_t>(m.bytes) + (seed % 3)] ==
                  kPoison);  // nothing past the message
          UnpackMessage(qc.plan, m, want, ref.buffers.memory);
          CopyWork unpack = UnpackWork(qc.plan, m, at, got.buffers.addresses(), segment);
          REQUIRE(unpack.bytes == m.bytes);
          RunCopyWorkOnHost(unpack);
          ++messages;
          for (int64_t k = 0; k < m.num_descriptors; ++k) {
            const CopyDescriptor& d = qc.plan.descriptor(m, k);
            quantizing += d.Quantizes(), scales += d.op == CopyOp::kScale,
                from_scratch += d.Quantizes() && d.src_is_destination;
          }
        }
      }
      REQUIRE(ref == got);
      if (seed == 1) {
        auto checked = CheckDestinations(qc.src, qc.dst, spec, got.buffers.memory);
        INFO(checked.status().message());
        REQUIRE(checked.ok());
      }
      // Direct: every message straight from its sources to its destinations, a stage's items in
      // one work list as the cuda backend launches them, whose launch units with the quantizing
      // kernel skip the scales that twins write.
      DestinationMemory ref2(qc.dst, qc.plan), got2(qc.dst, qc.plan);
      ExecuteOnHost(qc.plan, src.memory, ref2.buffers.memory);
      for (int stage = 0; stage < kMaxStages; ++stage) {
        CopyWork w;
        w.unit_begin.push_back(0);
        for (const Message& m : qc.plan.messages) {
          if (m.stage == stage)
            AppendWork(DirectWork(qc.plan, m, src.addresses(), got2.buffers.addresses(), 128), w);
        }
        twins += ScalesWithTwin(w);
        CheckQuantizingLaunchUnits(w);
        RunCopyWorkOnHost(w);
      }
      REQUIRE(ref2 == got2);
      REQUIRE(ref2 == ref);
    }
  }
  // Both ops ran, and quantization from gathered scratch (stage 1) too.
  CHECK(quantizing > scales);
  CHECK(scales > 0);
  CHECK(from_scratch > 0);
  CHECK(twins > 0);
  WARN(messages << " messages, " << quantizing << " quantizing descriptors (" << scales
                << " of scales, " << from_scratch << " from scratch)");
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
  AppendPackItem(d, {reinterpret_cast<uint64_t>(rows.data())}, {},
                 reinterpret_cast<uint64_t>(codes.data()), 16384, w);
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
      const float lo = E4M3ToFloat(static_cast<uint8_t>(k)),
                  hi = k == 0x7E ? 464.0f : E4M3ToFloat(static_cast<uint8_t>(k + 1));
      uint32_t mid;
      const float m = (lo + hi) / 2;
      std::memcpy(&mid, &m, 4);
      for (int32_t delta = -8; delta <= 8; ++delta)
        add(sign | static_cast<uint32_t>(static_cast<int32_t>(mid) + delta));
    }
    for (uint32_t bits = 0; bits < 0x44000000u; bits += stride) add(sign | bits);  // up to 512
    for (uint32_t bits :
         {0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0x00000001u, 0x007FFFFFu})
      add(sign | bits);
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
  REQUIRE(it.Units() == static_cast<int64_t>(CeilDiv(values.size() / 32,
                                                     Mxfp8UnitRows(32))));  // rows of 32
  RunCopyWorkOnHost(w);
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (codes[i] != FloatToE4M3(values[i]) && wrong++ == 0) first = i;
  }
  INFO(wrong << " wrong, the first " << values[first] << " (index " << first << ")");
  REQUIRE(wrong == 0);
}

TEST_CASE(
    "a quantizing descriptor's pack item writes its wire bytes, not its elements at the wire "
    "size") {
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

// Hand-built items (kernels/test_plans.h): the host twin, unit by unit as the kernel cuts them,
// against a plain element loop over poisoned destinations: every byte, gaps and neighbours too.
TEST_CASE(
    "tiled and run items give a plain loop's bytes (odd widths, offsets, strides, tiny items)") {
  int64_t tiled = 0, runs = 0, vectors[17] = {};
  for (const ItemCase& c : MakeItemCases(300)) {
    INFO(c.name << ", segment bytes " << c.segment_bytes);
    AlignedBytes src(c.src.size(), std::byte{0}), dst(static_cast<size_t>(c.dst_bytes), kPoison);
    std::memcpy(src.data, c.src.data(), c.src.size());
    const CopyWork w = ItemCaseWork(c, src.address(), dst.address());
    for (const CopyItem& it : w.items) {
      if (it.tiled) {
        ++tiled;
        if (it.src_dtype == it.dst_dtype) ++vectors[it.vector];
        CHECK(it.Units() == CeilDiv(it.Rows() * it.inner, it.segment));
      } else {
        ++runs;
      }
    }
    RunCopyWorkOnHost(w);
    const std::vector<std::byte> want = ReferenceCopy(c);
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (dst.data[i] != want[i] && wrong++ == 0) first = i;
    }
    INFO(wrong << " wrong bytes, the first at " << first);
    REQUIRE(wrong == 0);
  }
  // Every path ran: tiles of each access width, and runs.
  CHECK(runs > 0);
  for (int v : {1, 2, 4, 8, 16}) CHECK(vectors[v] > 0);
  WARN(tiled << " tiled items, " << runs << " of runs");
}

CopyItem Item(DType from, DType to, uint64_t src, uint64_t dst, int64_t inner, int64_t rows,
              int64_t src_row, int64_t dst_row) {
  CopyItem it;
  it.src = src, it.dst = dst, it.inner = inner;
  it.count[2] = rows;
  it.src_stride[2] = src_row, it.dst_stride[2] = dst_row;
  it.src_dtype = static_cast<uint8_t>(from), it.dst_dtype = static_cast<uint8_t>(to);
  return it;
}

TEST_CASE("short runs are tiled with the widest access every address allows") {
  const DType bf16 = DType::kBF16, f32 = DType::kF32;
  // Rows of 171 bf16 columns out of 342 (odd widths), 2-aligned: 2-byte accesses, not bytes.
  CopyItem it = Item(bf16, bf16, 0x1000, 0x2000, 171, 4096, 342, 171);
  CutIntoUnits(it, 16384);
  CHECK(it.tiled);
  CHECK(it.vector == 2);
  CHECK(it.segment == 8192);
  CHECK(it.Units() == CeilDiv(171 * 4096, 8192));  // 86 tiles, not 4096 runs
  // The 12x Llama-3-8B rows (341 of 682 bf16 columns, 682 bytes): runs, one unit each (faster on
  // an H200 than tiles of them).
  it = Item(bf16, bf16, 0x1000, 0x2000, 341, 4096, 682, 341);
  CutIntoUnits(it, 16384);
  CHECK_FALSE(it.tiled);
  CHECK(it.Units() == 4096);
  // Rows of 64 bf16, everything 16-aligned: 16-byte accesses.
  it = Item(bf16, bf16, 0x1000, 0x2000, 64, 256, 128, 64);
  CutIntoUnits(it, 16384);
  CHECK(it.vector == 16);
  // An odd staging address: bytes.
  it = Item(bf16, bf16, 0x1000, 0x2001, 64, 256, 128, 64);
  CutIntoUnits(it, 16384);
  CHECK(it.vector == 1);
  // A stride that is stepped limits the width; one of a loop of one does not.
  it = Item(f32, f32, 0x1000, 0x2000, 4, 1, 6, 4);
  CutIntoUnits(it, 16384);
  CHECK(it.vector == 16);
  it.count[2] = 2;
  CutIntoUnits(it, 16384);
  CHECK(it.vector == 8);
  // Converting: elements per access, up to 16 bytes at the wider end; tiles a multiple of them.
  it = Item(bf16, f32, 0x1000, 0x2000, 96, 10, 96, 96);
  CutIntoUnits(it, 100);
  CHECK(it.vector == 4);
  CHECK(it.segment == 24);
  it = Item(f32, bf16, 0x1004, 0x2000, 96, 10, 96, 96);
  CutIntoUnits(it, 16384);
  CHECK(it.vector == 1);
  it = Item(f32, bf16, 0x1000, 0x2001, 96, 10, 96, 96);
  CutIntoUnits(it, 16384);
  CHECK(it.vector == 0);  // bytes
  // Tiny tiles (segment 1 element) never straddle an access.
  it = Item(bf16, bf16, 0x1000, 0x2000, 64, 3, 64, 64);
  CutIntoUnits(it, 2);
  CHECK(it.segment == 1);
  CHECK(it.vector == 2);
  // Long runs keep units of a run or a segment of one.
  it = Item(bf16, bf16, 0x1000, 0x2000, kTileRunBytes / 2, 3, kTileRunBytes / 2, kTileRunBytes / 2);
  CutIntoUnits(it, 16384);
  CHECK_FALSE(it.tiled);
  CHECK(it.Units() == 3);
}

TEST_CASE("99k small tensors' items become far fewer units") {
  // The shapes of tests/configs/many-small-moe.json's items: 64- and 256-byte rows (66k items of
  // 256 rows): 16.9 M run units before, one 16 KiB tile each now.
  CopyItem it = Item(DType::kBF16, DType::kBF16, 0x1000, 0x200000, 32, 256, 64, 32);
  CutIntoUnits(it, 16384);
  CHECK(it.Units() == 1);
  it = Item(DType::kBF16, DType::kBF16, 0x1000, 0x200000, 128, 256, 256, 128);
  CutIntoUnits(it, 16384);
  CHECK(it.Units() == 4);
}

// What the GPU faults on and the CPU twin does not: every access a tiled item's kernel makes is
// `vector` bytes (same dtype) or `vector` elements at each end (converting), so the item's base
// addresses and every element offset it steps by must be multiples of them. Checked on the random
// plans' pack and unpack work, with staging at odd offsets (as the GPU test runs them).
TEST_CASE("tiled items' accesses are aligned to the width they were given") {
  int64_t tiled = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    TestRun run(seed);
    const TestPlan& t = run.t;
    for (const Message& m : t.plan.messages) {
      for (int64_t segment : {int64_t{64}, int64_t{16384}}) {
        const uint64_t at = 0x10000 + seed % 7;
        for (const CopyWork& w :
             {PackWork(t.plan, m, run.src.addresses(), run.got.addresses(), at, segment),
              UnpackWork(t.plan, m, at, run.got.addresses(), segment)}) {
          for (const CopyItem& it : w.items) {
            if (!it.tiled) continue;
            ++tiled;
            const int ss = DTypeSize(static_cast<DType>(it.src_dtype)),
                      ds = DTypeSize(static_cast<DType>(it.dst_dtype));
            const uint64_t sv =
                it.src_dtype == it.dst_dtype ? it.vector : static_cast<uint64_t>(it.vector) * ss;
            const uint64_t dv =
                it.src_dtype == it.dst_dtype ? it.vector : static_cast<uint64_t>(it.vector) * ds;
            if (sv == 0) continue;  // converting element by element in bytes
            INFO("seed " << seed << " item src " << it.src << " dst " << it.dst << " inner "
                         << it.inner << " vector " << int(it.vector) << " dtypes "
                         << int(it.src_dtype) << "->" << int(it.dst_dtype));
            CHECK(it.src % sv == 0);
            CHECK(it.dst % dv == 0);
            CHECK((it.inner * ss) % sv == 0);
            CHECK((it.segment * ss) % sv == 0);
            for (int k = 0; k < kMaxOuterDims; ++k) {
              if (it.count[k] <= 1) continue;
              CHECK((it.src_stride[k] * ss) % sv == 0);
              CHECK((it.dst_stride[k] * ds) % dv == 0);
            }
          }
        }
      }
    }
  }
  CHECK(tiled > 0);
}

// The aligned kernel runs a work only when every unit it would cut is 16-byte aligned at both
// ends: the aligned hand-built case qualifies, and stops qualifying with any base, stride or
// segment off by one element, a tile, or a conversion of a run that is not 8 elements a unit.
TEST_CASE("AlignedOnly accepts aligned long runs and nothing else") {
  const std::vector<ItemCase> cases = MakeItemCases(0, 11);
  const ItemCase* c = nullptr;
  for (const ItemCase& k : cases) {
    if (k.name == "long aligned runs") c = &k;
  }
  REQUIRE(c != nullptr);
  const CopyWork w = ItemCaseWork(*c, 0x100000, 0x800000);
  REQUIRE(AlignedOnly(w));
  for (const CopyItem& it : w.items) REQUIRE_FALSE(it.tiled);
  auto changed = [&](auto edit) {
    CopyWork v = w;
    edit(v.items[1]);  // fp32 -> bf16
    return AlignedOnly(v);
  };
  CHECK_FALSE(changed([](CopyItem& it) { it.src += 4; }));
  CHECK_FALSE(changed([](CopyItem& it) { it.dst += 2; }));
  CHECK_FALSE(changed([](CopyItem& it) { it.src_stride[2] += 1; }));
  CHECK_FALSE(changed([](CopyItem& it) { it.dst_stride[1] += 1; }));
  CHECK_FALSE(changed([](CopyItem& it) { it.segment -= 4; }));  // 8 elements a unit, no more
  CHECK_FALSE(changed([](CopyItem& it) { it.inner -= 4; }));    // the last unit of a run
  CHECK_FALSE(changed([](CopyItem& it) { it.tiled = 1; }));
  CHECK(changed([](CopyItem& it) {
    it.count[0] = 1, it.src_stride[0] = 3;
  }));  // a loop of 1 is never stepped
  // The odd-width and tiny cases are never aligned work.
  for (const ItemCase& k : cases) {
    if (k.name == "long aligned runs") continue;
    INFO(k.name);
    CHECK_FALSE(AlignedOnly(ItemCaseWork(k, 0x100000, 0x800000)));
  }
}

// Mixed work runs as two launches (the cuda backend's direct copies): the aligned items, in
// order, through the aligned kernel, the rest through the general one; nothing lost or doubled.
TEST_CASE("SplitAligned cuts mixed work into aligned items and the rest, in order") {
  const std::vector<ItemCase> cases = MakeItemCases(0, 11);
  CopyWork mixed;
  for (const ItemCase& k : cases) AppendWork(ItemCaseWork(k, 0x100000, 0x800000), mixed);
  REQUIRE_FALSE(AlignedOnly(mixed));
  CopyWork aligned, general;
  SplitAligned(mixed, aligned, general);
  REQUIRE_FALSE(aligned.items.empty());
  REQUIRE_FALSE(general.items.empty());
  CHECK(AlignedOnly(aligned));
  CHECK(aligned.items.size() + general.items.size() == mixed.items.size());
  CHECK(aligned.unit_begin.back() + general.unit_begin.back() == mixed.unit_begin.back());
  size_t a = 0, g = 0;
  for (const CopyItem& it : mixed.items) {
    const CopyItem& got = AlignedItem(it) ? aligned.items.at(a++) : general.items.at(g++);
    CHECK(got.src == it.src);
    CHECK(got.dst == it.dst);
    CHECK(got.Units() == it.Units());
  }
  for (const CopyItem& it : general.items) CHECK_FALSE(AlignedItem(it));
  // Aligned work stays whole.
  const CopyWork whole = aligned;
  SplitAligned(whole, aligned, general);
  CHECK(aligned.items.size() == whole.items.size());
  CHECK(general.items.empty());
}

}  // namespace
}  // namespace refit
