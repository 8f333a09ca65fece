#include "plan/descriptor_table.h"

namespace refit {

size_t DescriptorTable::ShapeHash::operator()(const CopyShape& s) const {
  return static_cast<size_t>(HashShape(s));
}

bool DescriptorTable::ShapeEq::operator()(const CopyShape& a, const CopyShape& b) const {
  return SameShape(a, b);
}

int32_t DescriptorTable::InternSlowly(const CopyShape& shape, uint64_t hash) {
  auto [it, added] = shape_ids_.try_emplace(shape, static_cast<int32_t>(shapes_.size()));
  if (added) shapes_.push_back(shape);
  recent_[hash >> 58] = it->second + 1;
  return it->second;
}

void DescriptorTable::clear() {
  packed_.clear();
  shapes_.clear();
  shape_ids_.clear();
  recent_.fill(0);
}

}  // namespace refit
