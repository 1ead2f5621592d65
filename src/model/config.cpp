#include "moerl/model/config.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "file_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/json.hpp"

namespace moerl::model {
namespace {

using nlohmann::json;

// Fields this file reads; anything else is kept verbatim in extra_json.
// clang-format off
const std::set<std::string> kKnownFields = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "rms_norm_eps", "rope_theta", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "router_aux_loss_coef", "initializer_range", "torch_dtype",
    "dtype"};
// clang-format on

struct Reader {
    const json& j;
    const std::string& source;

    bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
    int get_int(const char* key, int fallback, bool required) const {
        if (!has(key)) {
            MOERL_CHECK(!required, source, ": missing required field ", key);
            return fallback;
        }
        const json& v = j.at(key);
        MOERL_CHECK(v.is_number_integer(), source, ": field ", key, " must be an integer, got ", v.dump());
        int64_t x = v.get<int64_t>();
        MOERL_CHECK(x >= INT32_MIN && x <= INT32_MAX, source, ": field ", key, " = ", x, " is out of range");
        return static_cast<int>(x);
    }
    double get_double(const char* key, double fallback) const {
        if (!has(key)) return fallback;
        const json& v = j.at(key);
        MOERL_CHECK(v.is_number(), source, ": field ", key, " must be a number, got ", v.dump());
        return v.get<double>();
    }
    bool get_bool(const char* key, bool fallback) const {
        if (!has(key)) return fallback;
        const json& v = j.at(key);
        MOERL_CHECK(v.is_boolean(), source, ": field ", key, " must be true or false, got ", v.dump());
        return v.get<bool>();
    }
};

}  // namespace

std::string layer_prefix(int layer) { return "model.layers." + std::to_string(layer) + "."; }

std::string expert_tensor_name(int layer, int expert, const char* proj) {
    return layer_prefix(layer) + "mlp.experts." + std::to_string(expert) + "." + proj + ".weight";
}

ModelConfig ModelConfig::from_json_text(const std::string& text, const std::string& source) {
    json j;
    try {
        j = parse_json(text, source);
    } catch (const json::exception& e) {
        MOERL_FAIL(source, ": not valid JSON (", e.what(), ")");
    }
    MOERL_CHECK(j.is_object(), source, ": expected a JSON object at the top level");
    Reader r{j, source};

    bool dense = false;  // Qwen3 (dense): the same layers with a dense MLP each, no experts
    if (r.has("model_type")) {
        const json& mt = j.at("model_type");
        dense = mt == "qwen3";
        MOERL_CHECK(mt == "qwen3_moe" || dense, source, ": model_type ", mt.dump(),
                    " is not supported, expected \"qwen3_moe\" or \"qwen3\"");
    }
    if (r.has("hidden_act")) {
        MOERL_CHECK(j.at("hidden_act") == "silu", source, ": hidden_act ", j.at("hidden_act").dump(),
                    " is not supported, expected \"silu\"");
    }
    MOERL_CHECK(!r.get_bool("attention_bias", false), source, ": attention_bias = true is not supported");
    MOERL_CHECK(!r.get_bool("use_sliding_window", false), source,
                ": use_sliding_window = true is not supported");
    MOERL_CHECK(!r.has("rope_scaling"), source, ": rope_scaling ", j.value("rope_scaling", json()).dump(),
                " is not supported, expected null");

    ModelConfig c;
    c.vocab_size = r.get_int("vocab_size", 0, true);
    c.hidden_size = r.get_int("hidden_size", 0, true);
    c.num_hidden_layers = r.get_int("num_hidden_layers", 0, true);
    c.num_attention_heads = r.get_int("num_attention_heads", 0, true);
    c.num_key_value_heads = r.get_int("num_key_value_heads", c.num_attention_heads, false);
    c.head_dim =
        r.get_int("head_dim", c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0, false);
    c.intermediate_size = r.get_int("intermediate_size", 0, false);
    c.num_experts = r.get_int("num_experts", 0, !dense);
    c.num_experts_per_tok = r.get_int("num_experts_per_tok", 0, c.num_experts > 0);
    c.moe_intermediate_size = r.get_int("moe_intermediate_size", 0, c.num_experts > 0);
    c.norm_topk_prob = r.get_bool("norm_topk_prob", false);
    c.decoder_sparse_step = r.get_int("decoder_sparse_step", 1, false);
    if (r.has("mlp_only_layers")) {
        const json& v = j.at("mlp_only_layers");
        MOERL_CHECK(v.is_array(), source, ": field mlp_only_layers must be a list of layer indices, got ",
                    v.dump());
        for (const json& e : v) {
            MOERL_CHECK(e.is_number_integer() && e.get<int64_t>() >= 0 && e.get<int64_t>() <= INT32_MAX,
                        source, ": mlp_only_layers must hold layer indices, got ", e.dump());
            c.mlp_only_layers.push_back(static_cast<int>(e.get<int64_t>()));
        }
    }
    c.rms_norm_eps = r.get_double("rms_norm_eps", 1e-6);
    c.rope_theta = r.get_double("rope_theta", 10000.0);
    if (r.has("rope_parameters")) {  // transformers 5 nests rope_theta here
        const json& rp = j.at("rope_parameters");
        MOERL_CHECK(rp.is_object(), source, ": field rope_parameters must be an object, got ", rp.dump());
        const json type_field = rp.value("rope_type", json("default"));
        MOERL_CHECK(type_field.is_string(), source, ": rope_parameters.rope_type must be a string, got ",
                    type_field.dump());
        const std::string type = type_field.get<std::string>();
        MOERL_CHECK(type == "default", source, ": rope_parameters.rope_type \"", type,
                    "\" is not supported, expected \"default\"");
        c.rope_theta = Reader{rp, source}.get_double("rope_theta", c.rope_theta);
    }
    c.max_position_embeddings = r.get_int("max_position_embeddings", 32768, false);
    c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
    c.router_aux_loss_coef = r.get_double("router_aux_loss_coef", 0.001);
    c.initializer_range = r.get_double("initializer_range", 0.02);
    for (const char* key : {"dtype", "torch_dtype"}) {  // transformers 5 writes "dtype"
        if (!r.has(key)) continue;
        MOERL_CHECK(j.at(key).is_string(), source, ": field ", key, " must be a string");
        c.torch_dtype = j.at(key).get<std::string>();
    }

    json extra = json::object();
    for (auto it = j.begin(); it != j.end(); ++it) {
        if (!kKnownFields.count(it.key())) extra[it.key()] = it.value();
    }
    c.extra_json = extra.dump();
    try {
        c.validate();
    } catch (const Error& e) {
        MOERL_FAIL(source, ": ", e.message());
    }
    return c;
}

