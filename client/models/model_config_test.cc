#include "client/models/model_config.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "client/models/model_tensors.h"
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
  // Published: DeepSeek-V2 236 B, DeepSeek-V2-Lite 15.7 B, Mixtral-8x7B 46.7 B (46,702,792,704).
  const int64_t v2 = CountParameters(Load("deepseek-v2.json"));
  CHECK(v2 > 235.5e9);
  CHECK(v2 < 236.5e9);
  const int64_t lite = CountParameters(Load("deepseek-v2-lite.json"));
  CHECK(lite > 15.65e9);
  CHECK(lite < 15.75e9);
  CHECK(CountParameters(Load("mixtral-8x7b.json")) == 46702792704);
  // The shipped (fp8) DeepSeek-V3 config has the same architecture.
  CHECK(CountParameters(Load("deepseek-v3-fp8.json")) == v3);
}

// The names of a model's tensors in layer `layer`, without the "model.layers.<layer>." prefix.
std::vector<std::string> LayerTensors(const ModelConfig& c, int64_t layer) {
  const std::string prefix = absl::StrCat("model.layers.", layer, ".");
  std::vector<std::string> out;
  for (const TensorDef& t : ModelTensors(c)) {
    if (t.name.rfind(prefix, 0) == 0) out.push_back(t.name.substr(prefix.size()));
  }
  return out;
}

const TensorDef& Find(const std::vector<TensorDef>& tensors, const std::string& name) {
  for (const TensorDef& t : tensors) {
    if (t.name == name) return t;
  }
  FAIL("no tensor " << name);
  return tensors.front();
}

