// config.json parsing and validation, safetensors read/write and checkpoint save/load.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model_test_util.hpp"
#include "moerl/model/model.hpp"
#include "moerl/model/safetensors.hpp"

namespace moerl::model {
namespace {

using test::error_of;
using test::TempDir;
using test::tiny_config;
using ::testing::HasSubstr;

const char* kQwen3Json = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "bos_token_id": 151643,
  "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
  "num_experts_per_tok": 2, "norm_topk_prob": true, "num_attention_heads": 4, "num_key_value_heads": 2,
  "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 500,
  "max_position_embeddings": 4096, "tie_word_embeddings": false, "decoder_sparse_step": 1,
  "mlp_only_layers": [0], "num_hidden_layers": 3, "router_aux_loss_coef": 0.001, "hidden_act": "silu",
  "rope_scaling": null, "torch_dtype": "bfloat16"})";

TEST(Config, ParsesQwen3MoeAndWritesBack) {
    ModelConfig c = ModelConfig::from_json_text(kQwen3Json);
    EXPECT_EQ(c.hidden_size, 64);
    EXPECT_EQ(c.head_dim, 16);
    EXPECT_EQ(c.num_experts, 8);
    EXPECT_TRUE(c.norm_topk_prob);
    EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
    EXPECT_FALSE(c.is_moe_layer(0));
    EXPECT_TRUE(c.is_moe_layer(1));
    EXPECT_EQ(c.num_moe_layers(), 2);
    EXPECT_EQ(c.moe_layer_index(2), 1);
    ModelConfig back = ModelConfig::from_json_text(c.to_json_text());
    EXPECT_EQ(back.to_json_text(), c.to_json_text());
    auto j = nlohmann::json::parse(c.to_json_text());
    EXPECT_EQ(j["bos_token_id"], 151643);  // unknown fields survive
    EXPECT_EQ(j["mlp_only_layers"], nlohmann::json::array({0}));
    // Parameters: embed + lm_head + norms + attention + 1 dense MLP + 2 MoE layers.
    const int64_t attn = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 2 * 16 + 2 * 64;
    const int64_t expected = 2 * 500 * 64 + 64 + 3 * attn + 3 * 128 * 64 + 2 * (8 * 64 + 8 * 3 * 32 * 64);
    EXPECT_EQ(c.num_parameters(), expected);
    EXPECT_EQ(c.num_active_parameters(), expected - 2 * 6 * 3 * 32 * 64);
}

TEST(Config, ReadsTransformers5Fields) {
    auto j = nlohmann::json::parse(kQwen3Json);
    j.erase("rope_theta");
    j.erase("torch_dtype");
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
    j["dtype"] = "float32";
    ModelConfig c = ModelConfig::from_json_text(j.dump());
    EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
    EXPECT_EQ(c.torch_dtype, "float32");
    auto back = nlohmann::json::parse(c.to_json_text());
    EXPECT_EQ(back["rope_theta"], 500000.0);
    EXPECT_EQ(back["torch_dtype"], "float32");
    j["rope_parameters"]["rope_type"] = "yarn";
    EXPECT_THAT(error_of([&] { ModelConfig::from_json_text(j.dump()); }),
                HasSubstr("rope_parameters.rope_type \"yarn\" is not supported"));
}

TEST(Config, RejectsInconsistentFields) {
    auto with = [](const char* key, nlohmann::json value) {
        auto j = nlohmann::json::parse(kQwen3Json);
        if (value.is_discarded())
            j.erase(key);
        else
            j[key] = value;
        return j.dump();
    };
    auto heads = nlohmann::json::parse(kQwen3Json);
    heads["num_attention_heads"] = 6;
    heads["num_key_value_heads"] = 4;
    EXPECT_THAT(
        error_of([&] { ModelConfig::from_json_text(heads.dump()); }),
        HasSubstr("config.json: num_attention_heads (6) must be a multiple of num_key_value_heads (4)"));
    EXPECT_THAT(error_of([&] {
                    ModelConfig::from_json_text(with("hidden_size", nlohmann::json::value_t::discarded));
                }),
                HasSubstr("missing required field hidden_size"));
    EXPECT_THAT(error_of([&] { ModelConfig::from_json_text(with("hidden_size", "64")); }),
                HasSubstr("hidden_size must be an integer"));
    EXPECT_THAT(error_of([&] { ModelConfig::from_json_text(with("num_experts_per_tok", 9)); }),
                HasSubstr("num_experts_per_tok (9) must be in [1, num_experts (8)]"));
    EXPECT_THAT(error_of([&] { ModelConfig::from_json_text(with("mlp_only_layers", {5})); }),
                HasSubstr("mlp_only_layers holds 5, but num_hidden_layers = 3"));
    EXPECT_THAT(error_of([&] { ModelConfig::from_json_text(with("head_dim", 15)); }),
                HasSubstr("head_dim (15)"));
    EXPECT_THAT(error_of([&] {
                    ModelConfig::from_json_text(with("rope_scaling", {{"type", "yarn"}}));
                }),
                HasSubstr("rope_scaling"));
    EXPECT_THAT(error_of([&] { ModelConfig::from_json_text(with("model_type", "llama")); }),
                HasSubstr("expected \"qwen3_moe\""));
    EXPECT_THAT(error_of([&] { ModelConfig::from_json_text("{\"hidden_size\": 4,"); }),
                HasSubstr("not valid JSON"));
}

