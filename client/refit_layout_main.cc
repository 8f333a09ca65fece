// refit-layout: writes the trainer or inference layout of a real model, from its Hugging Face
// config.json and a parallel configuration, as layout JSON (docs/LAYOUTS.md).
//
//   refit-layout --config llama3-8b.json --side trainer --tp 4 --pp 2 --dp 2 -o trainer.json
//   refit-layout --config llama3-8b.json --side inference --tp 2 --dp 2 --first-node 2 -o engine.json
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "client/cli_flags.h"
#include "client/layout_generator.h"
#include "proto/layout_codec.h"

int main(int argc, char** argv) {
  using namespace refit;
  std::string config_path, side, output, dtype_name;
  int64_t tp = 1, pp = 1, ep = 1, dp = 1, cp = 1, fsdp = 0, gpus_per_node = 8, first_node = 0,
          scale_down = 1, layers = 0;
  bool expert_parallel = false;
  CliFlags flags("refit-layout", "--config CONFIG.json --side trainer|inference [parallelism] [-o OUT.json]");
  flags.String("config", &config_path, "the model's Hugging Face config.json");
  flags.String("side", &side, "trainer (Megatron style) or inference (vLLM style)");
  flags.Int("tp", &tp, "tensor parallel size");
  flags.Int("pp", &pp, "pipeline parallel size (trainer)");
  flags.Int("ep", &ep, "expert parallel size (trainer; carved out of dp * cp)");
  flags.Bool("expert-parallel", &expert_parallel, "inference: experts split over all tp * dp ranks");
  flags.Int("dp", &dp, "data parallel size (replicas)");
  flags.Int("cp", &cp, "context parallel size (trainer; replicas of the weights)");
  flags.Int("fsdp", &fsdp, "trainer: FSDP over this many ranks instead of Megatron parallelism");
  flags.Int("gpus-per-node", &gpus_per_node, "GPUs per node: rank r sits on node first + r / G");
  flags.Int("first-node", &first_node, "index of this side's first node");
  flags.Int("scale-down", &scale_down, "divide every width by this factor (same structure, smaller)");
  flags.Int("layers", &layers, "keep at most this many layers (0: all)");
  flags.String("dtype", &dtype_name, "dtype of the weights (default: the config's torch_dtype)");
  flags.String("output", &output, "output file (default: stdout)", "o");
  flags.Parse(argc, argv);

  if (config_path.empty()) flags.Fail("--config is required");
  if (side != "trainer" && side != "inference") flags.Fail("--side must be trainer or inference");
  if (scale_down < 1) flags.Fail("--scale-down must be >= 1");
  auto text = ReadFile(config_path);
  if (!text.ok()) flags.Fail(std::string(text.status().message()));
  auto parsed = ParseModelConfig(*text);
  if (!parsed.ok()) flags.Fail(absl::StrCat(config_path, ": ", parsed.status().message()));
  const ModelConfig model = ScaleDown(*parsed, scale_down, layers);
  DType dtype = model.dtype;
  if (!dtype_name.empty()) {
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
    layout = MakeTrainerLayout(model, p, where, dtype);
    title = fsdp > 0 ? absl::StrCat("trainer FSDP", fsdp)
                     : absl::StrCat("trainer TP", tp, " PP", pp, " EP", ep, " DP", dp, " CP", cp);
  } else {
    InferenceParallelism p{static_cast<int32_t>(tp), static_cast<int32_t>(dp), expert_parallel};
    layout = MakeInferenceLayout(model, p, where, dtype);
    title = absl::StrCat("inference TP", tp, " DP", dp, expert_parallel ? " EP" : "");
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
