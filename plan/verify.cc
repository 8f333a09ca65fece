#include "plan/verify.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "plan/convert.h"
#include "plan/fp8_block.h"

namespace refit {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The value of an element of a tensor both sides hold in the same dtype: `size` low bytes of a
// hash, never all poison (a value must never look unwritten). Inline, so filling and checking
// cost a few nanoseconds per element.
inline uint64_t RawValue(uint64_t name_hash, int64_t linear, uint64_t seed, int size) {
  const uint64_t mask = size >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * size)) - 1;
  const uint64_t value =
      SplitMix64(name_hash ^ SplitMix64(seed + static_cast<uint64_t>(linear))) & mask;
  const uint64_t poison = 0xA5A5A5A5A5A5A5A5ull & mask;
  return value == poison ? value ^ 1 : value;
}

// Calls fn(std::integral_constant<int, size>) so the per-element loops know the size at compile
// time.
template <typename Fn>
void WithElementSize(int size, Fn&& fn) {
  switch (size) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 4:
      return fn(std::integral_constant<int, 4>{});
    default:
      return fn(std::integral_constant<int, 8>{});
  }
}

// Calls fn(linear, offset, count, stride) for each run of a piece along its last dimension:
// tensor elements linear .. linear + count - 1 live at buffer elements offset + k * stride.
// Whole runs, not single elements, so the callers' inner loops stay tight.
template <typename Fn>
void ForEachRun(const Layout& layout, const Piece& p, Fn&& fn) {
  const Box& box = layout.tensor_box(p);
  if (box.IsEmpty()) return;
  const Buffer& buffer = layout.buffers[p.buffer];
  const PieceView view = *ViewOf(box, layout.buffer_box(p), buffer.shape);
  if (box.rank == 0) {
    fn(int64_t{0}, view.offset, int64_t{1}, int64_t{1});
    return;
  }
  const Dims tensor_strides = RowMajorStrides(layout.tensors[p.tensor].shape);
  const int last = box.rank - 1;
  std::array<int64_t, kMaxRank> i{};
  while (true) {
    int64_t linear = box.origin[last], offset = view.offset;
    for (int d = 0; d < last; ++d) {
      linear += (box.origin[d] + i[d]) * tensor_strides[d];
      offset += i[d] * view.strides[d];
    }
    fn(linear, offset, box.shape[last], view.strides[last]);
    int d = last - 1;
    for (; d >= 0; --d) {
      if (++i[d] < box.shape[d]) break;
      i[d] = 0;
    }
    if (d < 0) return;
  }
}

// Runs fn(first, last, chunk) over contiguous ranges of `pieces` of about equal element counts,
// one thread each; a small layout runs inline as one chunk. Filling and checking a 60 GB model
// one element at a time on one core takes minutes.
template <typename Fn>
void ForEachChunkOfPieces(const Layout& layout, Fn&& fn) {
  constexpr int64_t kElementsPerThread = int64_t{1} << 24;
  const int64_t n = static_cast<int64_t>(layout.pieces.size());
  std::vector<int64_t> before(n + 1, 0);  // elements of pieces [0, i)
  for (int64_t i = 0; i < n; ++i) {
    before[i + 1] = before[i] + layout.tensor_box(layout.pieces[i]).NumElements();
  }
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int chunks = static_cast<int>(
      std::clamp<int64_t>(before[n] / kElementsPerThread, 1, std::min<int64_t>(cores, 16)));
  if (chunks == 1) {
    fn(int64_t{0}, n, 0);
    return;
  }
  std::vector<std::thread> threads;
  int64_t first = 0;
  for (int c = 0; c < chunks; ++c) {
    const int64_t target = before[n] / chunks * (c + 1);
    int64_t last =
        c + 1 == chunks
            ? n
            : std::lower_bound(before.begin() + first, before.end(), target) - before.begin();
    last = std::min(std::max(last, first), n);
    threads.emplace_back([&fn, first, last, c] { fn(first, last, c); });
    first = last;
  }
  for (auto& t : threads) t.join();
}

