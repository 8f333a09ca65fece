#include "kernels/test_plans.h"

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "plan/convert.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"

namespace refit {

TestPlan MakeTestPlan(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(rng() % (hi - lo + 1));
  };
  TestPlan t;
  const DType floats[] = {DType::kBF16, DType::kF16, DType::kF32};
  const int tensors = static_cast<int>(uniform(1, 6));
  for (int i = 0; i < tensors; ++i) {
    const std::string name = absl::StrCat("t", i);
    Dims shape;
    shape.rank = static_cast<int>(uniform(1, 4));
    for (int d = 0; d < shape.rank; ++d) shape[d] = uniform(1, shape.rank > 2 ? 9 : 300);
    const DType sd = floats[uniform(0, 2)], dd = floats[uniform(0, 2)];
    const int sdim = static_cast<int>(uniform(0, shape.rank - 1)),
              ddim = static_cast<int>(uniform(0, shape.rank - 1));
    const int sparts = static_cast<int>(std::min<int64_t>(uniform(1, 4), shape[sdim]));
    const int dparts = static_cast<int>(std::min<int64_t>(uniform(1, 3), shape[ddim]));
    std::vector<testing::Placement> sp, dp1, dp2;
    for (int k = 0; k < sparts; ++k) sp.push_back({0, k});
    for (int k = 0; k < dparts; ++k)
      dp1.push_back({1, k}), dp2.push_back({1 + static_cast<int>(uniform(0, 1)), k + 4});
    testing::AddSplitTensor(t.src, name, shape, sd, sdim, testing::EvenSplit(shape[sdim], sparts),
                            sp, "trainer");
    testing::AddSplitTensor(t.dst, name, shape, dd, ddim, testing::EvenSplit(shape[ddim], dparts),
                            dp1, "engineA");
    testing::AddSplitTensor(t.dst, name, shape, dd, ddim, testing::EvenSplit(shape[ddim], dparts),
                            dp2, "engineB");
  }
  ValidateLayout(t.src, "source").IgnoreError();
  ValidateLayout(t.dst, "destination").IgnoreError();
  PlanOptions options;
  options.max_message_bytes = uniform(256, 1 << 16);
  options.topology.gpus_per_node = 8;
  t.plan = *MakePlan(t.src, t.dst, options);
  return t;
}

HostBuffers::HostBuffers(const Layout& l) {
  for (const Buffer& b : l.buffers) storage.emplace_back(static_cast<size_t>(b.NumBytes()));
  for (auto& s : storage) memory.emplace_back(s.data(), s.size());
}

BufferAddresses HostBuffers::addresses() const { return AddressesOf(memory); }

}  // namespace refit

namespace refit {

TestRun::TestRun(uint64_t seed)
    : t(MakeTestPlan(seed)),
      src(t.src),
      ref(t.dst),
      got(t.dst),
      spec(MakeFillSpec(t.src, t.dst, seed)) {
  FillSources(t.src, spec, src.memory);
  PoisonDestinations(ref.memory);
  PoisonDestinations(got.memory);
}

}  // namespace refit

