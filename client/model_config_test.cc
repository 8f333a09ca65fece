#include "client/model_config.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
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
  CHECK(std::string(ParseModelConfig(R"({"model_type": "llama", "hidden_size": 8})").status().message())
            .find("\"num_attention_heads\"") != std::string::npos);
  CHECK(std::string(ParseModelConfig(R"({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 1.5})").status().message())
            .find("intermediate_size") != std::string::npos);
  CHECK(std::string(ParseModelConfig(R"({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 4,
      "num_key_value_heads": 3, "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 4})")
                        .status().message())
            .find("multiple of num_key_value_heads") != std::string::npos);
  CHECK(std::string(ParseModelConfig(R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "num_experts": 4})").status().message())
            .find("moe_intermediate_size") != std::string::npos);
}

const char* kLlamaFields = R"("hidden_size": 8, "num_attention_heads": 4, "num_hidden_layers": 2,
    "vocab_size": 10, "intermediate_size": 4)";

std::string Message(const std::string& json) {
  auto c = ParseModelConfig(json);
  REQUIRE_FALSE(c.ok());
  return std::string(c.status().message());
}

TEST_CASE("model types not modeled faithfully are refused by name, listing the supported ones") {
  for (const char* type : {"gpt_oss", "gemma2", "gemma3", "mixtral", "phi3", "llama4"}) {
    SECTION(type) {
      const std::string m =
          Message(absl::StrCat(R"({"model_type": ")", type, R"(", )", kLlamaFields, "}"));
      CHECK(m.find(absl::StrCat("model_type \"", type, "\" is not supported")) != std::string::npos);
      CHECK(m.find(kSupportedModelTypes) != std::string::npos);
    }
  }
  CHECK(Message(absl::StrCat("{", kLlamaFields, "}")).find("missing \"model_type\"") != std::string::npos);
  // Every supported type parses.
  for (const char* type : {"llama", "qwen2", "qwen3"}) {
    CHECK(ParseModelConfig(absl::StrCat(R"({"model_type": ")", type, R"(", )", kLlamaFields, "}")).ok());
  }
}

TEST_CASE("settings of a supported type that are not modeled are refused") {
  CHECK(Message(absl::StrCat(R"({"model_type": "llama", "attention_bias": true, )", kLlamaFields, "}"))
            .find("\"attention_bias\": true is not supported for model_type \"llama\"") != std::string::npos);
  CHECK(Message(absl::StrCat(R"({"model_type": "qwen3", "attention_bias": true, )", kLlamaFields, "}"))
            .find("attention_bias") != std::string::npos);
  CHECK(Message(absl::StrCat(R"({"model_type": "llama", "mlp_bias": true, )", kLlamaFields, "}"))
            .find("mlp_bias") != std::string::npos);
  CHECK(Message(absl::StrCat(R"({"model_type": "deepseek_v3", "moe_layer_freq": 2, "n_routed_experts": 4,
      "moe_intermediate_size": 2, )", kLlamaFields, "}"))
            .find("moe_layer_freq") != std::string::npos);
}

TEST_CASE("Qwen2 always has q/k/v biases and no o_proj bias, whatever attention_bias says") {
  auto c = ParseModelConfig(absl::StrCat(R"({"model_type": "qwen2", "attention_bias": false, )", kLlamaFields, "}"));
  REQUIRE(c.ok());
  CHECK(c->attention_bias);
  bool q_bias = false, o_bias = false;
  for (const TensorDef& t : ModelTensors(*c)) {
    q_bias |= t.name == "model.layers.0.self_attn.q_proj.bias";
    o_bias |= t.name == "model.layers.0.self_attn.o_proj.bias";
  }
  CHECK(q_bias);
  CHECK_FALSE(o_bias);
}

TEST_CASE("Qwen-MoE layers: decoder_sparse_step and mlp_only_layers decide which are sparse") {
  auto c = ParseModelConfig(R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 6, "vocab_size": 10, "intermediate_size": 4, "num_experts": 4,
      "moe_intermediate_size": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]})");
  INFO(c.status().message());
  REQUIRE(c.ok());
  // (l + 1) % 2 == 0 and l not in [3]: layers 1 and 5.
  for (int64_t l = 0; l < 6; ++l) CHECK(c->IsMoeLayer(l) == (l == 1 || l == 5));
  // All-sparse without intermediate_size is fine; a dense layer needs it.
  CHECK(ParseModelConfig(R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "num_experts": 4, "moe_intermediate_size": 2})").ok());
  CHECK(Message(R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "num_experts": 4, "moe_intermediate_size": 2,
      "mlp_only_layers": [1]})").find("intermediate_size") != std::string::npos);
}

TEST_CASE("DeepSeek-V3's router bias is a module buffer; Kimi-K2's (remote code) a parameter") {
  const ModelConfig v3 = Load("deepseek-v3.json");
  const ModelConfig k2 = Load("kimi-k2.json");
  CHECK(v3.router_bias_is_buffer);
  CHECK_FALSE(k2.router_bias_is_buffer);
  for (const TensorDef& t : ModelTensors(v3)) {
    CHECK(t.buffer == (t.name.find("e_score_correction_bias") != std::string::npos));
  }
  for (const TensorDef& t : ModelTensors(k2)) CHECK_FALSE(t.buffer);
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