// One bit per buffer element: which elements some piece covers. Atomic words, because two
// threads' pieces may end inside the same word.
class CoveredBits {
 public:
  explicit CoveredBits(int64_t elements)
      : words_((elements + 63) / 64), bits_(new std::atomic<uint64_t>[words_]) {
    for (int64_t w = 0; w < words_; ++w) bits_[w].store(0, std::memory_order_relaxed);
  }
  void Mark(int64_t offset, int64_t count, int64_t stride) {
    if (stride != 1) {
      for (int64_t k = 0; k < count; ++k) Set(offset + k * stride, 1);
      return;
    }
    while (count > 0) {
      const int64_t bit = offset % 64, n = std::min<int64_t>(count, 64 - bit);
      Set(offset, n);
      offset += n;
      count -= n;
    }
  }
  bool Covered(int64_t e) const {
    return (bits_[e / 64].load(std::memory_order_relaxed) >> (e % 64)) & 1;
  }
  bool WordFull(int64_t w) const {
    return bits_[w].load(std::memory_order_relaxed) == ~uint64_t{0};
  }

 private:
  // Sets n bits (n <= 64 - offset % 64) from bit `offset`.
  void Set(int64_t offset, int64_t n) {
    const uint64_t mask = (n == 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1)) << (offset % 64);
    bits_[offset / 64].fetch_or(mask, std::memory_order_relaxed);
  }
  int64_t words_;
  std::unique_ptr<std::atomic<uint64_t>[]> bits_;
};

std::string Hex(const std::byte* p, int n) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(p), n));
}

std::string IndexOf(int64_t linear, const Dims& shape) {
  Dims index;
  index.rank = shape.rank;
  for (int d = shape.rank - 1; d >= 0; --d) {
    index[d] = shape[d] ? linear % shape[d] : 0;
    linear = shape[d] ? linear / shape[d] : 0;
  }
  return index.ToString();
}

}  // namespace

uint64_t HashName(absl::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  return h;
}

FillSpec MakeFillSpec(const Layout& source, const Layout& destination, uint64_t seed) {
  FillSpec spec;
  spec.seed = seed;
  spec.numeric.assign(source.tensors.size(), false);
  for (const LogicalTensor& t : destination.tensors) {
    auto it = source.tensor_index.find(t.name);
    if (it == source.tensor_index.end()) continue;
    const LogicalTensor& s = source.tensors[it->second];
    if (s.dtype == t.dtype) continue;
    spec.numeric[it->second] = true;
    if (t.quant.format != QuantFormat::kNone && CanQuantizeFrom(s.dtype)) {
      spec.quant.resize(source.tensors.size());
      spec.quant[it->second] = {t.shape[1], t.quant.block_rows, t.quant.block_cols};
    }
  }
  return spec;
}

float QuantSourceValue(uint64_t name_hash, int64_t linear, const QuantFill& fill, uint64_t seed) {
  const int64_t r = linear / fill.cols, c = linear % fill.cols;
  const int64_t grid_cols = (fill.cols + fill.block_cols - 1) / fill.block_cols;
  const uint64_t block =
      static_cast<uint64_t>((r / fill.block_rows) * grid_cols + c / fill.block_cols);
  const uint64_t bh = SplitMix64(name_hash ^ SplitMix64(seed * 0x9E3779B97F4A7C15ull + block));
  if (bh % 11 == 0) return 0.0f;                              // a block of zeros: scale 1
  const int exponent = static_cast<int>((bh >> 8) % 17) - 8;  // fp16's range holds 100 * 2^8
  const uint64_t h = SplitMix64(name_hash ^ SplitMix64(seed + static_cast<uint64_t>(linear)));
  return std::ldexp(static_cast<float>(static_cast<int>(h % 201) - 100), exponent);
}

void ExpectedElement(uint64_t name_hash, int64_t linear, DType dtype, bool numeric, uint64_t seed,
                     std::byte* out) {
  const int size = DTypeSize(dtype);
  if (numeric) {
    const uint64_t h = SplitMix64(name_hash ^ SplitMix64(seed + static_cast<uint64_t>(linear)));
    const float v = static_cast<float>(static_cast<int>(h % 201) - 100);
    ConvertElements(reinterpret_cast<const std::byte*>(&v), DType::kF32, out, dtype, 1);
    return;
  }
  const uint64_t v = RawValue(name_hash, linear, seed, size);
  std::memcpy(out, &v, size);  // little-endian: the low bytes
}

