#include "client/models/model_config.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace refit {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

absl::StatusOr<int64_t> Int(const Struct& s, const std::string& key, bool required,
                            int64_t fallback = 0) {
  auto it = s.fields().find(key);
  if (it == s.fields().end() || it->second.kind_case() == Value::kNullValue) {
    if (required) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: missing \"", key, "\""));
    }
    return fallback;
  }
  if (it->second.kind_case() != Value::kNumberValue) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: \"", key, "\" is not a number"));
  }
  const double v = it->second.number_value();
  if (v < 0 || v != static_cast<double>(static_cast<int64_t>(v))) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: \"", key, "\" must be a non-negative integer, not ", v));
  }
  return static_cast<int64_t>(v);
}

bool Bool(const Struct& s, const std::string& key, bool fallback) {
  auto it = s.fields().find(key);
  if (it == s.fields().end() || it->second.kind_case() != Value::kBoolValue) return fallback;
  return it->second.bool_value();
}

std::string String(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  if (it == s.fields().end() || it->second.kind_case() != Value::kStringValue) return "";
  return it->second.string_value();
}

// Whether `key` is in the config at all (null included): DeepSeek's configs say "q_lora_rank":
// null for "no q_lora", while a config without the key gets the config class's default.
bool Present(const Struct& s, const std::string& key) { return s.fields().contains(key); }

absl::Status RequireKeys(const Struct& s, const std::string& model_type,
                         std::initializer_list<const char*> keys, const char* why) {
  for (const char* key : keys) {
    if (!Present(s, key)) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: model_type \"", model_type,
                                                     "\" needs \"", key, "\" (", why, ")"));
    }
  }
  return absl::OkStatus();
}

// quantization_config: block fp8 as DeepSeek-V3 and vLLM ship it is read; every other scheme
// changes the engine's tensors (packed integers, per-tensor or static scales, power-of-two scales)
// in ways not modeled, and is refused by the field that says so.
absl::Status ParseQuantization(const Struct& qc, ModelConfig& c) {
  const std::string method = String(qc, "quant_method");
  if (method != "fp8") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: quantization_config.quant_method \"", method,
                     "\" is not supported (refit models block fp8: quant_method \"fp8\" with "
                     "weight_block_size)"));
  }
  if (const std::string fmt = String(qc, "fmt"); !fmt.empty() && fmt != "e4m3") {
    return absl::InvalidArgumentError(absl::StrCat("config.json: quantization_config.fmt \"", fmt,
                                                   "\" is not supported (fp8 engines hold e4m3)"));
  }
  if (const std::string scheme = String(qc, "activation_scheme");
      !scheme.empty() && scheme != "dynamic") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: quantization_config.activation_scheme \"", scheme,
        "\" is not supported (static activation scales are tensors refit does not model)"));
  }
  if (Present(qc, "scale_fmt") && qc.fields().at("scale_fmt").kind_case() != Value::kNullValue) {
    return absl::InvalidArgumentError(
        "config.json: quantization_config.scale_fmt is not supported (refit computes fp32 block "
        "scales "
        "amax / 448, not rounded to a scale format)");
  }
  c.fp8.present = true;
  auto b = qc.fields().find("weight_block_size");
  if (b == qc.fields().end()) {
    // Per-tensor fp8 has one scale per tensor: not what refit quantizes.
    return absl::InvalidArgumentError(
        "config.json: quantization_config (fp8) without weight_block_size is per-tensor fp8; refit "
        "quantizes "
        "block fp8 (weight_block_size) and MXFP8");
  }
  const auto& list = b->second.list_value().values();
  if (b->second.kind_case() != Value::kListValue || list.size() != 2 ||
      list[0].number_value() < 1 || list[1].number_value() < 1) {
    return absl::InvalidArgumentError(
        "config.json: quantization_config.weight_block_size must be [rows, cols] of positive "
        "integers");
  }
  c.fp8.block_rows = static_cast<int64_t>(list[0].number_value());
  c.fp8.block_cols = static_cast<int64_t>(list[1].number_value());
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    auto m = qc.fields().find(key);
    if (m == qc.fields().end() || m->second.kind_case() != Value::kListValue) continue;
    for (const Value& v : m->second.list_value().values()) {
      if (v.kind_case() == Value::kStringValue)
        c.fp8.modules_to_not_convert.push_back(v.string_value());
    }
  }
  return absl::OkStatus();
}