namespace refit {
namespace {

// Elements an item's source spans from its first (strides are not negative).
int64_t SourceExtent(const ItemSpec& s) {
  int64_t e = s.inner;
  for (int k = 0; k < kMaxOuterDims; ++k) e += (s.count[k] - 1) * s.src_stride[k];
  return e;
}

int64_t DestinationExtent(const ItemSpec& s) {
  int64_t e = s.inner;
  for (int k = 0; k < kMaxOuterDims; ++k) e += (s.count[k] - 1) * s.dst_stride[k];
  return e;
}

bool IsFloat(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

// Lays the items out: sources one after another (each at its own alignment class), destinations
// one after another with gaps of 0-3 bytes (0: the next item's first byte right after), and
// fills the sources with finite values of their dtype.
// Without odd offsets, every item starts `src_mis` and `dst_mis` bytes past a multiple of 16.
void Finish(ItemCase& c, std::mt19937_64& rng, bool odd_offsets, int64_t src_mis = 0,
            int64_t dst_mis = 0) {
  int64_t src_at = 0, dst_at = 0;
  for (ItemSpec& s : c.items) {
    const int ss = DTypeSize(s.src_dtype), ds = DTypeSize(s.dst_dtype);
    src_at = (src_at + 15) / 16 * 16 + (odd_offsets ? static_cast<int64_t>(rng() % 16) : src_mis);
    s.src_offset = src_at;
    src_at += SourceExtent(s) * ss;
    dst_at += odd_offsets ? static_cast<int64_t>(rng() % 4) : (16 - dst_at % 16) % 16 + dst_mis;
    s.dst_offset = dst_at;
    dst_at += DestinationExtent(s) * ds;
  }
  c.src.assign(static_cast<size_t>(src_at + 16), std::byte{0});
  c.dst_bytes = dst_at + 16;
  for (const ItemSpec& s : c.items) {
    const int ss = DTypeSize(s.src_dtype);
    for (int64_t i = 0; i < SourceExtent(s); ++i) {
      std::byte* p = c.src.data() + s.src_offset + i * ss;
      const uint64_t h = rng();
      if (!IsFloat(s.src_dtype)) {
        for (int b = 0; b < ss; ++b) p[b] = static_cast<std::byte>(h >> (8 * b));
        continue;
      }
      // Values over fp16's range, small and subnormal ones too, both signs.
      const float mag = std::ldexp(static_cast<float>(h % 100000) / 100000.0f,
                                   static_cast<int>((h >> 20) % 40) - 28);
      const float v = (h >> 63) ? -mag : mag;
      if (s.src_dtype == DType::kF32) {
        std::memcpy(p, &v, 4);
      } else {
        const uint16_t bits = s.src_dtype == DType::kBF16 ? FloatToBF16(v) : FloatToF16(v);
        std::memcpy(p, &bits, 2);
      }
    }
  }
}

// Destination strides packed with `gap` elements between runs (and loops); source strides of the
// same shape, or (transposed) the two inner loops swapped.
void Strides(ItemSpec& s, std::mt19937_64& rng, bool transposed) {
  auto gap = [&] { return static_cast<int64_t>(rng() % 3 == 0 ? rng() % 5 : 0); };
  s.dst_stride[2] = s.inner + gap();
  s.dst_stride[1] = s.count[2] * s.dst_stride[2] + gap();
  s.dst_stride[0] = s.count[1] * s.dst_stride[1] + gap();
  if (transposed) {
    s.src_stride[1] = s.inner + gap();
    s.src_stride[2] = s.count[1] * s.src_stride[1] + gap();
    s.src_stride[0] = s.count[2] * s.src_stride[2] + gap();
  } else {
    s.src_stride[2] = s.inner + gap();
    s.src_stride[1] = s.count[2] * s.src_stride[2] + gap();
    s.src_stride[0] = s.count[1] * s.src_stride[1] + gap();
  }
}

}  // namespace

AlignedBytes::AlignedBytes(size_t n, std::byte fill) : storage(n + 256, fill) {
  const uint64_t at = reinterpret_cast<uint64_t>(storage.data());
  data = storage.data() + ((256 - at % 256) % 256);
}

std::vector<ItemCase> MakeItemCases(int random, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(rng() % (hi - lo + 1));
  };
  std::vector<ItemCase> cases;
  auto item = [](DType from, DType to, int64_t inner, int64_t c0, int64_t c1, int64_t c2) {
    ItemSpec s;
    s.src_dtype = from, s.dst_dtype = to, s.inner = inner;
    s.count[0] = c0, s.count[1] = c1, s.count[2] = c2;
    return s;
  };
  {  // Long runs, every address 16-byte aligned: what the aligned kernel runs (AlignedOnly).
    ItemCase c{"long aligned runs"};
    for (auto [from, to, inner] : {std::tuple{DType::kBF16, DType::kBF16, int64_t{8192}},
                                   std::tuple{DType::kF32, DType::kBF16, int64_t{4096}},
                                   std::tuple{DType::kBF16, DType::kF32, int64_t{4096}},
                                   std::tuple{DType::kF16, DType::kBF16, int64_t{4096}},
                                   std::tuple{DType::kI8, DType::kI8, int64_t{16384}}}) {
      ItemSpec s = item(from, to, inner, 1, 2, 5);
      s.src_stride[2] = 2 * inner;  // half of a wider row
      s.src_stride[1] = s.src_stride[2] * 5;
      s.dst_stride[2] = inner + 64;
      s.dst_stride[1] = s.dst_stride[2] * 5;
      c.items.push_back(s);
    }
    Finish(c, rng, false);
    cases.push_back(std::move(c));
  }
  {  // The 12x Llama-3-8B refit: bf16 rows of 341 and 597 columns out of wider rows, odd offsets.
    ItemCase c{"short rows of odd widths at odd byte offsets"};
    for (int64_t w : {341, 597, 160, 1, 3, 31, 33}) {
      ItemSpec s = item(DType::kBF16, DType::kBF16, w, 1, 1, 97);
      Strides(s, rng, false);
      s.src_stride[2] = 2 * w + 1;  // half of a wider row
      s.src_stride[1] = s.src_stride[2] * 97;
      s.src_stride[0] = s.src_stride[1];
      c.items.push_back(s);
    }
    Finish(c, rng, true);
    cases.push_back(std::move(c));
  }
  {  // The same rows with every address 2-aligned (bf16 tensors): 2-byte accesses, never bytes.
    ItemCase c{"short bf16 rows of odd widths, element-aligned"};
    for (int64_t w : {341, 597, 7}) {
      ItemSpec s = item(DType::kBF16, DType::kBF16, w, 1, 1, 101);
      Strides(s, rng, false);
      c.items.push_back(s);
    }
    Finish(c, rng, false, 6, 2);
    cases.push_back(std::move(c));
  }
  {
    ItemCase c{"many tiny tensors back to back"};
    c.segment_bytes = 4096;
    for (int i = 0; i < 3000; ++i) {
      const DType d = i % 3 == 0 ? DType::kF32 : DType::kBF16;
      ItemSpec s = item(d, d, uniform(1, 48), 1, 1, uniform(1, 4));
      Strides(s, rng, false);
      c.items.push_back(s);
    }
    Finish(c, rng, false);
    cases.push_back(std::move(c));
  }
  {
    ItemCase c{"conversions of short rows"};
    const std::pair<DType, DType> pairs[] = {
        {DType::kBF16, DType::kF32}, {DType::kF32, DType::kBF16}, {DType::kF16, DType::kF32},
        {DType::kF32, DType::kF16},  {DType::kBF16, DType::kF16}, {DType::kF16, DType::kBF16}};
    for (const auto& [from, to] : pairs) {
      for (int64_t w : {1, 3, 8, 24, 100, 341, 1000}) {
        ItemSpec s = item(from, to, w, 1, 1, uniform(1, 40));
        Strides(s, rng, rng() % 2 == 0);
        c.items.push_back(s);
      }
    }
    Finish(c, rng, false);
    cases.push_back(std::move(c));
    ItemCase odd = cases.back();
    odd.name = "conversions of short rows at odd offsets";
    Finish(odd, rng, true);
    cases.push_back(std::move(odd));
  }
  {
    ItemCase c{"strided 3-D items, transposed too"};
    c.segment_bytes = 200;
    for (int i = 0; i < 40; ++i) {
      const DType d = i % 4 == 0 ? DType::kF32 : i % 4 == 1 ? DType::kF8E4M3 : DType::kBF16;
      ItemSpec s = item(d, i % 4 == 3 ? DType::kF32 : d, uniform(1, 60), uniform(1, 4),
                        uniform(1, 5), uniform(1, 6));
      Strides(s, rng, i % 2 == 0);
      c.items.push_back(s);
    }
    Finish(c, rng, false);
    cases.push_back(std::move(c));
  }
  {
    ItemCase c{"tiles ending inside items, the next item's bytes right after"};
    c.segment_bytes = 100;
    for (int i = 0; i < 200; ++i) {
      ItemSpec s = item(DType::kBF16, DType::kBF16, uniform(1, 70), 1, 1, uniform(1, 9));
      Strides(s, rng, false);
      for (int k = 0; k < kMaxOuterDims; ++k) s.dst_stride[k] = k == 2 ? s.inner : s.dst_stride[k];
      s.dst_stride[1] = s.dst_stride[0] = s.inner * s.count[2];
      c.items.push_back(s);
    }
    Finish(c, rng, false);
    int64_t at = 0;  // no gaps at all
    for (ItemSpec& s : c.items) s.dst_offset = at, at += DestinationExtent(s) * 2;
    cases.push_back(std::move(c));
  }
  {
    ItemCase c{"long runs whose ends differ in alignment"};
    c.segment_bytes = 65536;
    for (int i = 0; i < 24; ++i) {
      const DType from = i < 16 ? DType::kBF16 : DType::kF32, to = i < 20 ? from : DType::kBF16;
      ItemSpec s = item(from, to, uniform(2048, 40000), 1, 1, uniform(1, 3));
      Strides(s, rng, false);
      c.items.push_back(s);
    }
    Finish(c, rng, true);
    cases.push_back(std::move(c));
  }
  const DType same[] = {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kI64};
  const DType floats[] = {DType::kBF16, DType::kF16, DType::kF32};
  const int64_t segments[] = {2, 64, 100, 1000, 16384};
  for (int r = 0; r < random; ++r) {
    ItemCase c{absl::StrCat("random ", r)};
    c.segment_bytes = segments[rng() % 5];
    const int n = static_cast<int>(uniform(1, 12));
    for (int i = 0; i < n; ++i) {
      ItemSpec s;
      if (rng() % 3 == 0)
        s.src_dtype = floats[rng() % 3], s.dst_dtype = floats[rng() % 3];
      else
        s.src_dtype = s.dst_dtype = same[rng() % 5];
      const int kind =
          static_cast<int>(rng() % 4);  // tiny, short (across kTileRunBytes), medium, long
      s.inner = kind == 0   ? uniform(1, 8)
                : kind == 1 ? uniform(9, 700)
                : kind == 2 ? uniform(900, 2200)
                            : uniform(2200, 9000);
      if (rng() % 2 == 0) s.inner = (s.inner + 7) / 8 * 8;  // aligned widths too
      const int dims = static_cast<int>(uniform(0, 3));
      for (int k = 3 - dims; k < 3; ++k) s.count[k] = uniform(1, kind >= 2 ? 4 : k == 2 ? 40 : 5);
      Strides(s, rng, rng() % 3 == 0);
      c.items.push_back(s);
    }
    Finish(c, rng, rng() % 2 == 0);
    cases.push_back(std::move(c));
  }
  return cases;
}

CopyWork ItemCaseWork(const ItemCase& c, uint64_t src, uint64_t dst) {
  CopyWork w;
  w.unit_begin.push_back(0);
  for (const ItemSpec& s : c.items) {
    CopyItem it;
    it.src = src + static_cast<uint64_t>(s.src_offset);
    it.dst = dst + static_cast<uint64_t>(s.dst_offset);
    it.inner = s.inner;
    for (int k = 0; k < kMaxOuterDims; ++k) {
      it.count[k] = s.count[k], it.src_stride[k] = s.src_stride[k],
      it.dst_stride[k] = s.dst_stride[k];
    }
    it.src_dtype = static_cast<uint8_t>(s.src_dtype);
    it.dst_dtype = static_cast<uint8_t>(s.dst_dtype);
    CutIntoUnits(it, c.segment_bytes);
    Append(w, it);
  }
  return w;
}

std::vector<std::byte> ReferenceCopy(const ItemCase& c) {
  std::vector<std::byte> dst(static_cast<size_t>(c.dst_bytes), kPoison);
  for (const ItemSpec& s : c.items) {
    const int ss = DTypeSize(s.src_dtype), ds = DTypeSize(s.dst_dtype);
    for (int64_t a = 0; a < s.count[0]; ++a) {
      for (int64_t b = 0; b < s.count[1]; ++b) {
        for (int64_t r = 0; r < s.count[2]; ++r) {
          for (int64_t i = 0; i < s.inner; ++i) {
            const int64_t from =
                a * s.src_stride[0] + b * s.src_stride[1] + r * s.src_stride[2] + i;
            const int64_t to = a * s.dst_stride[0] + b * s.dst_stride[1] + r * s.dst_stride[2] + i;
            ConvertElements(c.src.data() + s.src_offset + from * ss, s.src_dtype,
                            dst.data() + s.dst_offset + to * ds, s.dst_dtype, 1);
          }
        }
      }
    }
  }
  return dst;
}

}  // namespace refit
