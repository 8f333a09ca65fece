#include "client/models/fp8_layout.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "plan/validate.h"

namespace refit {

bool QuantizedByEngines(absl::string_view name, const Fp8LayoutOptions& options) {
  // Mixtral's experts are w1, w2, w3 (vLLM's FusedMoE quantizes them like any expert).
  const bool mixtral_expert =
      absl::StrContains(name, ".experts.") &&
      (absl::EndsWith(name, ".w1.weight") || absl::EndsWith(name, ".w2.weight") ||
       absl::EndsWith(name, ".w3.weight"));
  if (!absl::EndsWith(name, "proj.weight") && !absl::EndsWith(name, "proj_with_mqa.weight") &&
      !mixtral_expert) {
    return false;
  }
  for (const std::string& m : options.modules_to_not_convert) {
    if (!m.empty() && absl::StrContains(name, m)) return false;
  }
  return true;
}

namespace {

// The scale block: rows x cols of weights share one scale.
struct Block {
  int64_t rows, cols;
};

Block BlockOf(const Fp8LayoutOptions& options) {
  if (options.format == QuantFormat::kMxfp8) return {1, 32};
  return {options.block_rows, options.block_cols};
}

// Quantized weights become fp8, each followed (at the end) by its scale tensor. Returns each
// tensor's scale tensor, -1 for tensors kept as they are.
absl::StatusOr<std::vector<int32_t>> QuantizeTensors(const Layout& in,
                                                     const Fp8LayoutOptions& options, Block block,
                                                     Layout& out) {
  const int64_t br = block.rows, bc = block.cols;
  std::vector<int32_t> scale_of(in.tensors.size(), -1);
  for (size_t t = 0; t < in.tensors.size(); ++t) {
    const LogicalTensor& lt = in.tensors[t];
    if (!QuantizedByEngines(lt.name, options) || lt.shape.rank != 2) continue;
    if (!CanQuantizeFrom(lt.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", lt.name, "\" is ", DTypeName(lt.dtype),
                       "; only bf16, fp16 and fp32 weights are quantized"));
    }
    out.tensors[t].dtype = DType::kF8E4M3;
    out.tensors[t].quant = Quantization::Of(options.format, lt.name, br, bc);
    const Quantization& q = out.tensors[t].quant;
    scale_of[t] = out.AddTensor(
        q.scale, Dims{(lt.shape[0] + br - 1) / br, (lt.shape[1] + bc - 1) / bc}, q.ScaleDType());
  }
  return scale_of;
}

// Which buffers hold quantized weights; an fp8 buffer holds nothing else.
absl::StatusOr<std::vector<bool>> QuantizedBuffers(const Layout& in,
                                                   const std::vector<int32_t>& scale_of) {
  std::vector<int> kind(in.buffers.size(), 0);  // 1: quantized pieces only, 2: plain only
  for (const Piece& p : in.pieces) {
    const int k = scale_of[p.tensor] >= 0 ? 1 : 2;
    if (kind[p.buffer] != 0 && kind[p.buffer] != k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer \"", in.buffers[p.buffer].name, "\" of worker \"",
          in.workers[in.buffers[p.buffer].worker].name, "\" holds tensor \"",
          in.tensors[p.tensor].name, "\" beside tensors quantized otherwise; an fp8 buffer ",
          "holds quantized weights only"));
    }
    kind[p.buffer] = k;
  }
  std::vector<bool> quantized(in.buffers.size());
  for (size_t b = 0; b < kind.size(); ++b) quantized[b] = kind[b] == 1;
  return quantized;
}

