// An inference layout in fp8: which of an engine's tensors it loads quantized, and
// where their scales sit, in the conventions engines load (docs/LAYOUTS.md, "fp8 engines").
//
// Quantized: the 2-D weights of linear layers, named "...proj.weight" or "...proj_with_mqa.weight"
// (attention and MLP projections, every expert's, MLA's), and Mixtral's experts
// "...experts.<e>.w1/w2/w3.weight", as vLLM's Fp8LinearMethod / Fp8MoEMethod and
// DeepSeek-V3's checkpoint do; not embeddings, lm_head, norms, biases or the MoE router (vLLM
// builds the router with quant_config=None), nor any tensor whose name contains one of
// `modules_to_not_convert`. Each quantized weight's buffer becomes fp8_e4m3 and gains a scale
// buffer beside it, "<buffer>_scale_inv" (block fp8, fp32) or "<buffer>_scale" (MXFP8, e8m0), with
// the blocks of the buffer's last two dimensions: a fused qkv_proj or an expert-stacked w13 keeps
// one scale buffer, its pieces the weights' blocks, as vLLM lays out weight_scale_inv.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/layout.h"

namespace refit {

struct Fp8LayoutOptions {
  QuantFormat format = QuantFormat::kBlockFp8;
  int64_t block_rows = 128, block_cols = 128;  // block fp8; MXFP8 is 1 x 32
  std::vector<std::string> modules_to_not_convert;
};

// Whether the engine loads tensor `name` quantized, by the rule above.
bool QuantizedByEngines(absl::string_view name, const Fp8LayoutOptions& options);

// `layout` (an inference layout in bf16, fp16 or fp32) with its quantized weights in fp8 and
// their scale tensors. INVALID_ARGUMENT naming the tensor when a buffer mixes quantized and
// plain tensors or a piece cuts a block (an engine could not load it: vLLM refuses the same
// tensor-parallel sizes).
absl::StatusOr<Layout> QuantizeInferenceLayout(const Layout& layout,
                                               const Fp8LayoutOptions& options);

}  // namespace refit