TEST_CASE(
    "DeepSeek-V3 (fp8 as shipped): MLA with q_lora, 3 dense layers, 256 experts, a shared one") {
  const ModelConfig c = Load("deepseek-v3-fp8.json");
  CHECK(c.fp8.present);
  CHECK(c.fp8.block_rows == 128);
  CHECK(c.fp8.block_cols == 128);
  const auto tensors = ModelTensors(c);
  // embed, norm, lm_head; per layer 7 MLA + 2 norms; dense layers 3, MoE layers 256 * 3 + gate +
  // bias + 3 shared.
  CHECK(tensors.size() == 3 + 61 * 9 + 3 * 3 + 58 * (256 * 3 + 2 + 3));
  CHECK(Find(tensors, "model.layers.0.self_attn.q_a_proj.weight").shape == Dims{1536, 7168});
  CHECK(Find(tensors, "model.layers.0.self_attn.q_b_proj.weight").shape == Dims{128 * 192, 1536});
  CHECK(Find(tensors, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight").shape ==
        Dims{576, 7168});
  CHECK(Find(tensors, "model.layers.0.self_attn.kv_b_proj.weight").shape == Dims{128 * 256, 512});
  CHECK(Find(tensors, "model.layers.0.self_attn.o_proj.weight").shape == Dims{7168, 128 * 128});
  CHECK(Find(tensors, "model.layers.2.mlp.gate_proj.weight").shape == Dims{18432, 7168});
  CHECK(Find(tensors, "model.layers.3.mlp.experts.255.down_proj.weight").shape == Dims{7168, 2048});
  CHECK(Find(tensors, "model.layers.3.mlp.gate.e_score_correction_bias").shape == Dims{256});
  CHECK(Find(tensors, "model.layers.3.mlp.shared_experts.up_proj.weight").shape ==
        Dims{2048, 7168});
}

TEST_CASE("DeepSeek-V2-Lite: q_proj (no q_lora), greedy router without a bias, 2 shared experts") {
  const ModelConfig c = Load("deepseek-v2-lite.json");
  CHECK(c.model_type == "deepseek_v2");
  CHECK(c.q_lora_rank == 0);
  CHECK_FALSE(c.router_bias);
  CHECK_FALSE(c.fp8.present);
  const auto tensors = ModelTensors(c);
  // Per layer q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj and 2 norms.
  CHECK(tensors.size() == 3 + 27 * 7 + 1 * 3 + 26 * (64 * 3 + 1 + 3));
  CHECK(Find(tensors, "model.layers.0.self_attn.q_proj.weight").shape == Dims{16 * 192, 2048});
  CHECK(Find(tensors, "model.layers.0.mlp.down_proj.weight").shape == Dims{2048, 10944});
  CHECK(Find(tensors, "model.layers.1.mlp.shared_experts.gate_proj.weight").shape ==
        Dims{2 * 1408, 2048});
  const std::vector<std::string> layer1 = LayerTensors(c, 1);
  // DeepseekV2Moe registers experts, then gate, then shared_experts.
  CHECK(layer1[5] == "mlp.experts.0.gate_proj.weight");
  CHECK(layer1[5 + 64 * 3] == "mlp.gate.weight");
  CHECK(layer1[5 + 64 * 3 + 1] == "mlp.shared_experts.gate_proj.weight");
  for (const std::string& n : layer1) CHECK(n.find("q_a_proj") == std::string::npos);
  CHECK(Load("deepseek-v2.json").q_lora_rank == 1536);
}

TEST_CASE("Mixtral: block_sparse_moe, router first, experts' w1 w2 w3 in registration order") {
  const ModelConfig c = Load("mixtral-8x7b.json");
  CHECK(c.num_experts == 8);
  CHECK(c.moe_intermediate_size == 14336);
  const auto tensors = ModelTensors(c);
  CHECK(tensors.size() == 3 + 32 * (4 + 2 + 1 + 8 * 3));
  const std::vector<std::string> layer0 = LayerTensors(c, 0);
  const std::vector<std::string> want = {"self_attn.q_proj.weight",
                                         "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight",
                                         "self_attn.o_proj.weight",
                                         "block_sparse_moe.gate.weight",
                                         "block_sparse_moe.experts.0.w1.weight",
                                         "block_sparse_moe.experts.0.w2.weight",
                                         "block_sparse_moe.experts.0.w3.weight"};
  REQUIRE(layer0.size() == 4 + 1 + 8 * 3 + 2);
  CHECK(std::vector<std::string>(layer0.begin(), layer0.begin() + 8) == want);
  const TensorDef& w1 = Find(tensors, "model.layers.0.block_sparse_moe.experts.3.w1.weight");
  CHECK(w1.shape == Dims{14336, 4096});
  CHECK(w1.role == Role::kGate);
  CHECK(w1.expert == 3);
  CHECK(Find(tensors, "model.layers.0.block_sparse_moe.experts.3.w2.weight").role == Role::kDown);
  CHECK(Find(tensors, "model.layers.0.block_sparse_moe.experts.3.w3.weight").role == Role::kUp);
  CHECK(Find(tensors, "model.layers.0.self_attn.k_proj.weight").shape == Dims{8 * 128, 4096});
}

TEST_CASE("Kimi-K2's values under model_type deepseek_v3 parse as DeepSeek-V3") {
  auto text = ReadFile("tests/configs/kimi-k2.json");
  REQUIRE(text.ok());
  std::string json = *text;
  json.replace(json.find("\"kimi_k2\""), 9, "\"deepseek_v3\"");
  auto c = ParseModelConfig(json);
  INFO(c.status().message());
  REQUIRE(c.ok());
  CHECK(c->num_experts == 384);
  CHECK(c->router_bias_is_buffer);  // transformers' DeepseekV3TopkRouter
  CHECK(CountParameters(*c) == CountParameters(Load("kimi-k2.json")));
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
  CHECK(std::string(ParseModelConfig("{").status().message()).find("not valid JSON") !=
        std::string::npos);
  CHECK(std::string(
            ParseModelConfig(R"({"model_type": "llama", "hidden_size": 8})").status().message())
            .find("\"num_attention_heads\"") != std::string::npos);
  CHECK(std::string(
            ParseModelConfig(R"({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 1.5})")
                .status()
                .message())
            .find("intermediate_size") != std::string::npos);
  CHECK(std::string(
            ParseModelConfig(R"({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 4,
      "num_key_value_heads": 3, "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 4})")
                .status()
                .message())
            .find("multiple of num_key_value_heads") != std::string::npos);
  CHECK(std::string(ParseModelConfig(
                        R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "num_experts": 4})")
                        .status()
                        .message())
            .find("moe_intermediate_size") != std::string::npos);
}

const char* kLlamaFields = R"("hidden_size": 8, "num_attention_heads": 4, "num_hidden_layers": 2,
    "vocab_size": 10, "intermediate_size": 4)";