ModelConfig ModelConfig::load(const std::string& path) {
    std::string file = path;
    if (std::filesystem::is_directory(path)) file = detail::join_path(path, "config.json");
    return from_json_text(detail::read_text_file(file), file);
}

std::string ModelConfig::to_json_text() const {
    json j = json::parse(extra_json.empty() ? "{}" : extra_json);
    if (!j.contains("architectures")) j["architectures"] = json::array({"Qwen3MoeForCausalLM"});
    if (!j.contains("model_type")) j["model_type"] = "qwen3_moe";
    if (!j.contains("hidden_act")) j["hidden_act"] = "silu";
    if (!j.contains("attention_bias")) j["attention_bias"] = false;
    if (!j.contains("rope_scaling")) j["rope_scaling"] = nullptr;
    j["vocab_size"] = vocab_size;
    j["hidden_size"] = hidden_size;
    j["num_hidden_layers"] = num_hidden_layers;
    j["num_attention_heads"] = num_attention_heads;
    j["num_key_value_heads"] = num_key_value_heads;
    j["head_dim"] = head_dim;
    j["intermediate_size"] = intermediate_size;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    j["rms_norm_eps"] = rms_norm_eps;
    j["rope_theta"] = rope_theta;
    j["max_position_embeddings"] = max_position_embeddings;
    j["tie_word_embeddings"] = tie_word_embeddings;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["initializer_range"] = initializer_range;
    j["torch_dtype"] = torch_dtype;
    j["dtype"] = torch_dtype;
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", rope_theta}};
    return j.dump(2) + "\n";
}

void ModelConfig::save(const std::string& dir) const {
    validate();
    std::filesystem::create_directories(dir);
    detail::write_file_atomic(detail::join_path(dir, "config.json"), to_json_text());
}