void FillSources(const Layout& source, const FillSpec& spec, const BufferMemory& memory) {
  ForEachChunkOfPieces(source, [&](int64_t first, int64_t last, int) {
    for (int64_t i = first; i < last; ++i) {
      const Piece& p = source.pieces[i];
      const LogicalTensor& t = source.tensors[p.tensor];
      const uint64_t name_hash = HashName(t.name);
      const int size = DTypeSize(t.dtype);
      std::byte* base = memory[p.buffer].data();
      const bool numeric = spec.numeric[p.tensor];
      const QuantFill* quant =
          spec.quant.empty() || spec.quant[p.tensor].cols == 0 ? nullptr : &spec.quant[p.tensor];
      ForEachRun(source, p, [&](int64_t linear, int64_t offset, int64_t count, int64_t stride) {
        if (quant != nullptr) {
          for (int64_t k = 0; k < count; ++k) {
            const float v = QuantSourceValue(name_hash, linear + k, *quant, spec.seed);
            ConvertElements(reinterpret_cast<const std::byte*>(&v), DType::kF32,
                            base + (offset + k * stride) * size, t.dtype, 1);
          }
          return;
        }
        if (numeric) {
          for (int64_t k = 0; k < count; ++k) {
            ExpectedElement(name_hash, linear + k, t.dtype, true, spec.seed,
                            base + (offset + k * stride) * size);
          }
          return;
        }
        WithElementSize(size, [&](auto kSize) {
          for (int64_t k = 0; k < count; ++k) {
            const uint64_t v = RawValue(name_hash, linear + k, spec.seed, kSize);
            std::memcpy(base + (offset + k * stride) * kSize, &v, kSize);
          }
        });
      });
    }
  });
}

void PoisonDestinations(const BufferMemory& memory) {
  for (const auto& span : memory) std::memset(span.data(), static_cast<int>(kPoison), span.size());
}

