#include "kernels/quant_test_cases.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "plan/convert.h"
#include "plan/fp8_block.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"

namespace refit {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

QuantCase Finish(std::string name, Layout src, Layout dst, int64_t br, int64_t bc,
                 int64_t max_message_bytes) {
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
  using testing::AddFlatShard;
  using testing::AddQuantized;
  using testing::AddSplitTensor;
  using testing::EvenSplit;
  std::vector<QuantCase> cases;
  const DType floats[] = {DType::kBF16, DType::kF16, DType::kF32};
  for (DType from : floats) {
    for (int64_t max_message : {int64_t{64} << 20, int64_t{5000}}) {
      Layout src, dst;
      AddSplitTensor(src, "w", Dims{300, 200}, from, 0, {0, 128, 300}, {{0, 0}, {0, 1}}, "t");
      AddQuantized(dst, "w", Dims{300, 200}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256, 300},
                   {{1, 0}, {1, 1}}, "e");
      AddSplitTensor(src, "b", Dims{37, 50}, DType::kF32, 0, {0, 37}, {{0, 0}}, "t");
      AddSplitTensor(dst, "b", Dims{37, 50}, DType::kBF16, 1, {0, 20, 50}, {{1, 0}, {1, 1}}, "e");
      cases.push_back(
          Finish(absl::StrCat("whole blocks from ", DTypeName(from), " max ", max_message), src,
                 dst, 128, 128, max_message));
    }
    {
      Layout src, dst;  // FSDP2 over 4 ranks: every block cut in two, gathered into scratch
      AddSplitTensor(src, "w", Dims{256, 256}, from, 0, EvenSplit(256, 4),
                     {{0, 0}, {0, 1}, {0, 2}, {0, 3}}, "f");
      AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 128, 256},
                   {{1, 0}, {1, 1}}, "tp");
      cases.push_back(Finish(absl::StrCat("gathered from ", DTypeName(from)), src, dst, 128, 128,
                             int64_t{64} << 20));
    }
    {
      Layout src, dst;  // MXFP8, a column cut inside a block, small messages
      AddSplitTensor(src, "w", Dims{64, 100}, from, 1, {0, 50, 100}, {{0, 0}, {0, 1}}, "t");
      AddQuantized(dst, "w", Dims{64, 100}, QuantFormat::kMxfp8, 1, 32, 1, {0, 64, 100},
                   {{1, 0}, {1, 1}}, "e");
      cases.push_back(Finish(absl::StrCat("mxfp8 from ", DTypeName(from)), src, dst, 1, 32, 300));
    }
    {
      Layout src, dst;  // MXFP8 whole rows: thousands of 1x32 units; replicas fanned out by NVLink
      AddSplitTensor(src, "w", Dims{96, 1000}, from, 0, {0, 40, 96}, {{0, 0}, {0, 1}}, "t");
      AddQuantized(dst, "w", Dims{96, 1000}, QuantFormat::kMxfp8, 1, 32, 0, {0, 96}, {{1, 0}}, "a");
      AddQuantized(dst, "w", Dims{96, 1000}, QuantFormat::kMxfp8, 1, 32, 0, {0, 96}, {{1, 1}}, "b");
      cases.push_back(Finish(absl::StrCat("mxfp8 rows from ", DTypeName(from)), src, dst, 1, 32,
                             int64_t{64} << 20));
    }
  }
  {
    Layout src, dst;  // FSDP flat ranges: whole and cut blocks
    const Dims shape{384, 256};
    const int32_t t = src.AddTensor("w", shape, DType::kBF16);
    const std::vector<int64_t> cuts = {0, 40000, 70001, 384 * 256};
    for (size_t r = 0; r + 1 < cuts.size(); ++r) {
      AddFlatShard(src, t, src.AddWorker(absl::StrCat("fsdp", r), 0, static_cast<int32_t>(r)),
                   cuts[r], cuts[r + 1]);
    }
    AddQuantized(dst, "w", shape, QuantFormat::kBlockFp8, 128, 128, 1, {0, 128, 256},
                 {{1, 0}, {1, 1}}, "tp");
    cases.push_back(Finish("flat ranges", src, dst, 128, 128, int64_t{64} << 20));
  }
  {
    Layout src, dst;  // colocated: the pack step quantizes locally
    AddSplitTensor(src, "w", Dims{128, 512}, DType::kF32, 1, {0, 256, 512}, {{0, 0}, {0, 1}}, "t");
    AddQuantized(dst, "w", Dims{128, 512}, QuantFormat::kBlockFp8, 128, 128, 1, {0, 256, 512},
                 {{0, 0}, {0, 1}}, "e");
    cases.push_back(Finish("colocated", src, dst, 128, 128, int64_t{64} << 20));
  }
  std::mt19937_64 rng(23);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
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
        const int32_t worker =
            src.AddWorker(absl::StrCat("r", replica, "_", k), static_cast<int32_t>(uniform(0, 2)),
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
      AddQuantized(dst, "w", shape, mx ? QuantFormat::kMxfp8 : QuantFormat::kBlockFp8, br, bc, dim,
                   b, at, absl::StrCat("e", replica, "_"));
    }
    cases.push_back(
        Finish(absl::StrCat("random ", trial, " ", shape.ToString(), " block ", br, "x", bc), src,
               dst, br, bc, uniform(0, 1) ? 64 : int64_t{1} << 20));
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
  ConvertElements(reinterpret_cast<const std::byte*>(&v), DType::kF32,
                  reinterpret_cast<std::byte*>(&u), dt, 1);
  return u;
}
uint32_t SignOf(DType dt) { return dt == DType::kF32 ? 0x80000000u : 0x8000u; }
uint32_t MantissaOf(DType dt) {
  return dt == DType::kF32 ? 0x7FFFFFu : dt == DType::kBF16 ? 0x7Fu : 0x3FFu;
}
uint32_t InfOf(DType dt) {
  return dt == DType::kF32 ? 0x7F800000u : dt == DType::kBF16 ? 0x7F80u : 0x7C00u;
}
uint32_t MaxOf(DType dt) {
  return dt == DType::kF32 ? 0x7F7FFFFFu : dt == DType::kBF16 ? 0x7F7Fu : 0x7BFFu;
}
uint32_t NanOf(DType dt, uint64_t h) {
  return ((h & 1) ? SignOf(dt) : 0) | InfOf(dt) |
         (((h >> 1) & MantissaOf(dt)) | ((MantissaOf(dt) + 1) >> 1));
}