// A DeepSeek-style config's fields but topk_method (and model_type).
const char* kDeepSeekFields = R"("hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2,
    "vocab_size": 10, "intermediate_size": 4, "q_lora_rank": 4, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
    "qk_rope_head_dim": 2, "v_head_dim": 2, "n_routed_experts": 4, "moe_intermediate_size": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1)";

std::string Message(const std::string& json) {
  auto c = ParseModelConfig(json);
  REQUIRE_FALSE(c.ok());
  return std::string(c.status().message());
}

TEST_CASE("model types not modeled faithfully are refused by name, listing the supported ones") {
  for (const char* type :
       {"gpt_oss", "gemma2", "gemma3", "deepseek_v32", "phi3", "llama4", "mistral"}) {
    SECTION(type) {
      const std::string m =
          Message(absl::StrCat(R"({"model_type": ")", type, R"(", )", kLlamaFields, "}"));
      CHECK(m.find(absl::StrCat("model_type \"", type, "\" is not supported")) !=
            std::string::npos);
      CHECK(m.find(kSupportedModelTypes) != std::string::npos);
    }
  }
  CHECK(Message(absl::StrCat("{", kLlamaFields, "}")).find("missing \"model_type\"") !=
        std::string::npos);
  // Every supported type parses.
  for (const char* type : {"llama", "qwen2", "qwen3"}) {
    CHECK(ParseModelConfig(absl::StrCat(R"({"model_type": ")", type, R"(", )", kLlamaFields, "}"))
              .ok());
  }
}

TEST_CASE("settings of a supported type that are not modeled are refused") {
  CHECK(Message(
            absl::StrCat(R"({"model_type": "llama", "attention_bias": true, )", kLlamaFields, "}"))
            .find("\"attention_bias\": true is not supported for model_type \"llama\"") !=
        std::string::npos);
  CHECK(Message(
            absl::StrCat(R"({"model_type": "qwen3", "attention_bias": true, )", kLlamaFields, "}"))
            .find("attention_bias") != std::string::npos);
  CHECK(Message(absl::StrCat(R"({"model_type": "llama", "mlp_bias": true, )", kLlamaFields, "}"))
            .find("mlp_bias") != std::string::npos);
  CHECK(Message(
            absl::StrCat(
                R"({"model_type": "deepseek_v3", "moe_layer_freq": 2, "topk_method": "noaux_tc", )",
                kDeepSeekFields, "}"))
            .find("moe_layer_freq") != std::string::npos);
}

// A config of `model_type` from `fields` less the key `drop` ("" keeps them all).
std::string Without(const std::string& model_type, const std::string& fields,
                    const std::string& drop) {
  std::string json = absl::StrCat(R"({"model_type": ")", model_type, R"(", )", fields, "}");
  if (drop.empty()) return json;
  const size_t at = json.find(absl::StrCat("\"", drop, "\":"));
  REQUIRE(at != std::string::npos);
  const size_t comma = json.find(',', at);
  if (comma != std::string::npos) return json.erase(at, comma + 1 - at);
  const size_t before = json.rfind(',', at);  // the last field: drop it with the comma before it
  return json.erase(before, json.rfind('}') - before);
}

