// A plan's descriptors, stored as what tells them apart and what they share. A frontier plan
// holds millions of descriptors but a few dozen shapes (loops, dtypes, operation): each descriptor
// keeps its buffers, offsets and message in 32 bytes and names its shape, kept once. Whole, they
// were 88 bytes each, and writing those hundreds of MB of fresh memory was over a third of a
// frontier model's planning time (docs/BENCHMARKS.md). Readers get whole descriptors, by value.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "plan/copy_descriptor.h"

namespace refit {

// Everything of a descriptor but where it reads, where it writes and its message.
struct CopyShape {
  int64_t inner = 0;
  std::array<int32_t, kMaxOuterDims> count{};
  std::array<int32_t, kMaxOuterDims> src_stride{};
  std::array<int32_t, kMaxOuterDims> dst_stride{};
  uint8_t outer_rank = 0;
  DType src_dtype = DType::kBF16;
  DType dst_dtype = DType::kBF16;
  CopyOp op = CopyOp::kCopy;
  uint8_t quant_format = 0;
  bool src_is_destination = false;
  uint16_t block_rows = 0;
  uint16_t block_cols = 0;
  uint16_t unused = 0;  // no padding anywhere: shapes are compared and hashed by their bytes
};
static_assert(sizeof(CopyShape) == 56, "no padding: shapes are compared by their bytes");

// A hash of a shape's bytes, and their equality: inline, since every descriptor made is looked up.
inline uint64_t HashShape(const CopyShape& s) {
  uint64_t w[sizeof(CopyShape) / sizeof(uint64_t)];
  std::memcpy(w, &s, sizeof(s));
  // Independent products, summed: a few cycles, and enough for a table of a few dozen shapes.
  uint64_t h = w[0] * 0x9e3779b97f4a7c15u + w[1] * 0xc2b2ae3d27d4eb4fu +
               w[2] * 0x165667b19e3779f9u + w[3] * 0xd6e8feb86659fd93u +
               w[4] * 0xff51afd7ed558ccdu + w[5] * 0xc4ceb9fe1a85ec53u + w[6] * 0x2545f4914f6cdd1du;
  return h ^ (h >> 29);
}
inline bool SameShape(const CopyShape& a, const CopyShape& b) {
  uint64_t x[sizeof(CopyShape) / sizeof(uint64_t)], y[sizeof(CopyShape) / sizeof(uint64_t)];
  std::memcpy(x, &a, sizeof(a));
  std::memcpy(y, &b, sizeof(b));
  uint64_t differ = 0;
  for (size_t k = 0; k < sizeof(CopyShape) / sizeof(uint64_t); ++k) differ |= x[k] ^ y[k];
  return differ == 0;
}

// What tells one descriptor from another of the same shape.
struct PackedDescriptor {
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int32_t src_buffer = 0;
  int32_t dst_buffer = 0;
  int32_t shape = 0;  // index into the table's shapes
  int32_t message = 0;
};
static_assert(sizeof(PackedDescriptor) == 32, "millions per plan");

// Written by one thread at a time, but for set_message on disjoint ranges. On cache lines of its
// own (64 bytes): the lowering thread appends a descriptor while the routing thread works on the
// plan's other fields.
class alignas(64) DescriptorTable {
 public:
  // Whole descriptors, in order, by value.
  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = CopyDescriptor;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = CopyDescriptor;

    const_iterator() = default;
    const_iterator(const DescriptorTable* table, size_t index) : table_(table), index_(index) {}
    CopyDescriptor operator*() const { return (*table_)[index_]; }
    const_iterator& operator++() {
      ++index_;
      return *this;
    }
    const_iterator operator++(int) {
      const_iterator before = *this;
      ++index_;
      return before;
    }
    bool operator==(const const_iterator& o) const { return index_ == o.index_; }
    bool operator!=(const const_iterator& o) const { return index_ != o.index_; }

   private:
    const DescriptorTable* table_ = nullptr;
    size_t index_ = 0;
  };