#define ASSIGN_INT(field, key, required, fallback) \
  do {                                             \
    auto v = Int(s, key, required, fallback);      \
    if (!v.ok()) return v.status();                \
    c.field = *v;                                  \
  } while (0)

// The steps of ParseModelConfig, in order: each reads its fields into `c`, or refuses them.

absl::StatusOr<Struct> ParseJsonObject(absl::string_view json) {
  Struct s;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &s);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json is not valid JSON: ", status.message().as_string()));
  }
  return s;
}

absl::Status ReadModelType(const Struct& s, ModelConfig& c) {
  c.model_type = String(s, "model_type");
  if (c.model_type.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: missing \"model_type\" (supported: ", kSupportedModelTypes, ")"));
  }
  if (!absl::StrContains(absl::StrCat(", ", kSupportedModelTypes, ","),
                         absl::StrCat(", ", c.model_type, ","))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: model_type \"", c.model_type,
        "\" is not supported: its tensors are not modeled faithfully here (supported: ",
        kSupportedModelTypes, ")"));
  }
  return absl::OkStatus();
}

absl::Status ReadDimensions(const Struct& s, ModelConfig& c) {
  ASSIGN_INT(hidden_size, "hidden_size", true, 0);
  ASSIGN_INT(num_attention_heads, "num_attention_heads", true, 0);
  ASSIGN_INT(num_key_value_heads, "num_key_value_heads", false, c.num_attention_heads);
  ASSIGN_INT(num_hidden_layers, "num_hidden_layers", true, 0);
  ASSIGN_INT(vocab_size, "vocab_size", true, 0);
  ASSIGN_INT(intermediate_size, "intermediate_size", false, 0);
  if (c.num_attention_heads == 0 || c.hidden_size == 0 || c.vocab_size == 0) {
    return absl::InvalidArgumentError(
        "config.json: hidden_size, num_attention_heads and vocab_size must be positive");
  }
  ASSIGN_INT(head_dim, "head_dim", false, c.hidden_size / c.num_attention_heads);
  c.tie_word_embeddings = Bool(s, "tie_word_embeddings", false);
  return absl::OkStatus();
}

// Qwen2's q/k/v projections always have biases (bias=True in modeling_qwen2.py, whatever the
// config says) and its o_proj never has one. Elsewhere attention_bias also gives o_proj (and, for
// DeepSeek, q_a_proj and kv_a_proj_with_mqa) a bias, which the generators do not model.
absl::Status ReadBiasesAndNorms(const Struct& s, ModelConfig& c) {
  const bool qwen2_family = c.model_type == "qwen2" || c.model_type == "qwen2_moe";
  if (qwen2_family) {
    c.attention_bias = Bool(s, "qkv_bias", true);
  } else if (Bool(s, "attention_bias", false)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: \"attention_bias\": true is not supported for model_type \"",
                     c.model_type, "\" (its o_proj bias is not modeled)"));
  }
  if (Bool(s, "mlp_bias", false)) {
    return absl::InvalidArgumentError(
        "config.json: \"mlp_bias\": true is not supported (MLP biases are not modeled)");
  }
  c.qk_norm = c.model_type == "qwen3" || c.model_type == "qwen3_moe";
  return absl::OkStatus();
}

absl::Status ReadDType(const Struct& s, ModelConfig& c) {
  const std::string dtype = String(s, "torch_dtype");
  if (dtype.empty()) return absl::OkStatus();
  auto d = ParseDType(dtype);
  if (!d.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: torch_dtype: ", d.status().message()));
  }
  c.dtype = *d;
  return absl::OkStatus();
}

absl::Status ReadQuantizationConfig(const Struct& s, ModelConfig& c) {
  auto q = s.fields().find("quantization_config");
  if (q == s.fields().end() || q->second.kind_case() == Value::kNullValue) {
    return absl::OkStatus();
  }
  if (q->second.kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError("config.json: \"quantization_config\" is not an object");
  }
  return ParseQuantization(q->second.struct_value(), c);
}

