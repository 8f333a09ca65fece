#include "plan/layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace refit {

absl::string_view QuantFormatName(QuantFormat format) {
  switch (format) {
    case QuantFormat::kNone:
      return "none";
    case QuantFormat::kBlockFp8:
      return "block_fp8";
    case QuantFormat::kMxfp8:
      return "mxfp8";
  }
  return "?";
}

Quantization Quantization::Of(QuantFormat format, absl::string_view name, int64_t block_rows,
                              int64_t block_cols) {
  Quantization q;
  q.format = format;
  if (format == QuantFormat::kBlockFp8) {
    q.block_rows = block_rows;
    q.block_cols = block_cols;
    q.scale = absl::StrCat(name, "_scale_inv");
  } else if (format == QuantFormat::kMxfp8) {
    q.block_rows = 1;
    q.block_cols = 32;
    q.scale = absl::StrCat(name, "_scale");
  }
  return q;
}

int32_t Layout::AddTensor(std::string name, Dims shape, DType dtype) {
  tensors.push_back({std::move(name), shape, dtype});
  return static_cast<int32_t>(tensors.size() - 1);
}

int32_t Layout::AddWorker(std::string name, int32_t node, int32_t gpu) {
  workers.push_back({std::move(name), node, gpu});
  return static_cast<int32_t>(workers.size() - 1);
}

int32_t Layout::AddBuffer(int32_t worker, std::string name, DType dtype, Dims shape) {
  buffers.push_back({std::move(name), worker, dtype, shape});
  return static_cast<int32_t>(buffers.size() - 1);
}

void Layout::AddPiece(int32_t tensor, const Box& tensor_box, int32_t buffer,
                      const Box& buffer_box) {
  pieces.push_back({tensor, buffer, InternBox(tensor_box), InternBox(buffer_box)});
}

int32_t Layout::InternBox(const Box& box) {
  auto [it, added] = box_ids.emplace(box, static_cast<int32_t>(boxes.size()));
  if (added) boxes.push_back(box);
  return it->second;
}

int64_t Layout::TotalBufferBytes() const {
  int64_t total = 0;
  for (const Buffer& b : buffers) total += b.NumBytes();
  return total;
}

Layout WorkerLayout(const Layout& layout, int32_t worker) {
  Layout out;
  out.tensors = layout.tensors;
  const Worker& w = layout.workers[worker];
  out.AddWorker(w.name, w.node, w.gpu);
  // Its replica too: a worker registering from this layout declares the engine it is a rank of.
  out.workers.back().replica = w.replica;
  out.workers.back().replica_rank = w.replica_rank;
  out.workers.back().replica_size = w.replica_size;
  std::vector<int32_t> buffer_map(layout.buffers.size(), -1);
  for (size_t b = 0; b < layout.buffers.size(); ++b) {
    const Buffer& buffer = layout.buffers[b];
    if (buffer.worker == worker)
      buffer_map[b] = out.AddBuffer(0, buffer.name, buffer.dtype, buffer.shape);
  }
  for (const Piece& p : layout.pieces) {
    if (buffer_map[p.buffer] >= 0) {
      out.AddPiece(p.tensor, layout.tensor_box(p), buffer_map[p.buffer], layout.buffer_box(p));
    }
  }
  return out;
}

absl::StatusOr<PieceView> ViewOf(const Box& tensor_box, const Box& buffer_box,
                                 const Dims& buffer_shape) {
  PieceView view;
  const Dims buffer_strides = RowMajorStrides(buffer_shape);
  view.offset = 0;
  for (int d = 0; d < buffer_box.rank; ++d) view.offset += buffer_box.origin[d] * buffer_strides[d];
  view.strides.rank = tensor_box.rank;
  if (tensor_box.NumElements() != buffer_box.NumElements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor box ", tensor_box.ToString(), " holds ", tensor_box.NumElements(),
        " elements but buffer box ", buffer_box.ToString(), " holds ", buffer_box.NumElements()));
  }
  if (tensor_box.NumElements() == 0) {
    view.strides = RowMajorStrides(tensor_box.shape_dims());
    return view;
  }
  if (tensor_box.rank == buffer_box.rank &&
      std::equal(tensor_box.shape.begin(), tensor_box.shape.begin() + tensor_box.rank,
                 buffer_box.shape.begin())) {
    view.strides = buffer_strides;  // the common case: same shape, element for element
    return view;
  }
  // The buffer box, seen as a strided view of the buffer, reshaped to the tensor box's shape:
  // PyTorch's view-stride rule. Walk both shapes from the innermost dimension; every maximal run
  // of buffer dimensions that is contiguous in memory (a "chunk") must be split exactly by tensor
  // dimensions, which then get row-major strides within that chunk.
  const Box& old = buffer_box;
  int view_d = tensor_box.rank - 1;
  int64_t chunk_base_stride = old.rank > 0 ? buffer_strides[old.rank - 1] : 1;
  int64_t tensor_numel = 1;
  int64_t view_numel = 1;
  for (int d = old.rank - 1; d >= 0; --d) {
    tensor_numel *= old.shape[d];
    bool chunk_ends = d == 0 || (old.shape[d - 1] != 1 &&
                                 buffer_strides[d - 1] != tensor_numel * chunk_base_stride);
    if (chunk_ends) {
      while (view_d >= 0 && (view_numel < tensor_numel || tensor_box.shape[view_d] == 1)) {
        view.strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= tensor_box.shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor box ", tensor_box.ToString(), " cannot be laid out by strides in buffer box ",
            old.ToString(), " of a buffer of shape ", buffer_shape.ToString()));
      }
      if (d > 0) {
        chunk_base_stride = buffer_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  // Remaining tensor dimensions must all be of extent 1.
  while (view_d >= 0) {
    if (tensor_box.shape[view_d] != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor box ", tensor_box.ToString(),
                       " cannot be laid out by strides in buffer box ", old.ToString()));
    }
    view.strides[view_d] = 1;
    --view_d;
  }
  return view;
}

}  // namespace refit
