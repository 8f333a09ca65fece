#include "client/model_config.h"

#include <catch2/catch.hpp>

#include "client/model_tensors.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

ModelConfig Load(const std::string& name) {
  auto text = ReadFile("tests/configs/" + name);
  REQUIRE(text.ok());
  auto c = ParseModelConfig(*text);
  INFO(c.status().message());
  REQUIRE(c.ok());
  return *c;
}

TEST_CASE("real configs give the published parameter counts") {
  CHECK(CountParameters(Load("llama3-8b.json")) == 8030261248);
  CHECK(CountParameters(Load("qwen2.5-7b.json")) == 7615616512);
  CHECK(CountParameters(Load("qwen3-30b-a3b.json")) == 30532122624);
  // DeepSeek-V3: 671 B without the multi-token-prediction layer, which serving does not load.
  const int64_t v3 = CountParameters(Load("deepseek-v3.json"));
  CHECK(v3 > 670e9);
  CHECK(v3 < 672e9);
  const int64_t k2 = CountParameters(Load("kimi-k2.json"));
  CHECK(k2 > 1.02e12);
  CHECK(k2 < 1.04e12);
}

TEST_CASE("the fields decide the tensors") {
  const ModelConfig v3 = Load("deepseek-v3.json");
  CHECK(v3.num_experts == 256);
  CHECK(v3.IsMoeLayer(3));
  CHECK_FALSE(v3.IsMoeLayer(2));
  CHECK(v3.router_bias);
  const auto tensors = ModelTensors(v3);
  bool has_latent = false, has_shared = false;
  for (const TensorDef& t : tensors) {
    has_latent |= t.name == "model.layers.5.self_attn.kv_b_proj.weight";
    has_shared |= t.name == "model.layers.5.mlp.shared_experts.down_proj.weight";
  }
  CHECK(has_latent);
  CHECK(has_shared);
  const ModelConfig q = Load("qwen2.5-7b.json");
  CHECK(q.attention_bias);
  CHECK(Load("qwen3-30b-a3b.json").qk_norm);
}

TEST_CASE("bad configs name the field") {
  CHECK(std::string(ParseModelConfig("{").status().message()).find("not valid JSON") != std::string::npos);
  CHECK(std::string(ParseModelConfig(R"({"hidden_size": 8})").status().message())
            .find("\"num_attention_heads\"") != std::string::npos);
  CHECK(std::string(ParseModelConfig(R"({"hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 1.5})").status().message())
            .find("intermediate_size") != std::string::npos);
  CHECK(std::string(ParseModelConfig(R"({"hidden_size": 8, "num_attention_heads": 4,
      "num_key_value_heads": 3, "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 4})")
                        .status().message())
            .find("multiple of num_key_value_heads") != std::string::npos);
  CHECK(std::string(ParseModelConfig(R"({"hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "num_experts": 4})").status().message())
            .find("moe_intermediate_size") != std::string::npos);
}

TEST_CASE("scaling down keeps the structure") {
  const ModelConfig small = ScaleDown(Load("qwen3-30b-a3b.json"), 16, 4);
  CHECK(small.hidden_size == 128);
  CHECK(small.num_experts == 128);
  CHECK(small.num_attention_heads == 32);
  CHECK(small.num_hidden_layers == 4);
  CHECK(small.head_dim == 8);
}

}  // namespace
}  // namespace refit