// Each quantized buffer becomes fp8 and gets a scale buffer of its last two dimensions' blocks.
// Returns each buffer's scale buffer, -1 for the others.
absl::StatusOr<std::vector<int32_t>> AddScaleBuffers(const Layout& in,
                                                     const std::vector<bool>& quantized,
                                                     const Fp8LayoutOptions& options, Block block,
                                                     Layout& out) {
  const bool mx = options.format == QuantFormat::kMxfp8;
  std::vector<int32_t> scale_buffer(in.buffers.size(), -1);
  for (size_t b = 0; b < in.buffers.size(); ++b) {
    if (!quantized[b]) continue;
    const Buffer& buffer = in.buffers[b];
    if (buffer.shape.rank < 2) {
      return absl::InvalidArgumentError(absl::StrCat("buffer \"", buffer.name,
                                                     "\" holds 2-D weights flat; ",
                                                     "fp8 buffers are [..., rows, cols]"));
    }
    out.buffers[b].dtype = DType::kF8E4M3;
    Dims grid = buffer.shape;
    grid[grid.rank - 2] = (grid[grid.rank - 2] + block.rows - 1) / block.rows;
    grid[grid.rank - 1] = (grid[grid.rank - 1] + block.cols - 1) / block.cols;
    scale_buffer[b] =
        out.AddBuffer(buffer.worker, absl::StrCat(buffer.name, mx ? "_scale" : "_scale_inv"),
                      mx ? DType::kE8M0 : DType::kF32, grid);
  }
  return scale_buffer;
}

// The boxes of piece `p`'s scales, in blocks: its tensor box and its buffer box. Refused when the
// piece cuts a block, which an engine could not load.
absl::StatusOr<std::pair<Box, Box>> ScaleBoxes(const Layout& in, const Piece& p, Block block) {
  const Box& tb = in.tensor_box(p);
  const Box& bb = in.buffer_box(p);
  const LogicalTensor& t = in.tensors[p.tensor];
  Box tblocks = tb, bblocks = bb;
  const int64_t size[2] = {block.rows, block.cols};
  for (int d = 0; d < 2; ++d) {
    const int bd = bb.rank - 2 + d;
    const int64_t tend = tb.origin[d] + tb.shape[d];
    const int64_t bend = bb.origin[bd] + bb.shape[bd];
    const int64_t buffer_extent = in.buffers[p.buffer].shape[bd];
    const bool tensor_ok =
        tb.origin[d] % size[d] == 0 && (tend % size[d] == 0 || tend == t.shape[d]);
    // In the buffer, a block edge or, with the tensor's end, the buffer's (a partial last block).
    const bool buffer_ok = bb.origin[bd] % size[d] == 0 &&
                           (bend % size[d] == 0 || (tend == t.shape[d] && bend == buffer_extent));
    if (!tensor_ok || !buffer_ok || bb.shape[bd] != tb.shape[d]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", t.name, "\" in worker \"", in.workers[in.buffers[p.buffer].worker].name,
          "\" buffer \"", in.buffers[p.buffer].name, "\" at ", bb.ToString(), " (tensor box ",
          tb.ToString(), ") cuts a ", size[0], "x", size[1], " block (dimension ", d,
          "); engines load fp8 blocks whole (choose a tensor-parallel size that ",
          "divides the weight into whole blocks, as vLLM requires)"));
    }
    tblocks.origin[d] = tb.origin[d] / size[d];
    tblocks.shape[d] = (tend + size[d] - 1) / size[d] - tblocks.origin[d];
    bblocks.origin[bd] = bb.origin[bd] / size[d];
    bblocks.shape[bd] = (bend + size[d] - 1) / size[d] - bblocks.origin[bd];
  }
  return std::make_pair(tblocks, bblocks);
}

}  // namespace

absl::StatusOr<Layout> QuantizeInferenceLayout(const Layout& in, const Fp8LayoutOptions& options) {
  Layout out = in;
  const Block block = BlockOf(options);
  absl::StatusOr<std::vector<int32_t>> scale_of = QuantizeTensors(in, options, block, out);
  if (!scale_of.ok()) return scale_of.status();
  absl::StatusOr<std::vector<bool>> quantized = QuantizedBuffers(in, *scale_of);
  if (!quantized.ok()) return quantized.status();
  absl::StatusOr<std::vector<int32_t>> scale_buffer =
      AddScaleBuffers(in, *quantized, options, block, out);
  if (!scale_buffer.ok()) return scale_buffer.status();
  // Each quantized piece gets the piece of its scales.
  for (const Piece& p : in.pieces) {
    if ((*scale_of)[p.tensor] < 0) continue;
    absl::StatusOr<std::pair<Box, Box>> boxes = ScaleBoxes(in, p, block);
    if (!boxes.ok()) return boxes.status();
    out.AddPiece((*scale_of)[p.tensor], boxes->first, (*scale_buffer)[p.buffer], boxes->second);
  }
  return out;
}

}  // namespace refit
