// refit-layout: writes the trainer or inference layout of a real model, from its Hugging Face
// config.json and a parallel configuration, as layout JSON (docs/LAYOUTS.md).
//
//   refit-layout --config llama3-8b.json --side trainer --tp 4 --pp 2 --dp 2 -o trainer.json
//   refit-layout --config llama3-8b.json --side inference --tp 2 --dp 2 --first-node 2 -o
//   engine.json refit-layout --config llama3-8b.json --side trainer --fsdp2 8 [--dp 2] -o
//   fsdp2.json
//
// A config with an fp8 quantization_config (DeepSeek-V3 as shipped) gives an fp8 engine layout
// (its weight_block_size, weight_scale_inv tensors) unless --dtype names another dtype.
//
// A flag of the other side (--pp, --ep, --cp, --fsdp* for inference; --expert-parallel for a
// trainer), a parallelism the framework refuses, or a model type not modeled faithfully: one line
// naming it on stderr, exit code 2.
#include <cstdio>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/cli_flags.h"
#include "client/fp8_layout.h"
#include "client/layout_generator.h"
#include "proto/layout_codec.h"

namespace {

// Whether argv names flag `name` (as --name, -name, --name=..., -name=...; CliFlags accepts all).
bool Given(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.size() < 2 || arg[0] != '-') continue;
    arg = arg.substr(arg[1] == '-' ? 2 : 1);
    if (arg == name || arg.rfind(name + "=", 0) == 0) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace refit;
  std::string config_path, side, output, dtype_name, fsdp_param_dtype;
  int64_t tp = 1, pp = 1, ep = 1, dp = 1, cp = 1, fsdp = 0, fsdp2 = 0, gpus_per_node = 8,
          first_node = 0, scale_down = 1, layers = 0;
  bool expert_parallel = false, use_orig_params = false;
  CliFlags flags("refit-layout", "--config CONFIG.json --side trainer|inference [parallelism] [-o OUT.json]");
  flags.String("config", &config_path, "the model's Hugging Face config.json");
  flags.String("side", &side, "trainer (Megatron or FSDP style) or inference (vLLM style)");
  flags.Int("tp", &tp, "tensor parallel size");
  flags.Int("pp", &pp, "pipeline parallel size (trainer)");
  flags.Int("ep", &ep, "expert parallel size (trainer; carved out of dp * cp)");
  flags.Bool("expert-parallel", &expert_parallel, "inference: experts split over all tp * dp ranks");
  flags.Int("dp", &dp, "data parallel size (replicas)");
  flags.Int("cp", &cp, "context parallel size (trainer; replicas of the weights)");
  flags.Int("fsdp", &fsdp, "trainer: FSDP1 (flat parameters, a unit per decoder layer) over this many ranks "
                           "instead of Megatron parallelism; with --dp R, HSDP of R replicas");
  flags.Int("fsdp2", &fsdp2, "trainer: FSDP2 (fully_shard, each parameter sharded on dim 0) over this many "
                             "ranks; with --dp R, HSDP of R replicas");
  flags.Bool("fsdp-use-orig-params", &use_orig_params,
             "trainer, --fsdp: use_orig_params=True (each parameter aligned to 16 bytes in the flat parameter)");
  flags.String("fsdp-param-dtype", &fsdp_param_dtype,
               "trainer, --fsdp-use-orig-params: MixedPrecision param_dtype, which sets the alignment "
               "(default: the weights' dtype)");
  flags.Int("gpus-per-node", &gpus_per_node, "GPUs per node: rank r sits on node first + r / G");
  flags.Int("first-node", &first_node, "index of this side's first node");
  flags.Int("scale-down", &scale_down, "divide every width by this factor (same structure, smaller)");
  flags.Int("layers", &layers, "keep at most this many layers (0: all)");
  flags.String("dtype", &dtype_name,
               "dtype of the weights (default: the config's torch_dtype; for the inference side of "
               "a config with "
               "an fp8 quantization_config, fp8-block); inference only: fp8-block (block fp8 with "
               "the config's "
               "quantization_config weight_block_size and modules_to_not_convert, else 128x128) or "
               "mxfp8: linear "
               "weights in float8_e4m3fn with their scale tensors (docs/LAYOUTS.md); bf16 (or "
               "another dtype) "
               "overrides the config's quantization_config");
  flags.String("output", &output, "output file (default: stdout)", "o");
  flags.Parse(argc, argv);