// The fields that decide a mixture-of-experts family's tensors, which its config classes default
// differently (transformers' DeepseekV3Config has 256 experts and q_lora_rank 1536 by default,
// DeepSeek's remote code no experts): a config that leaves them out is refused, not guessed.
absl::Status RequireDeepSeekFields(const Struct& s, ModelConfig& c) {
  if (!c.DeepSeekStyle()) return absl::OkStatus();
  if (auto st = RequireKeys(s, c.model_type,
                            {"n_routed_experts", "n_shared_experts", "first_k_dense_replace",
                             "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
                             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "topk_method"},
                            "DeepSeek's config classes default it differently");
      !st.ok()) {
    return st;
  }
  // transformers' DeepseekV3TopkRouter always holds gate.e_score_correction_bias, DeepSeek's
  // remote code only with noaux_tc; DeepSeek-V2's router never has one.
  const std::string method = String(s, "topk_method");
  const bool v2 = c.model_type == "deepseek_v2";
  if (v2 ? (method != "greedy" && method != "group_limited_greedy") : method != "noaux_tc") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: \"topk_method\": \"", method, "\" is not supported for model_type \"",
        c.model_type, "\" (", v2 ? "greedy or group_limited_greedy" : "noaux_tc",
        "; other routers hold other tensors in transformers than in DeepSeek's code)"));
  }
  return absl::OkStatus();
}

// Mixtral: every layer is MoE, each expert as wide as intermediate_size.
absl::Status ReadMixtralExperts(const Struct& s, ModelConfig& c) {
  if (!c.MixtralStyle()) return absl::OkStatus();
  if (auto st = RequireKeys(s, c.model_type, {"num_local_experts", "intermediate_size"},
                            "each expert's width");
      !st.ok()) {
    return st;
  }
  ASSIGN_INT(num_experts, "num_local_experts", true, 0);
  c.moe_intermediate_size = c.intermediate_size;
  if (c.num_experts == 0) {
    return absl::InvalidArgumentError("config.json: \"num_local_experts\" must be positive");
  }
  return absl::OkStatus();
}

absl::Status RequireQwenMoeFields(const Struct& s, ModelConfig& c) {
  if (c.model_type == "qwen2_moe" || c.model_type == "qwen3_moe") {
    if (auto st = RequireKeys(s, c.model_type, {"num_experts"}, "its config class defaults it");
        !st.ok()) {
      return st;
    }
  }
  if (c.model_type == "qwen2_moe") {
    return RequireKeys(s, c.model_type, {"shared_expert_intermediate_size"},
                       "its config class defaults it");
  }
  return absl::OkStatus();
}

// The experts of every family but Mixtral's, and which layers hold them.
absl::Status ReadExperts(const Struct& s, ModelConfig& c) {
  if (!c.MixtralStyle()) {
    ASSIGN_INT(num_experts, "n_routed_experts", false, 0);
    if (c.num_experts == 0) ASSIGN_INT(num_experts, "num_experts", false, 0);
    ASSIGN_INT(moe_intermediate_size, "moe_intermediate_size", false, 0);
  }
  ASSIGN_INT(n_shared_experts, "n_shared_experts", false, 0);
  ASSIGN_INT(shared_expert_intermediate_size, "shared_expert_intermediate_size", false, 0);
  ASSIGN_INT(first_k_dense_replace, "first_k_dense_replace", false, 0);
  ASSIGN_INT(moe_layer_freq, "moe_layer_freq", false, 1);
  if (c.DeepSeekStyle() && c.moe_layer_freq != 1) {
    // transformers' DeepseekV3DecoderLayer ignores moe_layer_freq; vLLM's honors it.
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: \"moe_layer_freq\": ", c.moe_layer_freq,
                     " is not supported (transformers and vLLM disagree on which layers are MoE)"));
  }
  return absl::OkStatus();
}

// Qwen-MoE: sparse every decoder_sparse_step layers, except mlp_only_layers.
absl::Status ReadQwenMoeLayers(const Struct& s, ModelConfig& c) {
  if (c.model_type != "qwen2_moe" && c.model_type != "qwen3_moe") return absl::OkStatus();
  ASSIGN_INT(decoder_sparse_step, "decoder_sparse_step", false, 1);
  if (c.decoder_sparse_step == 0) {
    return absl::InvalidArgumentError("config.json: \"decoder_sparse_step\" must be positive");
  }
  auto it = s.fields().find("mlp_only_layers");
  if (it == s.fields().end() || it->second.kind_case() != Value::kListValue) {
    return absl::OkStatus();
  }
  for (const Value& v : it->second.list_value().values()) {
    if (v.kind_case() != Value::kNumberValue || v.number_value() < 0 ||
        v.number_value() != static_cast<double>(static_cast<int64_t>(v.number_value()))) {
      return absl::InvalidArgumentError(
          "config.json: \"mlp_only_layers\" must list non-negative integers");
    }
    c.mlp_only_layers.push_back(static_cast<int64_t>(v.number_value()));
  }
  return absl::OkStatus();
}