// A small fp32 + bf16 pair written by hand.
std::vector<TensorBytes> sample_tensors(std::vector<float>& a, std::vector<uint16_t>& b) {
    a = {1.f, -2.f, 3.5f, 4.f, 5.f, 6.f};
    b = {0x3f80, 0xc000, 0x4049};
    return {{"a", StDType::kF32, {2, 3}, a.data(), 24}, {"b.weight", StDType::kBF16, {3}, b.data(), 6}};
}

std::string read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A file with the given header JSON and `data_bytes` zero bytes of data.
std::string file_with_header(const std::string& dir, const std::string& header, size_t data_bytes) {
    std::string bytes(8, '\0');
    uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    bytes += header + std::string(data_bytes, '\0');
    const std::string path = dir + "/x.safetensors";
    write_bytes(path, bytes);
    return path;
}

TEST(Safetensors, RoundTripIsBitExact) {
    TempDir dir("st");
    std::vector<float> a;
    std::vector<uint16_t> b;
    const std::string path = dir.path + "/t.safetensors";
    write_safetensors(path, sample_tensors(a, b));
    SafetensorsFile f(path);
    ASSERT_EQ(f.tensors().size(), 2u);
    const TensorInfo* ta = f.find("a");
    ASSERT_NE(ta, nullptr);
    EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(ta->dtype, StDType::kF32);
    EXPECT_EQ(std::memcmp(f.data(*ta), a.data(), 24), 0);
    const TensorInfo* tb = f.find("b.weight");
    ASSERT_NE(tb, nullptr);
    EXPECT_EQ(std::memcmp(f.data(*tb), b.data(), 6), 0);
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.find("c"), nullptr);
}

TEST(Safetensors, RejectsMalformedFiles) {
    TempDir dir("st-bad");
    std::vector<float> a;
    std::vector<uint16_t> b;
    const std::string good = dir.path + "/good.safetensors";
    write_safetensors(good, sample_tensors(a, b));
    const std::string bytes = read_bytes(good);

    const std::string truncated = dir.path + "/truncated.safetensors";
    write_bytes(truncated, bytes.substr(0, bytes.size() - 4));
    EXPECT_THAT(error_of([&] { SafetensorsFile f(truncated); }),
                HasSubstr("past the end of the data region"));

    write_bytes(truncated, bytes.substr(0, 5));
    EXPECT_THAT(error_of([&] { SafetensorsFile f(truncated); }), HasSubstr("too short"));

    write_bytes(truncated, bytes.substr(0, 20));
    EXPECT_THAT(error_of([&] { SafetensorsFile f(truncated); }), HasSubstr("runs past the end of the file"));

    EXPECT_THAT(error_of([&] { SafetensorsFile f(file_with_header(dir.path, "{\"a\": [1,", 0)); }),
                HasSubstr("not valid JSON"));
    // The header claims 8 bytes for a [2, 3] F32 tensor (needs 24).
    EXPECT_THAT(
        error_of([&] {
            SafetensorsFile f(file_with_header(
                dir.path, R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 8]}})", 24));
        }),
        HasSubstr("tensor w: data_offsets [0,8] span 8 bytes, but shape [2, 3] of F32 needs 24 bytes"));
    EXPECT_THAT(error_of([&] {
                    SafetensorsFile f(
                        file_with_header(dir.path,
                                         R"({"u": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                            "v": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                                         24));
                }),
                HasSubstr("overlap"));
    EXPECT_THAT(error_of([&] {
                    SafetensorsFile f(file_with_header(
                        dir.path, R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}})", 2));
                }),
                HasSubstr("dtype \"Q4\" is not supported"));
    EXPECT_THAT(
        error_of([&] {
            SafetensorsFile f(file_with_header(dir.path, R"({"w": {"dtype": "F32", "shape": [2]}})", 8));
        }),
        HasSubstr("needs dtype, shape and data_offsets"));
    EXPECT_THAT(error_of([&] { SafetensorsFile f(dir.path + "/missing.safetensors"); }),
                HasSubstr("cannot open"));
}