// A normal value: random sign and mantissa, exponent in [lo, hi].
float Normal(uint64_t h, int lo, int hi) {
  const float m = 1.0f + static_cast<float>((h >> 8) & 0x7FFFFF) / 8388608.0f;
  const float v =
      std::ldexp(m, lo + static_cast<int>((h >> 40) % static_cast<uint64_t>(hi - lo + 1)));
  return (h & 1) ? -v : v;
}

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
    case 0:
      return sign;
    case 1:
      return static_cast<uint32_t>(h >> 16) & (dt == DType::kF32 ? 0xFFFFFFFFu : 0xFFFFu);
    case 2:
      return sign | (static_cast<uint32_t>(h >> 8) & MantissaOf(dt));
    case 3: {
      if (origin) return BitsOf((h & 1) ? -448.0f : 448.0f, dt);
      const uint8_t k = static_cast<uint8_t>((h >> 8) % 0x7E);  // a finite code below 448
      const float lo = E4M3ToFloat(k), hi = E4M3ToFloat(static_cast<uint8_t>(k + 1));
      const float v = (h >> 20) % 3 == 0   ? lo
                      : (h >> 20) % 3 == 1 ? (lo + hi) / 2
                                           : std::nextafter((lo + hi) / 2, hi);
      return BitsOf((h & 2) ? -v : v, dt);
    }
    case 4: {
      const int e = static_cast<int>((h >> 50) % 9) - 4;
      const float v = std::ldexp(origin ? 256.0f + static_cast<float>((h >> 8) % 256)
                                        : 448.0f + static_cast<float>((h >> 8) % 64),
                                 e);
      return BitsOf((h & 1) ? -v : v, dt);
    }
    case 5:
      return (h >> 8) % 4 == 0 ? NanOf(dt, h >> 10) : BitsOf(Normal(h, -6, 6), dt);
    case 6:
      return (h >> 8) % 4 == 0 ? sign | InfOf(dt) : BitsOf(Normal(h, -6, 6), dt);
    case 7:
      return origin ? sign | MaxOf(dt) : BitsOf(Normal(h, -10, 4), dt);
    case 8:
      return (h >> 8) % 2 == 0 ? NanOf(dt, h >> 10) : sign | InfOf(dt);
    case 9:
      return BitsOf(Normal(h, -126, -118), dt);
    default:
      return BitsOf(Normal(h, -20, 20), dt);
  }
}

// Fills every source piece: tensors the destination quantizes get a block class per block of
// block_rows x block_cols (seeded), the others normals (exponents -8..8: exact casts both ways).
void FillAdversarial(const Layout& src, const Layout& dst, const BufferMemory& memory,
                     uint64_t seed, int64_t br, int64_t bc) {
  for (const Piece& p : src.pieces) {
    const LogicalTensor& t = src.tensors[p.tensor];
    auto d = dst.tensor_index.find(t.name);
    const bool quantized =
        d != dst.tensor_index.end() && dst.tensors[d->second].quant.format != QuantFormat::kNone;
    const Box& box = src.tensor_box(p);
    const Buffer& buffer = src.buffers[p.buffer];
    const PieceView view = *ViewOf(box, src.buffer_box(p), buffer.shape);
    const int size = DTypeSize(t.dtype);
    REQUIRE(box.rank == 2);
    for (int64_t i = 0; i < box.shape[0]; ++i) {
      for (int64_t j = 0; j < box.shape[1]; ++j) {
        const int64_t r = box.origin[0] + i, c = box.origin[1] + j;
        const uint64_t h = Mix(seed ^ Mix(Mix(std::hash<std::string>{}(t.name)) +
                                          static_cast<uint64_t>(r * t.shape[1] + c)));
        uint32_t bits;
        if (quantized) {
          const uint64_t block =
              Mix(seed * 31 + static_cast<uint64_t>((r / br) * 1000003 + c / bc));
          bits = AdversarialBits(t.dtype, static_cast<int>(block % kBlockClasses), h,
                                 r % br == 0 && c % bc == 0);
        } else {
          bits = BitsOf(Normal(h, -8, 8), t.dtype);
        }
        std::memcpy(memory[p.buffer].data() +
                        (view.offset + i * view.strides[0] + j * view.strides[1]) * size,
                    &bits, static_cast<size_t>(size));
      }
    }
  }
}

}  // namespace refit
