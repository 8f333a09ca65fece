#include "plan/test_layouts.h"

#include "absl/strings/str_cat.h"

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

}  // namespace refit::testing