void expect_same_weights(const MoeModel& a, const MoeModel& b) {
    auto sa = a.state_dict(), sb = b.state_dict();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
        ASSERT_EQ(sa[i].first, sb[i].first);
        ASSERT_EQ(sa[i].second.scalar_type(), sb[i].second.scalar_type());
        EXPECT_TRUE(at::equal(sa[i].second, sb[i].second)) << sa[i].first;
    }
}

TEST(Checkpoint, SaveLoadSingleFileIsBitExact) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        TempDir dir("ckpt");
        MoeModel model(tiny_config(3, true), {at::kCPU, dtype});
        model.init_random(7);
        model.save_pretrained(dir.path, 0, dtype == at::kFloat ? "float32" : "bfloat16");
        EXPECT_TRUE(std::filesystem::exists(dir.path + "/model.safetensors"));
        EXPECT_TRUE(std::filesystem::exists(dir.path + "/config.json"));
        EXPECT_FALSE(std::filesystem::exists(dir.path + "/model.safetensors.index.json"));
        MoeModel loaded = MoeModel::from_pretrained(dir.path, {at::kCPU, dtype});
        expect_same_weights(model, loaded);
    }
}

TEST(Checkpoint, SaveLoadShardedIsBitExact) {
    TempDir dir("ckpt-sharded");
    MoeModel model(tiny_config(2), {at::kCPU, at::kFloat});
    model.init_random(11);
    model.save_pretrained(dir.path, 16 << 10, "float32");
    CheckpointReader reader(dir.path);
    EXPECT_GT(reader.files().size(), 2u);
    EXPECT_EQ(reader.files().front(), shard_file_name(0, static_cast<int>(reader.files().size())));
    auto index = nlohmann::json::parse(std::ifstream(dir.path + "/model.safetensors.index.json"));
    EXPECT_EQ(index["weight_map"].size(), model.config().tensor_shapes().size());
    EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), model.config().num_parameters() * 4);
    MoeModel loaded = MoeModel::from_pretrained(dir.path, {at::kCPU, at::kFloat});
    expect_same_weights(model, loaded);
    // A changed weight must show (the comparison can fail).
    loaded.state_dict()[3].second.view(-1)[0].add_(1.0);
    EXPECT_FALSE(at::equal(model.state_dict()[3].second, loaded.state_dict()[3].second));
}

TEST(Checkpoint, MissingTensorAndWrongShapeAreNamed) {
    TempDir dir("ckpt-missing");
    ModelConfig c = tiny_config(2);
    MoeModel model(c, {at::kCPU, at::kFloat});
    model.init_random(1);
    std::vector<at::Tensor> keep;
    std::vector<TensorBytes> tensors;
    for (const auto& [name, t] : model.state_dict()) {
        if (name == expert_tensor_name(1, 5, "up_proj")) continue;
        keep.push_back(t.contiguous());
        tensors.push_back({name, StDType::kF32, t.sizes().vec(), keep.back().data_ptr(),
                           static_cast<uint64_t>(keep.back().nbytes())});
    }
    write_sharded(dir.path, tensors, 0);
    c.save(dir.path);
    EXPECT_THAT(error_of([&] { MoeModel::from_pretrained(dir.path, {}); }),
                HasSubstr("tensor model.layers.1.mlp.experts.5.up_proj.weight not found in checkpoint"));

    ModelConfig wider = c;
    wider.moe_intermediate_size = 24;
    MoeModel other(wider, {});
    EXPECT_THAT(error_of([&] { other.load_weights(dir.path); }),
                HasSubstr("has shape [16, 32], but config.json implies [24, 32]"));
    EXPECT_THAT(error_of([&] { CheckpointReader r(dir.path + "/nothing"); }),
                HasSubstr("has neither model.safetensors nor model.safetensors.index.json"));
}

}  // namespace
}  // namespace moerl::model
