#include "client/model_config.h"

#include <algorithm>

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

#define ASSIGN_INT(field, key, required, fallback)                 \
  do {                                                             \
    auto v = Int(s, key, required, fallback);                      \
    if (!v.ok()) return v.status();                                \
    c.field = *v;                                                  \
  } while (0)

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json) {
  Struct s;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &s);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json is not valid JSON: ", status.message().as_string()));
  }
  ModelConfig c;
  c.model_type = String(s, "model_type");
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
  c.attention_bias = Bool(s, "attention_bias", c.model_type == "qwen2" || c.model_type == "qwen2_moe");
  c.qk_norm = c.model_type == "qwen3" || c.model_type == "qwen3_moe";
  if (const std::string dtype = String(s, "torch_dtype"); !dtype.empty()) {
    auto d = ParseDType(dtype);
    if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("config.json: torch_dtype: ", d.status().message()));
    c.dtype = *d;
  }
  ASSIGN_INT(num_experts, "n_routed_experts", false, 0);
  if (c.num_experts == 0) ASSIGN_INT(num_experts, "num_experts", false, 0);
  ASSIGN_INT(moe_intermediate_size, "moe_intermediate_size", false, 0);
  ASSIGN_INT(n_shared_experts, "n_shared_experts", false, 0);
  ASSIGN_INT(shared_expert_intermediate_size, "shared_expert_intermediate_size", false, 0);
  ASSIGN_INT(first_k_dense_replace, "first_k_dense_replace", false, 0);
  ASSIGN_INT(moe_layer_freq, "moe_layer_freq", false, 1);
  c.router_bias = String(s, "topk_method") == "noaux_tc";
  ASSIGN_INT(q_lora_rank, "q_lora_rank", false, 0);
  ASSIGN_INT(kv_lora_rank, "kv_lora_rank", false, 0);
  ASSIGN_INT(qk_nope_head_dim, "qk_nope_head_dim", false, 0);
  ASSIGN_INT(qk_rope_head_dim, "qk_rope_head_dim", false, 0);
  ASSIGN_INT(v_head_dim, "v_head_dim", false, 0);

  if (c.num_experts > 0 && c.moe_intermediate_size == 0) {
    return absl::InvalidArgumentError(
        "config.json: a mixture-of-experts model needs \"moe_intermediate_size\"");
  }
  const bool any_dense = c.num_experts == 0 || c.first_k_dense_replace > 0 || c.moe_layer_freq > 1;
  if (any_dense && c.intermediate_size == 0) {
    return absl::InvalidArgumentError("config.json: missing \"intermediate_size\"");
  }
  if (c.num_key_value_heads == 0 || c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: num_attention_heads (", c.num_attention_heads,
        ") must be a multiple of num_key_value_heads (", c.num_key_value_heads, ")"));
  }
  if (c.kv_lora_rank > 0 && (c.qk_rope_head_dim == 0 || c.v_head_dim == 0)) {
    return absl::InvalidArgumentError(
        "config.json: latent attention (kv_lora_rank) needs qk_rope_head_dim and v_head_dim");
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
