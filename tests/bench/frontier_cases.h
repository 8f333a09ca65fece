// The frontier configurations the benchmarks plan and install (docs/BENCHMARKS.md, "Planning at
// frontier scale"): one list, so that every benchmark measures the same shapes.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "client/models/layout_generator.h"

namespace refit {

struct FrontierCase {
  std::string name, config;  // config: a file of tests/configs
  TrainerParallelism trainer;
  InferenceParallelism inference;
};

// DeepSeek-V3 TP1·PP8·EP16 -> TP16·DP8 (128 -> 128 GPUs), Kimi-K2 256 -> 128, Qwen3-235B 128 -> 64,
// and M2N's DeepSeek-V3 case.
inline std::vector<FrontierCase> FrontierCases() {
  return {
      {"deepseek-v3", "deepseek-v3.json", {1, 8, 16, 16, 1, 0}, {16, 8, false}},
      {"kimi-k2", "kimi-k2.json", {2, 8, 16, 16, 1, 0}, {16, 8, false}},
      {"qwen3-235b", "qwen3-235b-a22b.json", {2, 4, 16, 8, 2, 0}, {8, 8, false}},
      // NCCL M2N's headline case: DeepSeek-V3, 128 trainer GPUs EP16 / DP2 (of experts) / PP4 ->
      // 128 engine GPUs TP8 / DP16, a full model per engine replica; on GB200 NVL72 domains
      // (plan_benchmark --gpus-per-node 64 --nvlink-gbps 900: docs/BENCHMARKS.md).
      {"deepseek-v3-m2n", "deepseek-v3.json", {1, 4, 16, 32, 1, 0}, {8, 16, false}},
  };
}

inline double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace refit