void ModelConfig::validate() const {
    auto positive = [](const char* name, double v) { MOERL_CHECK(v > 0, name, " (", v, ") must be > 0"); };
    positive("vocab_size", vocab_size);
    positive("hidden_size", hidden_size);
    positive("num_hidden_layers", num_hidden_layers);
    positive("num_attention_heads", num_attention_heads);
    positive("num_key_value_heads", num_key_value_heads);
    positive("head_dim", head_dim);
    positive("rms_norm_eps", rms_norm_eps);
    positive("rope_theta", rope_theta);
    positive("max_position_embeddings", max_position_embeddings);
    positive("decoder_sparse_step", decoder_sparse_step);
    // Far above any released model (~100 layers); bounds the per-layer loops below and in the model.
    constexpr int kMaxLayers = 4096;
    MOERL_CHECK(num_hidden_layers <= kMaxLayers, "num_hidden_layers (", num_hidden_layers,
                ") must be <= ", kMaxLayers);
    MOERL_CHECK(mlp_only_layers.size() <= static_cast<size_t>(num_hidden_layers), "mlp_only_layers holds ",
                mlp_only_layers.size(), " entries, but num_hidden_layers = ", num_hidden_layers);
    MOERL_CHECK(num_attention_heads % num_key_value_heads == 0, "num_attention_heads (", num_attention_heads,
                ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
    MOERL_CHECK(head_dim % 2 == 0, "head_dim (", head_dim, ") must be even for rotary embeddings");
    MOERL_CHECK(num_experts >= 0, "num_experts (", num_experts, ") must be >= 0");
    MOERL_CHECK(router_aux_loss_coef >= 0, "router_aux_loss_coef (", router_aux_loss_coef, ") must be >= 0");
    MOERL_CHECK(torch_dtype == "bfloat16" || torch_dtype == "float16" || torch_dtype == "float32",
                "torch_dtype \"", torch_dtype, "\" is not supported, expected bfloat16, float16 or float32");
    for (int layer : mlp_only_layers) {
        MOERL_CHECK(layer >= 0 && layer < num_hidden_layers, "mlp_only_layers holds ", layer,
                    ", but num_hidden_layers = ", num_hidden_layers);
    }
    int num_moe = num_moe_layers();
    if (num_moe > 0) {
        positive("moe_intermediate_size", moe_intermediate_size);
        MOERL_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts, "num_experts_per_tok (",
                    num_experts_per_tok, ") must be in [1, num_experts (", num_experts, ")]");
    }
    if (num_moe < num_hidden_layers) {
        MOERL_CHECK(intermediate_size > 0, "intermediate_size (", intermediate_size,
                    ") must be > 0: ", num_hidden_layers - num_moe, " layer(s) use a dense MLP");
    }
}

bool ModelConfig::is_moe_layer(int layer) const {
    if (num_experts <= 0 || decoder_sparse_step <= 0) return false;
    for (int l : mlp_only_layers) {
        if (l == layer) return false;
    }
    return (layer + 1) % decoder_sparse_step == 0;
}

int ModelConfig::num_moe_layers() const {
    int n = 0;
    for (int l = 0; l < num_hidden_layers; ++l) n += is_moe_layer(l);
    return n;
}

int ModelConfig::moe_layer_index(int layer) const {
    if (!is_moe_layer(layer)) return -1;
    int n = 0;
    for (int l = 0; l < layer; ++l) n += is_moe_layer(l);
    return n;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelConfig::tensor_shapes() const {
    const int64_t h = hidden_size, d = head_dim;
    const int64_t q = int64_t{num_attention_heads} * d, kv = int64_t{num_key_value_heads} * d;
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    out.push_back({"model.embed_tokens.weight", {vocab_size, h}});
    for (int l = 0; l < num_hidden_layers; ++l) {
        const std::string p = layer_prefix(l);
        out.push_back({p + "input_layernorm.weight", {h}});
        out.push_back({p + "self_attn.q_proj.weight", {q, h}});
        out.push_back({p + "self_attn.k_proj.weight", {kv, h}});
        out.push_back({p + "self_attn.v_proj.weight", {kv, h}});
        out.push_back({p + "self_attn.o_proj.weight", {h, q}});
        out.push_back({p + "self_attn.q_norm.weight", {d}});
        out.push_back({p + "self_attn.k_norm.weight", {d}});
        out.push_back({p + "post_attention_layernorm.weight", {h}});
        if (is_moe_layer(l)) {
            const int64_t i = moe_intermediate_size;
            out.push_back({p + "mlp.gate.weight", {num_experts, h}});
            for (int e = 0; e < num_experts; ++e) {
                out.push_back({expert_tensor_name(l, e, "gate_proj"), {i, h}});
                out.push_back({expert_tensor_name(l, e, "up_proj"), {i, h}});
                out.push_back({expert_tensor_name(l, e, "down_proj"), {h, i}});
            }
        } else {
            const int64_t i = intermediate_size;
            out.push_back({p + "mlp.gate_proj.weight", {i, h}});
            out.push_back({p + "mlp.up_proj.weight", {i, h}});
            out.push_back({p + "mlp.down_proj.weight", {h, i}});
        }
    }
    out.push_back({"model.norm.weight", {h}});
    if (!tie_word_embeddings) out.push_back({"lm_head.weight", {vocab_size, h}});
    return out;
}

int64_t ModelConfig::num_parameters() const {
    int64_t n = 0;
    for (const auto& [name, shape] : tensor_shapes()) {
        int64_t numel = 1;
        for (int64_t s : shape) numel *= s;
        n += numel;
    }
    return n;
}

int64_t ModelConfig::num_active_parameters() const {
    const int64_t unused =
        int64_t{num_moe_layers()} * (num_experts - num_experts_per_tok) * expert_parameters();
    return num_parameters() - unused;
}

}  // namespace moerl::model