absl::Status ReadRouterBias(const Struct& s, ModelConfig& c) {
  c.router_bias = String(s, "topk_method") == "noaux_tc";
  c.router_bias_is_buffer = c.model_type == "deepseek_v3";
  return absl::OkStatus();
}

absl::Status ReadLatentAttention(const Struct& s, ModelConfig& c) {
  ASSIGN_INT(q_lora_rank, "q_lora_rank", false, 0);
  ASSIGN_INT(kv_lora_rank, "kv_lora_rank", false, 0);
  ASSIGN_INT(qk_nope_head_dim, "qk_nope_head_dim", false, 0);
  ASSIGN_INT(qk_rope_head_dim, "qk_rope_head_dim", false, 0);
  ASSIGN_INT(v_head_dim, "v_head_dim", false, 0);
  return absl::OkStatus();
}

// What the fields read say together: the widths every layer needs, heads that group evenly.
absl::Status CheckConsistent(const Struct&, ModelConfig& c) {
  if (c.num_experts > 0 && c.moe_intermediate_size == 0) {
    return absl::InvalidArgumentError(
        "config.json: a mixture-of-experts model needs \"moe_intermediate_size\"");
  }
  bool any_dense = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) any_dense |= !c.IsMoeLayer(l);
  if (any_dense && c.intermediate_size == 0) {
    return absl::InvalidArgumentError("config.json: missing \"intermediate_size\"");
  }
  if (c.num_key_value_heads == 0 || c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: num_attention_heads (", c.num_attention_heads,
                     ") must be a multiple of num_key_value_heads (", c.num_key_value_heads, ")"));
  }
  if (c.kv_lora_rank > 0 && (c.qk_rope_head_dim == 0 || c.v_head_dim == 0)) {
    return absl::InvalidArgumentError(
        "config.json: latent attention (kv_lora_rank) needs qk_rope_head_dim and v_head_dim");
  }
  return absl::OkStatus();
}

using ParseStep = absl::Status (*)(const Struct&, ModelConfig&);

// In this order: a config wrong in several ways is refused for the first.
constexpr ParseStep kParseSteps[] = {
    ReadModelType,      ReadDimensions,         ReadBiasesAndNorms,
    ReadDType,          ReadQuantizationConfig, RequireDeepSeekFields,
    ReadMixtralExperts, RequireQwenMoeFields,   ReadExperts,
    ReadQwenMoeLayers,  ReadRouterBias,         ReadLatentAttention,
    CheckConsistent,
};

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json) {
  absl::StatusOr<Struct> s = ParseJsonObject(json);
  if (!s.ok()) return s.status();
  ModelConfig c;
  for (ParseStep step : kParseSteps) {
    if (absl::Status st = step(*s, c); !st.ok()) return st;
  }
  return c;
}

ModelConfig ScaleDown(const ModelConfig& config, int64_t factor, int64_t max_layers) {
  ModelConfig c = config;
  auto shrink = [&](int64_t& v) {
    if (v > 0) v = std::max<int64_t>(1, v / factor);
  };
  if (factor > 1) {
    shrink(c.hidden_size);
    shrink(c.head_dim);
    shrink(c.intermediate_size);
    shrink(c.moe_intermediate_size);
    shrink(c.shared_expert_intermediate_size);
    shrink(c.vocab_size);
    shrink(c.q_lora_rank);
    shrink(c.kv_lora_rank);
    shrink(c.qk_nope_head_dim);
    shrink(c.qk_rope_head_dim);
    shrink(c.v_head_dim);
  }
  if (max_layers > 0) c.num_hidden_layers = std::min(c.num_hidden_layers, max_layers);
  c.first_k_dense_replace = std::min(c.first_k_dense_replace, c.num_hidden_layers);
  return c;
}

}  // namespace refit
