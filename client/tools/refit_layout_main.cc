// refit-layout: writes the trainer or inference layout of a real model, from its Hugging Face
// config.json and a parallel configuration, as layout JSON (docs/LAYOUTS.md).
//
//   refit-layout --config llama3-8b.json --side trainer --tp 4 --pp 2 --dp 2 -o trainer.json
//   refit-layout --config llama3-8b.json --side inference --tp 2 --dp 2 --first-node 2 -o e.json
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
#include <utility>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/models/fp8_layout.h"
#include "client/models/layout_generator.h"
#include "common/cli_flags.h"
#include "plan/status_macros.h"
#include "proto/layout_codec.h"

// refit-layout's flags, in the order --help lists them.
ABSL_FLAG(std::string, config, "", "the model's Hugging Face config.json");
ABSL_FLAG(std::string, side, "", "trainer (Megatron or FSDP style) or inference (vLLM style)");
ABSL_FLAG(int64_t, tp, 1, "tensor parallel size");
ABSL_FLAG(int64_t, pp, 1, "pipeline parallel size (trainer)");
ABSL_FLAG(int64_t, ep, 1, "expert parallel size (trainer; carved out of dp * cp)");
ABSL_FLAG(bool, expert_parallel, false, "inference: experts split over all tp * dp ranks");
ABSL_FLAG(int64_t, dp, 1, "data parallel size (replicas)");
ABSL_FLAG(int64_t, cp, 1, "context parallel size (trainer; replicas of the weights)");
ABSL_FLAG(int64_t, fsdp, 0,
          "trainer: FSDP1 (flat parameters, a unit per decoder layer) over this many ranks "
          "instead of Megatron parallelism; with --dp R, HSDP of R replicas");
ABSL_FLAG(int64_t, fsdp2, 0,
          "trainer: FSDP2 (fully_shard, each parameter sharded on dim 0) over this many ranks; "
          "with --dp R, HSDP of R replicas");
ABSL_FLAG(bool, fsdp_use_orig_params, false,
          "trainer, --fsdp: use_orig_params=True (each parameter aligned to 16 bytes in the flat "
          "parameter)");
ABSL_FLAG(std::string, fsdp_param_dtype, "",
          "trainer, --fsdp-use-orig-params: MixedPrecision param_dtype, which sets the alignment "
          "(default: the weights' dtype)");
ABSL_FLAG(int64_t, gpus_per_node, 8, "GPUs per node: rank r sits on node first + r / G");
ABSL_FLAG(int64_t, first_node, 0, "index of this side's first node");
ABSL_FLAG(int64_t, scale_down, 1, "divide every width by this factor (same structure, smaller)");
ABSL_FLAG(int64_t, layers, 0, "keep at most this many layers (0: all)");
ABSL_FLAG(std::string, dtype, "",
          "dtype of the weights (default: the config's torch_dtype; for the inference side of a "
          "config with an fp8 quantization_config, fp8-block); inference only: fp8-block (block "
          "fp8 with the config's quantization_config weight_block_size and "
          "modules_to_not_convert, else 128x128) or mxfp8: linear weights in float8_e4m3fn with "
          "their scale tensors (docs/LAYOUTS.md); bf16 (or another dtype) overrides the config's "
          "quantization_config");
ABSL_FLAG(std::string, output, "", "output file (default: stdout)");

namespace refit {
namespace {

const FlagSet& LayoutFlagSet() {
  static FlagSet* const flags = [] {
    auto* set = new FlagSet(
        "refit-layout", "--config CONFIG.json --side trainer|inference [parallelism] [-o OUT.json]",
        FLAGS_config, FLAGS_side, FLAGS_tp, FLAGS_pp, FLAGS_ep, FLAGS_expert_parallel, FLAGS_dp,
        FLAGS_cp, FLAGS_fsdp, FLAGS_fsdp2, FLAGS_fsdp_use_orig_params, FLAGS_fsdp_param_dtype,
        FLAGS_gpus_per_node, FLAGS_first_node, FLAGS_scale_down, FLAGS_layers, FLAGS_dtype,
        FLAGS_output);
    set->Alias("o", "output");
    return set;
  }();
  return *flags;
}

// The flags' values, and which of them the command line named.
struct LayoutFlags {
  std::string config_path, side, output, dtype_name, fsdp_param_dtype;
  int64_t tp = 1, pp = 1, ep = 1, dp = 1, cp = 1, fsdp = 0, fsdp2 = 0, gpus_per_node = 8,
          first_node = 0, scale_down = 1, layers = 0;
  bool expert_parallel = false, use_orig_params = false;
  CommandLine given;