  size_t size() const { return packed_.size(); }
  bool empty() const { return packed_.empty(); }
  CopyDescriptor operator[](size_t i) const {
    const PackedDescriptor& p = packed_[i];
    const CopyShape& s = shapes_[static_cast<size_t>(p.shape)];
    CopyDescriptor d;
    d.src_buffer = p.src_buffer;
    d.dst_buffer = p.dst_buffer;
    d.src_offset = p.src_offset;
    d.dst_offset = p.dst_offset;
    d.inner = s.inner;
    d.count = s.count;
    d.src_stride = s.src_stride;
    d.dst_stride = s.dst_stride;
    d.outer_rank = s.outer_rank;
    d.src_dtype = s.src_dtype;
    d.dst_dtype = s.dst_dtype;
    d.src_is_destination = s.src_is_destination;
    d.op = s.op;
    d.quant_format = s.quant_format;
    d.block_rows = s.block_rows;
    d.block_cols = s.block_cols;
    d.message = p.message;
    return d;
  }
  const_iterator begin() const { return {this, 0}; }
  const_iterator end() const { return {this, packed_.size()}; }

  void push_back(const CopyDescriptor& d) { packed_.push_back(Pack(d)); }
  // Descriptor i becomes `d`.
  void set(size_t i, const CopyDescriptor& d) { packed_[i] = Pack(d); }
  void reserve(size_t n) { packed_.reserve(n); }
  size_t capacity() const { return packed_.capacity(); }
  void clear();

  int32_t message(size_t i) const { return packed_[i].message; }
  void set_message(size_t i, int32_t message) { packed_[i].message = message; }

  // The packed descriptors' storage, capacity() of them (huge pages, pre-faulting).
  const void* data() const { return packed_.data(); }
  static constexpr size_t kBytesPerDescriptor = sizeof(PackedDescriptor);
  size_t num_shapes() const { return shapes_.size(); }

 private:
  struct ShapeHash {
    size_t operator()(const CopyShape& s) const;
  };
  struct ShapeEq {
    bool operator()(const CopyShape& a, const CopyShape& b) const;
  };
  // The id of `shape`, added if new.
  int32_t Intern(const CopyShape& shape) {
    const uint64_t hash = HashShape(shape);
    const int32_t recent = recent_[hash >> 58];
    // Bounded: a table moved from keeps its recent ids but no shapes.
    if (recent > 0 && static_cast<size_t>(recent) <= shapes_.size() &&
        SameShape(shapes_[static_cast<size_t>(recent - 1)], shape)) {
      return recent - 1;
    }
    return InternSlowly(shape, hash);
  }
  int32_t InternSlowly(const CopyShape& shape, uint64_t hash);
  PackedDescriptor Pack(const CopyDescriptor& d) {
    PackedDescriptor p;
    p.src_offset = d.src_offset;
    p.dst_offset = d.dst_offset;
    p.src_buffer = d.src_buffer;
    p.dst_buffer = d.dst_buffer;
    p.shape = Intern(ShapeOf(d));
    p.message = d.message;
    return p;
  }
  static CopyShape ShapeOf(const CopyDescriptor& d) {
    CopyShape s;
    s.inner = d.inner;
    s.count = d.count;
    s.src_stride = d.src_stride;
    s.dst_stride = d.dst_stride;
    s.outer_rank = d.outer_rank;
    s.src_dtype = d.src_dtype;
    s.dst_dtype = d.dst_dtype;
    s.op = d.op;
    s.quant_format = d.quant_format;
    s.src_is_destination = d.src_is_destination;
    s.block_rows = d.block_rows;
    s.block_cols = d.block_cols;
    return s;
  }

  std::vector<PackedDescriptor> packed_;
  std::vector<CopyShape> shapes_;
  absl::flat_hash_map<CopyShape, int32_t, ShapeHash, ShapeEq> shape_ids_;
  // The shapes interned last, by a few bits of their hash: neighbours share shapes, so nearly
  // every descriptor is found here with one comparison, without a hash-table probe.
  static constexpr size_t kRecent = 64;
  std::array<int32_t, kRecent> recent_{};  // by the hash's top six bits: shape id + 1; 0: none
  static_assert(kRecent == 64, "six bits of the hash pick a slot");
};

}  // namespace refit
