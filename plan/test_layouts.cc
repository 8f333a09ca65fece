#include "plan/test_layouts.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
                    const std::vector<int64_t>& boundaries, const std::vector<Placement>& placement,
                    const std::string& worker_prefix) {
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

void AddQuantized(Layout& layout, const std::string& name, Dims shape, QuantFormat format,
                  int64_t block_rows, int64_t block_cols, int dim,
                  const std::vector<int64_t>& boundaries, const std::vector<Placement>& placement,
                  const std::string& prefix) {
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
  const int32_t buffer =
      layout.AddBuffer(worker, absl::StrCat(t.name, "@", begin), t.dtype, Dims{end - begin});
  int64_t at = 0;
  for (const Box& b : FlatRangeToBoxes(t.shape, begin, end)) {
    layout.AddPiece(tensor, b, buffer, Box::FromDims(Dims{at}, Dims{b.NumElements()}));
    at += b.NumElements();
  }
}

std::string DescriptorFields(const CopyDescriptor& d) {
  return absl::StrCat(
      d.src_buffer, " ", d.dst_buffer, " ", d.src_offset, " ", d.dst_offset, " ", d.inner, " ",
      absl::StrJoin(d.count, ","), " ", absl::StrJoin(d.src_stride, ","), " ",
      absl::StrJoin(d.dst_stride, ","), " ", d.outer_rank, " ", static_cast<int>(d.src_dtype), " ",
      static_cast<int>(d.dst_dtype), " ", d.src_is_destination, " ", static_cast<int>(d.op), " ",
      d.quant_format, " ", d.block_rows, " ", d.block_cols, " ", d.message);
}

namespace {

std::string MessageFields(const Message& m) {
  return absl::StrCat(m.src_gpu, " ", m.dst_gpu, " ", m.stage, " ", static_cast<int>(m.link), " ",
                      m.bytes, " ", m.first_descriptor, " ", m.num_descriptors);
}

std::string StatsFields(const PlanStats& s) {
  return absl::StrCat(s.tensors, " ", s.pieces, " ", s.transfers, " ", s.descriptors, " ",
                      s.messages, " ", s.bytes_total, " ", s.bytes_network, " ", s.bytes_nvlink,
                      " ", s.bytes_local, " ", s.bytes_forwarded, " ", s.bytes_before_conversion,
                      " ", s.bytes_gathered, " ", s.scratch_bytes, " ", s.stages, " ",
                      s.max_nic_bytes, " ", s.predicted_seconds, " ", s.lower_bound_seconds);
}

}  // namespace

std::string PlanDifference(const Plan& a, const Plan& b) {
  if (a.descriptors.size() != b.descriptors.size()) {
    return absl::StrCat(a.descriptors.size(), " descriptors against ", b.descriptors.size());
  }
  for (size_t i = 0; i < a.descriptors.size(); ++i) {
    const std::string x = DescriptorFields(a.descriptors[i]),
                      y = DescriptorFields(b.descriptors[i]);
    if (x != y) return absl::StrCat("descriptor ", i, ": ", x, " against ", y);
  }
  if (a.message_descriptors != b.message_descriptors)
    return "the messages' descriptor index differs";
  if (a.messages.size() != b.messages.size()) {
    return absl::StrCat(a.messages.size(), " messages against ", b.messages.size());
  }
  for (size_t i = 0; i < a.messages.size(); ++i) {
    const std::string x = MessageFields(a.messages[i]), y = MessageFields(b.messages[i]);
    if (x != y) return absl::StrCat("message ", i, ": ", x, " against ", y);
  }
  if (a.scratch.size() != b.scratch.size()) return "the scratch buffers differ";
  for (size_t i = 0; i < a.scratch.size(); ++i) {
    const ScratchBuffer &x = a.scratch[i], &y = b.scratch[i];
    if (x.gpu != y.gpu || x.worker != y.worker || x.dtype != y.dtype || x.elements != y.elements) {
      return absl::StrCat("scratch buffer ", i, " differs");
    }
  }
  if (StatsFields(a.stats) != StatsFields(b.stats)) {
    return absl::StrCat("statistics ", StatsFields(a.stats), " against ", StatsFields(b.stats));
  }
  return "";
}

}  // namespace refit::testing
