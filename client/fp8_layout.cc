#include "client/fp8_layout.h"

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

absl::StatusOr<Layout> QuantizeInferenceLayout(const Layout& in, const Fp8LayoutOptions& options) {
  Layout out = in;
  const int64_t br = options.format == QuantFormat::kMxfp8 ? 1 : options.block_rows;
  const int64_t bc = options.format == QuantFormat::kMxfp8 ? 32 : options.block_cols;
  // The tensors: quantized weights become fp8, each followed (at the end) by its scale tensor.
  std::vector<int32_t> scale_of(in.tensors.size(), -1);
  for (size_t t = 0; t < in.tensors.size(); ++t) {
    const LogicalTensor& lt = in.tensors[t];
    if (!QuantizedByEngines(lt.name, options) || lt.shape.rank != 2) continue;
    if (!CanQuantizeFrom(lt.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", lt.name, "\" is ", DTypeName(lt.dtype),
                                                     "; only bf16, fp16 and fp32 weights are quantized"));
    }
    out.tensors[t].dtype = DType::kF8E4M3;
    out.tensors[t].quant = Quantization::Of(options.format, lt.name, br, bc);
    const Quantization& q = out.tensors[t].quant;
    scale_of[t] = out.AddTensor(q.scale, Dims{(lt.shape[0] + br - 1) / br, (lt.shape[1] + bc - 1) / bc},
                                q.ScaleDType());
  }
  // The buffers: one holding quantized weights becomes fp8 and gets a scale buffer.
  std::vector<int> kind(in.buffers.size(), 0);  // 1: quantized pieces only, 2: plain only
  for (const Piece& p : in.pieces) {
    const int k = scale_of[p.tensor] >= 0 ? 1 : 2;
    if (kind[p.buffer] != 0 && kind[p.buffer] != k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer \"", in.buffers[p.buffer].name, "\" of worker \"", in.workers[in.buffers[p.buffer].worker].name,
          "\" holds tensor \"", in.tensors[p.tensor].name, "\" beside tensors quantized otherwise; an fp8 buffer ",
          "holds quantized weights only"));
    }
    kind[p.buffer] = k;
  }
  std::vector<int32_t> scale_buffer(in.buffers.size(), -1);
  for (size_t b = 0; b < in.buffers.size(); ++b) {
    if (kind[b] != 1) continue;
    const Buffer& buffer = in.buffers[b];
    if (buffer.shape.rank < 2) {
      return absl::InvalidArgumentError(absl::StrCat("buffer \"", buffer.name, "\" holds 2-D weights flat; ",
                                                     "fp8 buffers are [..., rows, cols]"));
    }
    out.buffers[b].dtype = DType::kF8E4M3;
    Dims grid = buffer.shape;
    grid[grid.rank - 2] = (grid[grid.rank - 2] + br - 1) / br;
    grid[grid.rank - 1] = (grid[grid.rank - 1] + bc - 1) / bc;
    const DType scale_dtype = options.format == QuantFormat::kMxfp8 ? DType::kE8M0 : DType::kF32;
    scale_buffer[b] = out.AddBuffer(buffer.worker,
                                    absl::StrCat(buffer.name, options.format == QuantFormat::kMxfp8 ? "_scale" : "_scale_inv"),
                                    scale_dtype, grid);
  }
  const size_t pieces = in.pieces.size();
  for (size_t i = 0; i < pieces; ++i) {
    const Piece p = in.pieces[i];
    if (scale_of[p.tensor] < 0) continue;
    const Box& tb = in.tensor_box(p);
    const Box& bb = in.buffer_box(p);
    const LogicalTensor& t = in.tensors[p.tensor];
    Box tblocks = tb, bblocks = bb;
    const int64_t block[2] = {br, bc};
    for (int d = 0; d < 2; ++d) {
      const int bd = bb.rank - 2 + d;
      const int64_t tend = tb.origin[d] + tb.shape[d];
      const int64_t bend = bb.origin[bd] + bb.shape[bd];
      const int64_t buffer_extent = in.buffers[p.buffer].shape[bd];
      const bool tensor_ok = tb.origin[d] % block[d] == 0 && (tend % block[d] == 0 || tend == t.shape[d]);
      // In the buffer, a block edge or, with the tensor's end, the buffer's (a partial last block).
      const bool buffer_ok = bb.origin[bd] % block[d] == 0 &&
                             (bend % block[d] == 0 || (tend == t.shape[d] && bend == buffer_extent));
      if (!tensor_ok || !buffer_ok || bb.shape[bd] != tb.shape[d]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", t.name, "\" in worker \"", in.workers[in.buffers[p.buffer].worker].name, "\" buffer \"",
            in.buffers[p.buffer].name, "\" at ", bb.ToString(), " (tensor box ", tb.ToString(), ") cuts a ", block[0], "x", block[1],
            " block (dimension ", d, "); engines load fp8 blocks whole (choose a tensor-parallel size that ",
            "divides the weight into whole blocks, as vLLM requires)"));
      }
      tblocks.origin[d] = tb.origin[d] / block[d];
      tblocks.shape[d] = (tend + block[d] - 1) / block[d] - tblocks.origin[d];
      bblocks.origin[bd] = bb.origin[bd] / block[d];
      bblocks.shape[bd] = (bend + block[d] - 1) / block[d] - bblocks.origin[bd];
    }
    out.AddPiece(scale_of[p.tensor], tblocks, scale_buffer[p.buffer], bblocks);
  }
  return out;
}

}  // namespace refit