TEST_CASE(
    "a MoE family's config without a field that decides its tensors is refused by that field") {
  const std::string deepseek = absl::StrCat(kDeepSeekFields, R"(, "topk_method": "noaux_tc")");
  REQUIRE(ParseModelConfig(Without("deepseek_v3", deepseek, "")).ok());
  for (const char* field : {"n_routed_experts", "n_shared_experts", "first_k_dense_replace",
                            "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
                            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "topk_method"}) {
    for (const char* type : {"deepseek_v3", "kimi_k2"}) {
      SECTION(absl::StrCat(type, " without ", field)) {
        const std::string m = Message(Without(type, deepseek, field));
        CHECK(m.find(absl::StrCat("needs \"", field, "\"")) != std::string::npos);
      }
    }
  }
  // The router decides whether gate.e_score_correction_bias exists.
  const std::string v2 = absl::StrCat(kDeepSeekFields, R"(, "topk_method": "greedy")");
  REQUIRE(ParseModelConfig(Without("deepseek_v2", v2, "")).ok());
  CHECK(Message(Without("deepseek_v2", deepseek, "")).find("\"topk_method\": \"noaux_tc\"") !=
        std::string::npos);
  CHECK(Message(Without("deepseek_v3", v2, "")).find("\"topk_method\": \"greedy\"") !=
        std::string::npos);
  // "q_lora_rank": null is DeepSeek-V2-Lite's "no q_lora"; leaving the key out is not.
  std::string null_q = Without("deepseek_v2", v2, "");
  null_q.replace(null_q.find("\"q_lora_rank\": 4"), 16, "\"q_lora_rank\": null");
  auto lite = ParseModelConfig(null_q);
  INFO(lite.status().message());
  REQUIRE(lite.ok());
  CHECK(lite->q_lora_rank == 0);

  const std::string mixtral =
      R"("hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
      "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 6, "num_local_experts": 4)";
  REQUIRE(ParseModelConfig(Without("mixtral", mixtral, "")).ok());
  CHECK(Message(Without("mixtral", mixtral, "num_local_experts"))
            .find("needs \"num_local_experts\"") != std::string::npos);
  CHECK(Message(Without("mixtral", mixtral, "intermediate_size"))
            .find("needs \"intermediate_size\"") != std::string::npos);
  const std::string qwen = R"("hidden_size": 8, "num_attention_heads": 4, "num_hidden_layers": 2,
      "vocab_size": 10, "moe_intermediate_size": 2, "num_experts": 4)";
  REQUIRE(ParseModelConfig(Without("qwen3_moe", qwen, "")).ok());
  CHECK(Message(Without("qwen3_moe", qwen, "num_experts")).find("needs \"num_experts\"") !=
        std::string::npos);
  CHECK(Message(Without("qwen2_moe", qwen, "")).find("needs \"shared_expert_intermediate_size\"") !=
        std::string::npos);
}

TEST_CASE("quantization_config: block fp8 is read; other schemes are refused by their field") {
  const std::string base =
      absl::StrCat(R"({"model_type": "llama", )", kLlamaFields, R"(, "quantization_config": )");
  auto fp8 = ParseModelConfig(
      base + R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [128, 64]}})");
  INFO(fp8.status().message());
  REQUIRE(fp8.ok());
  CHECK(fp8->fp8.present);
  CHECK(fp8->fp8.block_cols == 64);
  CHECK(Message(base + R"({"quant_method": "awq", "bits": 4}})")
            .find("quantization_config.quant_method \"awq\"") != std::string::npos);
  CHECK(
      Message(base + R"({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}})")
          .find("quantization_config.fmt \"e5m2\"") != std::string::npos);
  CHECK(
      Message(
          base +
          R"({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}})")
          .find("quantization_config.activation_scheme") != std::string::npos);
  CHECK(
      Message(base +
              R"({"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}})")
          .find("quantization_config.scale_fmt") != std::string::npos);
  CHECK(Message(base + R"({"quant_method": "fp8"}})").find("weight_block_size") !=
        std::string::npos);
  CHECK(ParseModelConfig(base + "null}").ok());
}

TEST_CASE("Qwen2 always has q/k/v biases and no o_proj bias, whatever attention_bias says") {
  auto c = ParseModelConfig(
      absl::StrCat(R"({"model_type": "qwen2", "attention_bias": false, )", kLlamaFields, "}"));
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
  auto c =
      ParseModelConfig(R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 6, "vocab_size": 10, "intermediate_size": 4, "num_experts": 4,
      "moe_intermediate_size": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]})");
  INFO(c.status().message());
  REQUIRE(c.ok());
  // (l + 1) % 2 == 0 and l not in [3]: layers 1 and 5.
  for (int64_t l = 0; l < 6; ++l) CHECK(c->IsMoeLayer(l) == (l == 1 || l == 5));
  // All-sparse without intermediate_size is fine; a dense layer needs it.
  CHECK(ParseModelConfig(R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "num_experts": 4, "moe_intermediate_size": 2})")
            .ok());
  CHECK(Message(R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "num_experts": 4, "moe_intermediate_size": 2,
      "mlp_only_layers": [1]})")
            .find("intermediate_size") != std::string::npos);
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
