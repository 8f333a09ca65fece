// refit-layout: writes the trainer or inference layout of a real model, from its Hugging Face
// config.json and a parallel configuration, as layout JSON (docs/LAYOUTS.md).
//
//   refit-layout --config llama3-8b.json --side trainer --tp 4 --pp 2 --dp 2 -o trainer.json
//   refit-layout --config llama3-8b.json --side inference --tp 2 --dp 2 --first-node 2 \
//       -o engine.json
//   refit-layout --config llama3-8b.json --side trainer --fsdp2 8 [--dp 2] -o fsdp2.json
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
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/fp8_layout.h"
#include "client/layout_generator.h"
#include "common/cli_flags.h"
#include "proto/layout_codec.h"

namespace refit {
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

// The flags as given.
struct LayoutFlags {
  std::string config_path, side, output, dtype_name, fsdp_param_dtype;
  int64_t tp = 1, pp = 1, ep = 1, dp = 1, cp = 1, fsdp = 0, fsdp2 = 0, gpus_per_node = 8,
          first_node = 0, scale_down = 1, layers = 0;
  bool expert_parallel = false, use_orig_params = false;
};

void RegisterFlags(CliFlags& flags, LayoutFlags& f) {
  flags.String("config", &f.config_path, "the model's Hugging Face config.json");
  flags.String("side", &f.side, "trainer (Megatron or FSDP style) or inference (vLLM style)");
  flags.Int("tp", &f.tp, "tensor parallel size");
  flags.Int("pp", &f.pp, "pipeline parallel size (trainer)");
  flags.Int("ep", &f.ep, "expert parallel size (trainer; carved out of dp * cp)");
  flags.Bool("expert-parallel", &f.expert_parallel,
             "inference: experts split over all tp * dp ranks");
  flags.Int("dp", &f.dp, "data parallel size (replicas)");
  flags.Int("cp", &f.cp, "context parallel size (trainer; replicas of the weights)");
  flags.Int("fsdp", &f.fsdp,
            "trainer: FSDP1 (flat parameters, a unit per decoder layer) over this many ranks "
            "instead of Megatron parallelism; with --dp R, HSDP of R replicas");
  flags.Int("fsdp2", &f.fsdp2,
            "trainer: FSDP2 (fully_shard, each parameter sharded on dim 0) over this many "
            "ranks; with --dp R, HSDP of R replicas");
  flags.Bool("fsdp-use-orig-params", &f.use_orig_params,
             "trainer, --fsdp: use_orig_params=True (each parameter aligned to 16 bytes in the "
             "flat parameter)");
  flags.String("fsdp-param-dtype", &f.fsdp_param_dtype,
               "trainer, --fsdp-use-orig-params: MixedPrecision param_dtype, which sets the "
               "alignment (default: the weights' dtype)");
  flags.Int("gpus-per-node", &f.gpus_per_node, "GPUs per node: rank r sits on node first + r / G");
  flags.Int("first-node", &f.first_node, "index of this side's first node");
  flags.Int("scale-down", &f.scale_down,
            "divide every width by this factor (same structure, smaller)");
  flags.Int("layers", &f.layers, "keep at most this many layers (0: all)");
  flags.String("dtype", &f.dtype_name,
               "dtype of the weights (default: the config's torch_dtype; for the inference side "
               "of a config with an fp8 quantization_config, fp8-block); inference only: "
               "fp8-block (block fp8 with the config's quantization_config weight_block_size and "
               "modules_to_not_convert, else 128x128) or mxfp8: linear weights in float8_e4m3fn "
               "with their scale tensors (docs/LAYOUTS.md); bf16 (or another dtype) overrides the "
               "config's quantization_config");
  flags.String("output", &f.output, "output file (default: stdout)", "o");
}

// Each side takes only its framework's settings: the other side's flags are refused by name.
absl::Status CheckInferenceFlags(int argc, char** argv) {
  for (const char* name : {"pp", "ep", "cp"}) {
    if (Given(argc, argv, name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name,
                       " is a trainer flag: the inference side (vLLM) takes --tp, --dp and "
                       "--expert-parallel (experts split over all tp * dp ranks)"));
    }
  }
  for (const char* name : {"fsdp", "fsdp2", "fsdp-use-orig-params", "fsdp-param-dtype"}) {
    if (Given(argc, argv, name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name,
          " is a trainer flag: the inference side (vLLM) takes --tp, --dp and --expert-parallel"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTrainerFlags(const LayoutFlags& f, int argc, char** argv) {
  if (Given(argc, argv, "expert-parallel")) {
    return absl::InvalidArgumentError(
        "--expert-parallel is an inference flag: a Megatron trainer takes --ep N");
  }
  if (f.fsdp != 0 || f.fsdp2 != 0) {
    for (const char* name : {"tp", "pp", "ep", "cp"}) {
      if (Given(argc, argv, name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name,
                         " is a Megatron flag: an FSDP trainer shards everything over its ranks "
                         "(--fsdp or --fsdp2 N, --dp R for HSDP replicas)"));
      }
    }
  }
  if (f.fsdp <= 0) {
    for (const char* name : {"fsdp-use-orig-params", "fsdp-param-dtype"}) {
      if (Given(argc, argv, name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " is an FSDP1 flag: it needs --fsdp N"));
      }
    }
  }
  if (Given(argc, argv, "fsdp-param-dtype") && !f.use_orig_params) {
    return absl::InvalidArgumentError(
        "--fsdp-param-dtype only sets the alignment of --fsdp-use-orig-params: give both");
  }
  return absl::OkStatus();
}

absl::Status CheckFlags(const LayoutFlags& f, int argc, char** argv) {
  if (f.config_path.empty()) return absl::InvalidArgumentError("--config is required");
  if (f.side != "trainer" && f.side != "inference") {
    return absl::InvalidArgumentError("--side must be trainer or inference");
  }
  if (f.scale_down < 1) return absl::InvalidArgumentError("--scale-down must be >= 1");
  return f.side == "inference" ? CheckInferenceFlags(argc, argv) : CheckTrainerFlags(f, argc, argv);
}

// The model of --config, scaled down as the flags ask.
absl::StatusOr<ModelConfig> LoadModel(const LayoutFlags& f) {
  absl::StatusOr<std::string> text = ReadFile(f.config_path);
  if (!text.ok()) return text.status();
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(*text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(f.config_path, ": ", parsed.status().message()));
  }
  return ScaleDown(*parsed, f.scale_down, f.layers);
}

// The weights' dtype and, for an fp8 engine, how it quantizes them.
struct WeightFormat {
  DType dtype = DType::kBF16;
  std::optional<Fp8LayoutOptions> fp8;
  std::string fp8_name;  // "fp8-block" or "mxfp8" when fp8 is set
};

Fp8LayoutOptions Fp8Options(const std::string& name, const ModelConfig& model) {
  Fp8LayoutOptions fp8;
  if (name == "mxfp8") {
    fp8.format = QuantFormat::kMxfp8;
  } else if (model.fp8.present) {
    fp8.block_rows = model.fp8.block_rows;
    fp8.block_cols = model.fp8.block_cols;
  }
  fp8.modules_to_not_convert = model.fp8.modules_to_not_convert;
  return fp8;
}

absl::StatusOr<WeightFormat> ChooseWeightFormat(const LayoutFlags& f, const ModelConfig& model) {
  WeightFormat format;
  format.dtype = model.dtype;
  std::string name = f.dtype_name;
  // An fp8 checkpoint (quantization_config) is served in fp8: its engine layout is fp8 unless
  // --dtype says otherwise.
  if (name.empty() && f.side == "inference" && model.fp8.present) name = "fp8-block";
  if (name == "fp8-block" || name == "mxfp8") {
    if (f.side != "inference") {
      return absl::InvalidArgumentError("--dtype " + name +
                                        " is for the inference side: trainers hold bf16");
    }
    format.fp8 = Fp8Options(name, model);
    format.fp8_name = name;
  } else if (!name.empty()) {
    absl::StatusOr<DType> d = ParseDType(name);
    if (!d.ok()) return d.status();
    format.dtype = *d;
  }
  return format;
}

absl::StatusOr<Layout> MakeTrainerSide(const LayoutFlags& f, const ModelConfig& model,
                                       const PlacementOptions& where, DType dtype) {
  TrainerParallelism p{static_cast<int32_t>(f.tp), static_cast<int32_t>(f.pp),
                       static_cast<int32_t>(f.ep), static_cast<int32_t>(f.dp),
                       static_cast<int32_t>(f.cp), static_cast<int32_t>(f.fsdp)};
  p.fsdp2 = static_cast<int32_t>(f.fsdp2);
  p.fsdp_use_orig_params = f.use_orig_params;
  if (!f.fsdp_param_dtype.empty()) {
    absl::StatusOr<DType> d = ParseDType(f.fsdp_param_dtype);
    if (!d.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--fsdp-param-dtype: ", d.status().message()));
    }
    p.fsdp_param_dtype = *d;
  }
  return MakeTrainerLayout(model, p, where, dtype);
}

std::string TrainerTitle(const LayoutFlags& f) {
  const std::string hsdp = f.dp > 1 ? absl::StrCat(" DP", f.dp) : "";
  if (f.fsdp > 0) {
    return absl::StrCat("trainer FSDP", f.fsdp, hsdp, f.use_orig_params ? " use_orig_params" : "");
  }
  if (f.fsdp2 > 0) return absl::StrCat("trainer FSDP2-", f.fsdp2, hsdp);
  return absl::StrCat("trainer TP", f.tp, " PP", f.pp, " EP", f.ep, " DP", f.dp, " CP", f.cp);
}

absl::StatusOr<Layout> MakeInferenceSide(const LayoutFlags& f, const ModelConfig& model,
                                         const PlacementOptions& where,
                                         const WeightFormat& format) {
  InferenceParallelism p{static_cast<int32_t>(f.tp), static_cast<int32_t>(f.dp), f.expert_parallel};
  absl::StatusOr<Layout> layout = MakeInferenceLayout(model, p, where, format.dtype);
  if (layout.ok() && format.fp8.has_value()) return QuantizeInferenceLayout(*layout, *format.fp8);
  return layout;
}

std::string InferenceTitle(const LayoutFlags& f, const WeightFormat& format) {
  return absl::StrCat("inference TP", f.tp, " DP", f.dp, f.expert_parallel ? " EP" : "",
                      format.fp8 ? " " : "", format.fp8 ? format.fp8_name : "");
}

// The layout the flags describe, as JSON titled with the model type and the parallelism.
absl::StatusOr<std::string> GenerateLayoutJson(const LayoutFlags& f) {
  absl::StatusOr<ModelConfig> model = LoadModel(f);
  if (!model.ok()) return model.status();
  absl::StatusOr<WeightFormat> format = ChooseWeightFormat(f, *model);
  if (!format.ok()) return format.status();
  const PlacementOptions where{static_cast<int32_t>(f.gpus_per_node),
                               static_cast<int32_t>(f.first_node)};
  const bool trainer = f.side == "trainer";
  absl::StatusOr<Layout> layout = trainer ? MakeTrainerSide(f, *model, where, format->dtype)
                                          : MakeInferenceSide(f, *model, where, *format);
  if (!layout.ok()) return layout.status();
  const std::string title = trainer ? TrainerTitle(f) : InferenceTitle(f, *format);
  return LayoutToJson(*layout, absl::StrCat(model->model_type, " ", title));
}

// To --output, or stdout when it is empty.
absl::Status WriteLayout(const std::string& json, const std::string& output) {
  if (output.empty()) {
    std::fwrite(json.data(), 1, json.size(), stdout);
    return absl::OkStatus();
  }
  std::ofstream out(output, std::ios::binary);
  out << json;
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write \"", output, "\""));
  return absl::OkStatus();
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  CliFlags flags("refit-layout",
                 "--config CONFIG.json --side trainer|inference [parallelism] [-o OUT.json]");
  LayoutFlags f;
  RegisterFlags(flags, f);
  flags.Parse(argc, argv);
  if (absl::Status s = CheckFlags(f, argc, argv); !s.ok()) flags.Fail(std::string(s.message()));
  const absl::StatusOr<std::string> json = GenerateLayoutJson(f);
  if (!json.ok()) flags.Fail(std::string(json.status().message()));
  if (absl::Status s = WriteLayout(*json, f.output); !s.ok()) flags.Fail(std::string(s.message()));
  return 0;
}