absl::StatusOr<CheckReport> CheckDestinations(const Layout& source, const Layout& destination,
                                              const FillSpec& spec, const BufferMemory& memory) {
  // Quantized tensors: the reference's codes and scales of each whole tensor, by destination
  // tensor index (the scale tensor's entry points at its weight's).
  struct Reference {
    std::vector<uint8_t> codes;
    std::vector<std::byte> scales;
  };
  std::vector<std::shared_ptr<Reference>> reference(destination.tensors.size());
  std::vector<char> has_pieces(destination.tensors.size(), 0);
  for (const Piece& p : destination.pieces) has_pieces[p.tensor] = 1;
  // Only the tensors this destination holds (a worker's layout declares every tensor); one
  // thread per tensor, a few at a time (quantizing a model's worth takes a while on one core).
  std::vector<int32_t> todo;
  for (size_t i = 0; i < destination.tensors.size(); ++i) {
    const LogicalTensor& t = destination.tensors[i];
    auto it = source.tensor_index.find(t.name);
    if (it == source.tensor_index.end() || spec.quant.empty() || spec.quant[it->second].cols == 0)
      continue;
    if (!has_pieces[i] && !has_pieces[destination.tensor_index.at(t.quant.scale)]) continue;
    todo.push_back(static_cast<int32_t>(i));
  }
  std::atomic<size_t> next{0};
  std::mutex failed_mu;
  absl::Status failed;
  auto work = [&] {
    for (size_t k = next++; k < todo.size(); k = next++) {
      const size_t i = static_cast<size_t>(todo[k]);
      const LogicalTensor& t = destination.tensors[i];
      auto it = source.tensor_index.find(t.name);
      const QuantFill& fill = spec.quant[it->second];
      const uint64_t name_hash = HashName(t.name);
      const int64_t rows = t.shape[0], cols = t.shape[1];
      std::vector<float> values(static_cast<size_t>(rows * cols));
      for (int64_t e = 0; e < rows * cols; ++e)
        values[e] = QuantSourceValue(name_hash, e, fill, spec.seed);
      auto ref = std::make_shared<Reference>();
      ref->codes.resize(values.size());
      absl::Status done;
      if (t.quant.format == QuantFormat::kMxfp8) {
        std::vector<uint8_t> scales(static_cast<size_t>(Mxfp8ScaleCount(rows, cols)));
        done = QuantizeMxfp8(values, rows, cols, ref->codes, scales);
        ref->scales.resize(scales.size());
        std::memcpy(ref->scales.data(), scales.data(), scales.size());
      } else {
        const Fp8BlockShape block{t.quant.block_rows, t.quant.block_cols};
        std::vector<float> scales(static_cast<size_t>(BlockFp8ScaleCount(rows, cols, block)));
        done = QuantizeBlockFp8(values, rows, cols, block, ref->codes, scales);
        ref->scales.resize(scales.size() * sizeof(float));
        std::memcpy(ref->scales.data(), scales.data(), ref->scales.size());
      }
      if (!done.ok()) {
        std::lock_guard<std::mutex> lock(failed_mu);
        failed = done;
      }
      reference[i] = ref;
      reference[destination.tensor_index.at(t.quant.scale)] = ref;
    }
  };
  {
    const size_t n =
        std::min<size_t>(todo.size(), std::max(1u, std::thread::hardware_concurrency()));
    std::vector<std::thread> threads;
    for (size_t k = 1; k < n; ++k) threads.emplace_back(work);
    work();
    for (auto& th : threads) th.join();
  }
  if (!failed.ok()) return failed;
  std::vector<bool> seen(destination.tensors.size(), false);
  for (const Piece& p : destination.pieces) {  // before the threads start: they look tensors up
    if (seen[p.tensor]) continue;
    seen[p.tensor] = true;
    const std::string& name = destination.tensors[p.tensor].name;
    if (!source.tensor_index.contains(name) && reference[p.tensor] == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor \"", name, "\" is not in the source layout (validate both layouts first)"));
    }
  }
  std::vector<CoveredBits> covered;
  covered.reserve(destination.buffers.size());
  for (const Buffer& b : destination.buffers) covered.emplace_back(b.shape.NumElements());
  // Per chunk of pieces: elements checked, wrong ones, and the first wrong one in piece order.
  struct Tally {
    int64_t checked = 0, wrong = 0;
    std::string first_wrong;
  };
  std::vector<Tally> tallies(16);
  ForEachChunkOfPieces(destination, [&](int64_t first, int64_t last, int chunk) {
    Tally& tally = tallies[chunk];
    for (int64_t i = first; i < last; ++i) {
      const Piece& p = destination.pieces[i];
      const LogicalTensor& t = destination.tensors[p.tensor];
      const Reference* ref = reference[p.tensor].get();
      const int32_t src_tensor = ref != nullptr ? -1 : source.tensor_index.at(t.name);
      const bool numeric = ref == nullptr && spec.numeric[src_tensor];
      const DType src_dtype = ref != nullptr ? t.dtype : source.tensors[src_tensor].dtype;
      const uint64_t name_hash = HashName(t.name);
      const int size = DTypeSize(t.dtype);
      const std::byte* base = memory[p.buffer].data();
      ForEachRun(
          destination, p, [&](int64_t linear, int64_t offset, int64_t count, int64_t stride) {
            covered[p.buffer].Mark(offset, count, stride);
            tally.checked += count;
            auto report_wrong = [&](int64_t k, const std::byte* expected, const std::byte* found) {
              if (tally.wrong++ > 0) return;
              const Buffer& buffer = destination.buffers[p.buffer];
              tally.first_wrong =
                  absl::StrCat("tensor \"", t.name, "\" element ", IndexOf(linear + k, t.shape),
                               " in worker \"", destination.workers[buffer.worker].name,
                               "\" buffer \"", buffer.name, "\" element ", offset + k * stride,
                               ": expected ", Hex(expected, size), ", found ", Hex(found, size));
            };
            if (ref != nullptr) {
              // Codes of the weight, or scales of the scale tensor, as the reference made them.
              const std::byte* want = t.quant.format != QuantFormat::kNone
                                          ? reinterpret_cast<const std::byte*>(ref->codes.data())
                                          : ref->scales.data();
              for (int64_t k = 0; k < count; ++k) {
                const std::byte* expected = want + (linear + k) * size;
                const std::byte* found = base + (offset + k * stride) * size;
                if (std::memcmp(expected, found, size) != 0) report_wrong(k, expected, found);
              }
              return;
            }
            if (numeric) {
              for (int64_t k = 0; k < count; ++k) {
                // The value as the source holds it, then converted as the data plane converts it.
                std::byte at_source[8], expected[8];
                ExpectedElement(name_hash, linear + k, src_dtype, true, spec.seed, at_source);
                ConvertElements(at_source, src_dtype, expected, t.dtype, 1);
                const std::byte* found = base + (offset + k * stride) * size;
                if (std::memcmp(expected, found, size) != 0) report_wrong(k, expected, found);
              }
              return;
            }
            WithElementSize(size, [&](auto kSize) {
              for (int64_t k = 0; k < count; ++k) {
                const uint64_t expected = RawValue(name_hash, linear + k, spec.seed, kSize);
                const std::byte* at = base + (offset + k * stride) * kSize;
                uint64_t found = 0;
                std::memcpy(&found, at, kSize);
                if (found != expected)
                  report_wrong(k, reinterpret_cast<const std::byte*>(&expected), at);
              }
            });
          });
    }
  });
  CheckReport report;
  int64_t wrong = 0;
  std::string first_wrong;
  for (const Tally& tally : tallies) {
    report.elements_checked += tally.checked;
    if (tally.wrong > 0 && wrong == 0) first_wrong = tally.first_wrong;
    wrong += tally.wrong;
  }
  // Every element no piece covers must still be poison.
  for (size_t b = 0; b < destination.buffers.size(); ++b) {
    const Buffer& buffer = destination.buffers[b];
    const int size = DTypeSize(buffer.dtype);
    const int64_t elements = buffer.shape.NumElements();
    for (int64_t e = 0; e < elements; ++e) {
      if (e % 64 == 0 && e + 64 <= elements && covered[b].WordFull(e / 64)) {
        e += 63;
        continue;
      }
      if (covered[b].Covered(e)) continue;
      for (int k = 0; k < size; ++k) {
        ++report.padding_bytes_checked;
        if (memory[b][e * size + k] != kPoison) {
          if (wrong++ == 0) {
            first_wrong =
                absl::StrCat("worker \"", destination.workers[buffer.worker].name, "\" buffer \"",
                             buffer.name, "\" element ", e, ", which no piece covers, was written");
          }
          break;
        }
      }
    }
  }
  if (wrong > 0) {
    return absl::DataLossError(
        absl::StrCat(wrong, " destination elements are wrong; first: ", first_wrong));
  }
  return report;
}