  bool Given(absl::string_view name) const { return given.Given(name); }
};

LayoutFlags ReadLayoutFlags(CommandLine given) {
  LayoutFlags f;
  f.config_path = absl::GetFlag(FLAGS_config);
  f.side = absl::GetFlag(FLAGS_side);
  f.output = absl::GetFlag(FLAGS_output);
  f.dtype_name = absl::GetFlag(FLAGS_dtype);
  f.fsdp_param_dtype = absl::GetFlag(FLAGS_fsdp_param_dtype);
  f.tp = absl::GetFlag(FLAGS_tp);
  f.pp = absl::GetFlag(FLAGS_pp);
  f.ep = absl::GetFlag(FLAGS_ep);
  f.dp = absl::GetFlag(FLAGS_dp);
  f.cp = absl::GetFlag(FLAGS_cp);
  f.fsdp = absl::GetFlag(FLAGS_fsdp);
  f.fsdp2 = absl::GetFlag(FLAGS_fsdp2);
  f.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  f.first_node = absl::GetFlag(FLAGS_first_node);
  f.scale_down = absl::GetFlag(FLAGS_scale_down);
  f.layers = absl::GetFlag(FLAGS_layers);
  f.expert_parallel = absl::GetFlag(FLAGS_expert_parallel);
  f.use_orig_params = absl::GetFlag(FLAGS_fsdp_use_orig_params);
  f.given = std::move(given);
  return f;
}

// Each side takes only its framework's settings: the other side's flags are refused by name.
absl::Status CheckInferenceFlags(const LayoutFlags& f) {
  for (const char* name : {"pp", "ep", "cp"}) {
    if (f.Given(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name,
                       " is a trainer flag: the inference side (vLLM) takes --tp, --dp and "
                       "--expert-parallel (experts split over all tp * dp ranks)"));
    }
  }
  for (const char* name : {"fsdp", "fsdp2", "fsdp-use-orig-params", "fsdp-param-dtype"}) {
    if (f.Given(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name,
          " is a trainer flag: the inference side (vLLM) takes --tp, --dp and --expert-parallel"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTrainerFlags(const LayoutFlags& f) {
  if (f.Given("expert-parallel")) {
    return absl::InvalidArgumentError(
        "--expert-parallel is an inference flag: a Megatron trainer takes --ep N");
  }
  if (f.fsdp != 0 || f.fsdp2 != 0) {
    for (const char* name : {"tp", "pp", "ep", "cp"}) {
      if (f.Given(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name,
                         " is a Megatron flag: an FSDP trainer shards everything over its ranks "
                         "(--fsdp or --fsdp2 N, --dp R for HSDP replicas)"));
      }
    }
  }
  if (f.fsdp <= 0) {
    for (const char* name : {"fsdp-use-orig-params", "fsdp-param-dtype"}) {
      if (f.Given(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " is an FSDP1 flag: it needs --fsdp N"));
      }
    }
  }
  if (f.Given("fsdp-param-dtype") && !f.use_orig_params) {
    return absl::InvalidArgumentError(
        "--fsdp-param-dtype only sets the alignment of --fsdp-use-orig-params: give both");
  }
  return absl::OkStatus();
}

absl::Status CheckFlags(const LayoutFlags& f) {
  if (f.config_path.empty()) return absl::InvalidArgumentError("--config is required");
  if (f.side != "trainer" && f.side != "inference") {
    return absl::InvalidArgumentError("--side must be trainer or inference");
  }
  if (f.scale_down < 1) return absl::InvalidArgumentError("--scale-down must be >= 1");
  return f.side == "inference" ? CheckInferenceFlags(f) : CheckTrainerFlags(f);
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

// Sets the flags from the command line; nullopt after --help (printed).
absl::StatusOr<std::optional<LayoutFlags>> ParseLayoutFlags(int argc, char** argv) {
  const FlagSet& flags = LayoutFlagSet();
  REFIT_ASSIGN_OR_RETURN(CommandLine line, flags.Split(argc, argv));
  REFIT_RETURN_IF_ERROR(flags.ResetToDefaults());
  REFIT_RETURN_IF_ERROR(flags.Apply(line.flags));
  if (line.help) {
    std::fputs(flags.Help().c_str(), stdout);
    return std::nullopt;
  }
  if (!line.positional.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument \"", line.positional[0], "\""));
  }
  LayoutFlags f = ReadLayoutFlags(std::move(line));
  REFIT_RETURN_IF_ERROR(CheckFlags(f));
  return f;
}

absl::Status Run(int argc, char** argv) {
  REFIT_ASSIGN_OR_RETURN(const std::optional<LayoutFlags> flags, ParseLayoutFlags(argc, argv));
  if (!flags.has_value()) return absl::OkStatus();
  REFIT_ASSIGN_OR_RETURN(const std::string json, GenerateLayoutJson(*flags));
  return WriteLayout(json, flags->output);
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  if (const absl::Status s = refit::Run(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", refit::ErrorLine("refit-layout", s.message()).c_str());
    return 2;
  }
  return 0;
}
