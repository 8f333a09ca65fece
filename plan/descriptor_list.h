// A plan's descriptors, kept in 64 bytes each instead of CopyDescriptor's 120: a frontier model's
// plan has millions of them, and writing them into fresh memory is half of the lowering's time
// and most of the planner's peak memory. A descriptor with a third outer loop, or a value past
// 32 bits where the packed form keeps 32, is kept whole beside the packed ones. Reading gives a
// CopyDescriptor by value, the same fields as were stored: the list changes nothing but memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

#include "plan/copy_descriptor.h"

namespace refit {

class DescriptorList {
 public:
  // What one descriptor costs in the packed form: the planner reserves and pre-faults this much.
  static constexpr size_t kPackedBytes = 64;

  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = CopyDescriptor;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = const CopyDescriptor;

    const_iterator(const DescriptorList* list, size_t i) : list_(list), i_(i) {}
    const CopyDescriptor operator*() const { return (*list_)[i_]; }
    const_iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator==(const const_iterator& o) const { return i_ == o.i_; }
    bool operator!=(const const_iterator& o) const { return i_ != o.i_; }

   private:
    const DescriptorList* list_;
    size_t i_;
  };

  size_t size() const { return packed_.size(); }
  bool empty() const { return packed_.empty(); }
  size_t capacity() const { return packed_.capacity(); }
  void reserve(size_t n) { packed_.reserve(n); }
  void clear() {
    packed_.clear();
    wide_.clear();
  }
  // The packed array's storage (size() * kPackedBytes written, capacity() reserved): for
  // advice to the kernel about its pages, never to read descriptors from.
  const void* storage() const { return packed_.data(); }

  void push_back(const CopyDescriptor& d);
  // By value: a descriptor is unpacked on reading. `const` so that assigning to the result,
  // which would change nothing, does not compile.
  const CopyDescriptor operator[](size_t i) const;
  // Replaces descriptor i.
  void set(size_t i, const CopyDescriptor& d);
  int32_t message(size_t i) const { return packed_[i].message; }
  void set_message(size_t i, int32_t message) { packed_[i].message = message; }
  // Descriptors kept whole: those the packed form cannot hold.
  size_t wide_count() const { return wide_.size(); }

  const_iterator begin() const { return {this, 0}; }
  const_iterator end() const { return {this, packed_.size()}; }

 private:
  static constexpr uint8_t kWide = 0xff;  // outer_rank of a descriptor kept in wide_
  struct Packed {
    int64_t src_offset;  // kWide: the index into wide_
    int64_t dst_offset;
    int32_t src_buffer;
    int32_t dst_buffer;
    int32_t inner;
    int32_t message;  // also a wide descriptor's: set_message writes only here
    int32_t count[2];
    int32_t src_stride[2];
    int32_t dst_stride[2];
    uint8_t outer_rank;
    DType src_dtype;
    DType dst_dtype;
    uint8_t flags;  // bit 0 src_is_destination, bits 1-2 op, bits 3-7 quant_format
    uint16_t block_rows;
    uint16_t block_cols;
  };
  static_assert(sizeof(Packed) == kPackedBytes);

  static bool Pack(const CopyDescriptor& d, Packed& p);
  Packed Wide(const CopyDescriptor& d);

  std::vector<Packed> packed_;
  std::vector<CopyDescriptor> wide_;
};

}  // namespace refit
