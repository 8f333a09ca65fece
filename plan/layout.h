// The layout model: which boxes of which logical tensors sit where in which workers' buffers.
//
// A Layout is one side of a model group (the trainers' or the inference engines'). It is plain
// data with indices instead of pointers, so it can be built by generators, decoded from files or
// received over the wire, and planned without touching memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "plan/box.h"
#include "plan/dtype.h"

namespace refit {

// How a destination tensor is quantized on the way (plan/fp8_block.h has the arithmetic,
// docs/LAYOUTS.md the conventions). A quantized tensor is a 2-D fp8_e4m3 [rows, cols] weight with
// one scale per block in the tensor named `scale`:
//   block fp8 (DeepSeek-V3, vLLM `weight_block_size`): blocks of block_rows x block_cols (128 x
//     128), fp32 scales [ceil(rows / block_rows), ceil(cols / block_cols)], "<name>_scale_inv";
//   MXFP8 (OCP MX v1.0): blocks of 1 x 32 along the last dimension, e8m0 scales
//     [rows, ceil(cols / 32)], "<name>_scale".
// From a bf16, fp16 or fp32 source the data plane quantizes (the planner's block rule); from a
// source that holds the same fp8 tensor and its scales, both are copied.
enum class QuantFormat : uint8_t { kNone, kBlockFp8, kMxfp8 };
absl::string_view QuantFormatName(QuantFormat format);  // "none", "block_fp8", "mxfp8"

struct Quantization {
  QuantFormat format = QuantFormat::kNone;
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  std::string scale;  // the scale tensor's name
  // Sets the conventions above for `format` (block fp8: 128 x 128 unless given) for `name`.
  static Quantization Of(QuantFormat format, absl::string_view name, int64_t block_rows = 128,
                         int64_t block_cols = 128);
  DType ScaleDType() const { return format == QuantFormat::kMxfp8 ? DType::kE8M0 : DType::kF32; }
  bool operator==(const Quantization&) const = default;
};

// The model's canonical tensor, e.g. "model.layers.3.self_attn.q_proj.weight", [4096, 4096], bf16.
struct LogicalTensor {
  std::string name;
  Dims shape;
  DType dtype = DType::kBF16;
  Quantization quant;  // format kNone: not quantized
};

// A process that owns memory on one GPU (or host memory) of one node.
struct Worker {
  std::string name;
  int32_t node = 0;  // index of the node in the cluster; both sides share one numbering
  int32_t gpu = 0;   // index of the GPU within its node
  // Inference: the engine replica this worker is rank `replica_rank` of, out of `replica_size`
  // (proto/layout.proto; docs/ROUNDS.md, "Replicas and commit"). replica_size 0: a replica of
  // its own, of size 1. The planner ignores them; the coordinator plans complete replicas only.
  std::string replica;
  int32_t replica_rank = 0;
  int32_t replica_size = 0;
};

// One contiguous, row-major region of a worker's memory.
struct Buffer {
  std::string name;
  int32_t worker = 0;  // index into Layout::workers
  DType dtype = DType::kBF16;
  Dims shape;
  int64_t NumBytes() const { return shape.NumElements() * DTypeSize(dtype); }
};

// "Box `tensor_box` of tensor `tensor` sits at box `buffer_box` of buffer `buffer`." Both boxes
// hold the same number of elements; the k-th element of one in row-major order is the k-th of
// the other. When the shapes differ (an FSDP flat shard holding a few rows of a matrix, an
// expert's matrix inside a stacked [E, rows, cols] buffer), the buffer box must be reachable
// from the tensor box by strides: see BufferStrides().
//
// Boxes are interned in Layout::boxes (a piece holds their indices): replicas and ranks share
// most boxes, and a frontier model's layout has millions of pieces.
struct Piece {
  int32_t tensor = 0;      // index into Layout::tensors
  int32_t buffer = 0;      // index into Layout::buffers
  int32_t tensor_box = 0;  // index into Layout::boxes
  int32_t buffer_box = 0;  // index into Layout::boxes
};

struct Layout {
  std::vector<LogicalTensor> tensors;
  std::vector<Worker> workers;
  std::vector<Buffer> buffers;
  std::vector<Piece> pieces;
  std::vector<Box> boxes;  // interned; see Piece

  // Builders: append and return the index. They check nothing; ValidateLayout does.
  int32_t AddTensor(std::string name, Dims shape, DType dtype);
  int32_t AddWorker(std::string name, int32_t node, int32_t gpu);
  int32_t AddBuffer(int32_t worker, std::string name, DType dtype, Dims shape);
  void AddPiece(int32_t tensor, const Box& tensor_box, int32_t buffer, const Box& buffer_box);

  // Replaces a piece's box (tests and tools that edit layouts).
  void SetTensorBox(size_t piece, const Box& box) { pieces[piece].tensor_box = InternBox(box); }
  void SetBufferBox(size_t piece, const Box& box) { pieces[piece].buffer_box = InternBox(box); }
  int32_t InternBox(const Box& box);

  const Box& tensor_box(const Piece& p) const { return boxes[p.tensor_box]; }
  const Box& buffer_box(const Piece& p) const { return boxes[p.buffer_box]; }

  // Name lookups, built by ValidateLayout.
  absl::flat_hash_map<std::string, int32_t> tensor_index;
  absl::flat_hash_map<std::string, int32_t> worker_index;

  int64_t TotalBufferBytes() const;

  absl::flat_hash_map<Box, int32_t, BoxHash> box_ids;  // InternBox's index into boxes
};

// The part of `layout` one worker holds: every tensor, that worker, its buffers and their pieces.
Layout WorkerLayout(const Layout& layout, int32_t worker);

// Strides, in elements of the buffer, of each tensor-box dimension of piece `p`: the element at
// tensor index i (relative to the tensor box's origin) lives at
// Offset + sum_d i[d] * stride[d]. Fails when the two boxes' shapes are not related by strides.
struct PieceView {
  int64_t offset = 0;  // elements from the buffer's start to the tensor box's first element
  Dims strides;        // per tensor-box dimension
};
absl::StatusOr<PieceView> ViewOf(const Box& tensor_box, const Box& buffer_box,
                                 const Dims& buffer_shape);

}  // namespace refit