absl::StatusOr<VerifyReport> VerifyOnHost(const Plan& plan, const Layout& source,
                                          const Layout& destination, uint64_t seed,
                                          int64_t max_bytes) {
  const auto start = std::chrono::steady_clock::now();
  VerifyReport report;
  report.bytes_allocated = source.TotalBufferBytes() + destination.TotalBufferBytes();
  for (const ScratchBuffer& b : plan.scratch) report.bytes_allocated += b.NumBytes();
  if (report.bytes_allocated > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("verifying on the host needs ", report.bytes_allocated,
                     " bytes for both layouts' buffers and the plan's scratch;", " the limit is ",
                     max_bytes, " (raise it with --verify-max-bytes, or scale the model down)"));
  }
  auto allocate = [](const Layout& layout, std::vector<std::unique_ptr<std::byte[]>>& owners) {
    BufferMemory memory;
    for (const Buffer& b : layout.buffers) {
      owners.emplace_back(new std::byte[static_cast<size_t>(b.NumBytes())]);
      memory.emplace_back(owners.back().get(), static_cast<size_t>(b.NumBytes()));
    }
    return memory;
  };
  std::vector<std::unique_ptr<std::byte[]>> src_owner, dst_owner;
  const BufferMemory src = allocate(source, src_owner);
  BufferMemory dst = allocate(destination, dst_owner);
  const auto scratch = AllocateScratch(plan, dst);
  const FillSpec spec = MakeFillSpec(source, destination, seed);
  FillSources(source, spec, src);
  PoisonDestinations(dst);
  if (auto s = CheckDescriptorBounds(plan, src, dst); !s.ok()) return s;
  ExecuteOnHost(plan, src, dst);
  auto checked = CheckDestinations(source, destination, spec, dst);
  if (!checked.ok()) return checked.status();
  report.elements_checked = checked->elements_checked;
  report.padding_bytes_checked = checked->padding_bytes_checked;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace refit
