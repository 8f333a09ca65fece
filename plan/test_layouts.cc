#include "plan/test_layouts.h"

#include "absl/strings/str_cat.h"
#include "plan/flat_range.h"

namespace refit::testing {

Box B(std::initializer_list<int64_t> origin, std::initializer_list<int64_t> shape) {
  return Box::FromDims(Dims(origin), Dims(shape));
}

std::vector<int64_t> EvenSplit(int64_t extent, int parts) {
  std::vector<int64_t> b = {0};
  for (int i = 0; i < parts; ++i) b.push_back(b.back() + extent / parts + (i < extent % parts));
  return b;
}

void AddSplitTensor(Layout& layout, const std::string& tensor, Dims shape, DType dtype, int dim,
                    const std::vector<int64_t>& boundaries,
                    const std::vector<Placement>& placement, const std::string& worker_prefix) {
  int32_t t = -1;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    if (layout.tensors[i].name == tensor) t = static_cast<int32_t>(i);
  }
  if (t < 0) t = layout.AddTensor(tensor, shape, dtype);
  for (size_t i = 0; i + 1 < boundaries.size(); ++i) {
    const std::string wname = absl::StrCat(worker_prefix, i);
    int32_t w = -1;
    for (size_t k = 0; k < layout.workers.size(); ++k) {
      if (layout.workers[k].name == wname) w = static_cast<int32_t>(k);
    }
    if (w < 0) w = layout.AddWorker(wname, placement[i].node, placement[i].gpu);
    Box box = Box::Whole(shape);
    box.origin[dim] = boundaries[i];
    box.shape[dim] = boundaries[i + 1] - boundaries[i];
    const int32_t buffer = layout.AddBuffer(w, tensor, dtype, box.shape_dims());
    layout.AddPiece(t, box, buffer, Box::Whole(box.shape_dims()));
  }
}

namespace {
int64_t TestCeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

void AddQuantized(Layout& layout, const std::string& name, Dims shape, QuantFormat format, int64_t block_rows,
                  int64_t block_cols, int dim, const std::vector<int64_t>& boundaries,
                  const std::vector<Placement>& placement, const std::string& prefix) {
  const Quantization q = Quantization::Of(format, name, block_rows, block_cols);
  int32_t w = -1, s = -1;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    if (layout.tensors[i].name == name) w = static_cast<int32_t>(i);
    if (layout.tensors[i].name == q.scale) s = static_cast<int32_t>(i);
  }
  const int64_t block[2] = {q.block_rows, q.block_cols};
  const Dims grid{TestCeilDiv(shape[0], block[0]), TestCeilDiv(shape[1], block[1])};
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
    blocks.shape[dim] = TestCeilDiv(boundaries[i + 1], block[dim]) - blocks.origin[dim];
    const int32_t scales = layout.AddBuffer(worker, q.scale, q.ScaleDType(), blocks.shape_dims());
    layout.AddPiece(s, blocks, scales, Box::Whole(blocks.shape_dims()));
  }
}

void AddFlatShard(Layout& layout, int32_t tensor, int32_t worker, int64_t begin, int64_t end) {
  const LogicalTensor& t = layout.tensors[tensor];
  const int32_t buffer = layout.AddBuffer(worker, absl::StrCat(t.name, "@", begin), t.dtype, Dims{end - begin});
  int64_t at = 0;
  for (const Box& b : FlatRangeToBoxes(t.shape, begin, end)) {
    layout.AddPiece(tensor, b, buffer, Box::FromDims(Dims{at}, Dims{b.NumElements()}));
    at += b.NumElements();
  }
}

}  // namespace refit::testing