  if (config_path.empty()) flags.Fail("--config is required");
  if (side != "trainer" && side != "inference") flags.Fail("--side must be trainer or inference");
  if (scale_down < 1) flags.Fail("--scale-down must be >= 1");
  // Each side takes only its framework's settings: refuse the other side's flags by name.
  if (side == "inference") {
    for (const char* name : {"pp", "ep", "cp"}) {
      if (Given(argc, argv, name)) {
        flags.Fail(absl::StrCat("--", name, " is a trainer flag: the inference side (vLLM) takes --tp, --dp "
                                "and --expert-parallel (experts split over all tp * dp ranks)"));
      }
    }
    for (const char* name : {"fsdp", "fsdp2", "fsdp-use-orig-params", "fsdp-param-dtype"}) {
      if (Given(argc, argv, name)) {
        flags.Fail(absl::StrCat("--", name, " is a trainer flag: the inference side (vLLM) takes --tp, --dp "
                                "and --expert-parallel"));
      }
    }
  } else {
    if (Given(argc, argv, "expert-parallel")) {
      flags.Fail("--expert-parallel is an inference flag: a Megatron trainer takes --ep N");
    }
    if (fsdp != 0 || fsdp2 != 0) {
      for (const char* name : {"tp", "pp", "ep", "cp"}) {
        if (Given(argc, argv, name)) {
          flags.Fail(absl::StrCat("--", name, " is a Megatron flag: an FSDP trainer shards everything over "
                                  "its ranks (--fsdp or --fsdp2 N, --dp R for HSDP replicas)"));
        }
      }
    }
    if (fsdp <= 0) {
      for (const char* name : {"fsdp-use-orig-params", "fsdp-param-dtype"}) {
        if (Given(argc, argv, name)) flags.Fail(absl::StrCat("--", name, " is an FSDP1 flag: it needs --fsdp N"));
      }
    }
    if (Given(argc, argv, "fsdp-param-dtype") && !use_orig_params) {
      flags.Fail("--fsdp-param-dtype only sets the alignment of --fsdp-use-orig-params: give both");
    }
  }
  auto text = ReadFile(config_path);
  if (!text.ok()) flags.Fail(std::string(text.status().message()));
  auto parsed = ParseModelConfig(*text);
  if (!parsed.ok()) flags.Fail(absl::StrCat(config_path, ": ", parsed.status().message()));
  const ModelConfig model = ScaleDown(*parsed, scale_down, layers);
  DType dtype = model.dtype;
  std::optional<Fp8LayoutOptions> fp8;
  // An fp8 checkpoint (quantization_config) is served in fp8: its engine layout is fp8 unless
  // --dtype says otherwise.
  if (dtype_name.empty() && side == "inference" && model.fp8.present) dtype_name = "fp8-block";
  if (dtype_name == "fp8-block" || dtype_name == "mxfp8") {
    if (side != "inference") flags.Fail("--dtype " + dtype_name + " is for the inference side: trainers hold bf16");
    fp8.emplace();
    if (dtype_name == "mxfp8") {
      fp8->format = QuantFormat::kMxfp8;
    } else if (model.fp8.present) {
      fp8->block_rows = model.fp8.block_rows;
      fp8->block_cols = model.fp8.block_cols;
    }
    fp8->modules_to_not_convert = model.fp8.modules_to_not_convert;
  } else if (!dtype_name.empty()) {
    auto d = ParseDType(dtype_name);
    if (!d.ok()) flags.Fail(std::string(d.status().message()));
    dtype = *d;
  }
  PlacementOptions where{static_cast<int32_t>(gpus_per_node), static_cast<int32_t>(first_node)};
  absl::StatusOr<Layout> layout;
  std::string title;
  if (side == "trainer") {
    TrainerParallelism p{static_cast<int32_t>(tp), static_cast<int32_t>(pp), static_cast<int32_t>(ep),
                         static_cast<int32_t>(dp), static_cast<int32_t>(cp), static_cast<int32_t>(fsdp)};
    p.fsdp2 = static_cast<int32_t>(fsdp2);
    p.fsdp_use_orig_params = use_orig_params;
    if (!fsdp_param_dtype.empty()) {
      auto d = ParseDType(fsdp_param_dtype);
      if (!d.ok()) flags.Fail(absl::StrCat("--fsdp-param-dtype: ", d.status().message()));
      p.fsdp_param_dtype = *d;
    }
    layout = MakeTrainerLayout(model, p, where, dtype);
    const std::string hsdp = dp > 1 ? absl::StrCat(" DP", dp) : "";
    title = fsdp > 0    ? absl::StrCat("trainer FSDP", fsdp, hsdp, use_orig_params ? " use_orig_params" : "")
            : fsdp2 > 0 ? absl::StrCat("trainer FSDP2-", fsdp2, hsdp)
                        : absl::StrCat("trainer TP", tp, " PP", pp, " EP", ep, " DP", dp, " CP", cp);
  } else {
    InferenceParallelism p{static_cast<int32_t>(tp), static_cast<int32_t>(dp), expert_parallel};
    layout = MakeInferenceLayout(model, p, where, dtype);
    if (layout.ok() && fp8.has_value()) layout = QuantizeInferenceLayout(*layout, *fp8);
    title = absl::StrCat("inference TP", tp, " DP", dp, expert_parallel ? " EP" : "", fp8 ? " " : "",
                         fp8 ? dtype_name : "");
  }
  if (!layout.ok()) flags.Fail(std::string(layout.status().message()));
  const std::string json = LayoutToJson(*layout, absl::StrCat(model.model_type, " ", title));
  if (output.empty()) {
    std::fwrite(json.data(), 1, json.size(), stdout);
  } else {
    std::ofstream out(output, std::ios::binary);
    out << json;
    if (!out) flags.Fail(absl::StrCat("cannot write \"", output, "\""));
  }
  return 0;
}
