// MoeModel weights: HF-named state dict, random initialisation, checkpoint load and save.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <cstring>
#include <filesystem>

#include "dtype_names.hpp"
#include "file_util.hpp"
#include "model_impl.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/safetensors.hpp"

namespace moerl::model {
namespace detail {

at::ScalarType to_scalar_type(StDType t) {
    switch (t) {
        case StDType::kF64:
            return at::kDouble;
        case StDType::kF32:
            return at::kFloat;
        case StDType::kF16:
            return at::kHalf;
        case StDType::kBF16:
            return at::kBFloat16;
        case StDType::kI64:
            return at::kLong;
        case StDType::kI32:
            return at::kInt;
        case StDType::kI16:
            return at::kShort;
        case StDType::kI8:
            return at::kChar;
        case StDType::kU8:
            return at::kByte;
        case StDType::kBool:
            return at::kBool;
    }
    MOERL_FAIL("unknown safetensors dtype ", static_cast<int>(t));
}

StDType to_st_dtype(at::ScalarType t) {
    switch (t) {
        case at::kFloat:
            return StDType::kF32;
        case at::kBFloat16:
            return StDType::kBF16;
        case at::kHalf:
            return StDType::kF16;
        default:
            MOERL_FAIL("cannot store dtype ", t, " in a checkpoint, expected Float, BFloat16 or Half");
    }
}

at::ScalarType parse_torch_dtype(const std::string& name) {
    if (name == "float32") return at::kFloat;
    if (name == "bfloat16") return at::kBFloat16;
    if (name == "float16") return at::kHalf;
    MOERL_FAIL("dtype \"", name, "\" is not supported, expected float32, bfloat16 or float16");
}

std::string torch_dtype_name(at::ScalarType t) {
    return t == at::kFloat ? "float32" : (t == at::kBFloat16 ? "bfloat16" : "float16");
}

}  // namespace detail

namespace {
using detail::parse_torch_dtype;
using detail::to_scalar_type;
using detail::to_st_dtype;
using detail::torch_dtype_name;

uint64_t mix_seed(uint64_t seed, const std::string& name) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the name, then splitmix64 with the seed
    for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
    uint64_t z = seed + h + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> MoeModel::state_dict() const {
    const Impl& m = *impl_;
    std::vector<std::pair<std::string, at::Tensor>> out;
    out.push_back({"model.embed_tokens.weight", m.embed.detach()});
    for (int l = 0; l < m.config.num_hidden_layers; ++l) {
        const LayerWeights& w = m.layers[l];
        const std::string p = layer_prefix(l);
        out.push_back({p + "input_layernorm.weight", w.input_norm.detach()});
        out.push_back({p + "self_attn.q_proj.weight", w.q_proj.detach()});
        out.push_back({p + "self_attn.k_proj.weight", w.k_proj.detach()});
        out.push_back({p + "self_attn.v_proj.weight", w.v_proj.detach()});
        out.push_back({p + "self_attn.o_proj.weight", w.o_proj.detach()});
        out.push_back({p + "self_attn.q_norm.weight", w.q_norm.detach()});
        out.push_back({p + "self_attn.k_norm.weight", w.k_norm.detach()});
        out.push_back({p + "post_attention_layernorm.weight", w.post_norm.detach()});
        if (w.moe_index >= 0) {
            out.push_back({p + "mlp.gate.weight", w.router.detach()});
            for (int e = 0; e < m.num_local; ++e) {
                const int global = m.first_expert + e;
                out.push_back({expert_tensor_name(l, global, "gate_proj"), w.experts_gate.detach()[e]});
                out.push_back({expert_tensor_name(l, global, "up_proj"), w.experts_up.detach()[e]});
                out.push_back({expert_tensor_name(l, global, "down_proj"), w.experts_down.detach()[e]});
            }
        } else {
            out.push_back({p + "mlp.gate_proj.weight", w.gate_proj.detach()});
            out.push_back({p + "mlp.up_proj.weight", w.up_proj.detach()});
            out.push_back({p + "mlp.down_proj.weight", w.down_proj.detach()});
        }
    }
    out.push_back({"model.norm.weight", m.final_norm.detach()});
    if (m.lm_head.defined()) out.push_back({"lm_head.weight", m.lm_head.detach()});
    return out;
}

void MoeModel::init_random(uint64_t seed) {
    c10::NoGradGuard no_grad;
    const double stddev = impl_->config.initializer_range;
    for (auto& [name, dst] : state_dict()) {
        if (ends_with(name, "norm.weight")) {
            dst.fill_(1.0);
            continue;
        }
        at::Generator gen = at::detail::createCPUGenerator(mix_seed(seed, name));
        dst.copy_(at::empty(dst.sizes(), at::kFloat).normal_(0.0, stddev, gen));
    }
}

void MoeModel::load_weights(const std::string& dir) {
    c10::NoGradGuard no_grad;
    CheckpointReader reader(dir);
    for (auto& [name, dst] : state_dict()) {
        const TensorInfo& info = reader.info(name);
        MOERL_CHECK(at::IntArrayRef(info.shape) == dst.sizes(), "checkpoint ", dir, ": tensor ", name,
                    " has shape ", at::IntArrayRef(info.shape), ", but config.json implies ", dst.sizes());
        const at::ScalarType type = to_scalar_type(info.dtype);
        MOERL_CHECK(c10::isFloatingType(type), "checkpoint ", dir, ": tensor ", name, " has dtype ",
                    st_dtype_name(info.dtype), ", expected a floating type");
        const uint8_t* data = reader.data(name);
        at::Tensor src;
        if (reinterpret_cast<uintptr_t>(data) % st_dtype_size(info.dtype) == 0) {
            src = at::from_blob(const_cast<uint8_t*>(data), info.shape, at::TensorOptions().dtype(type));
        } else {
            src = at::empty(info.shape, at::TensorOptions().dtype(type));
            std::memcpy(src.data_ptr(), data, info.nbytes);
        }
        dst.copy_(src);
    }
}

MoeModel MoeModel::from_pretrained(const std::string& dir, const ModelOptions& options) {
    MoeModel model(ModelConfig::load(dir), options);
    model.load_weights(dir);
    return model;
}

void MoeModel::save_pretrained(const std::string& dir, uint64_t max_shard_bytes,
                               const std::string& dtype) const {
    const Impl& m = *impl_;
    const at::ScalarType type =
        dtype.empty() ? parse_torch_dtype(m.config.torch_dtype) : parse_torch_dtype(dtype);
    const StDType st = to_st_dtype(type);
    std::filesystem::create_directories(dir);
    const int rank = m.options.ep ? m.options.ep->config().rank : 0;
    const int world = m.options.ep ? m.options.ep->config().world_size : 1;

    std::vector<at::Tensor> host;  // keeps the converted copies alive while writing
    std::vector<TensorBytes> tensors;
    for (const auto& [name, t] : state_dict()) {
        const bool expert = name.find(".mlp.experts.") != std::string::npos;
        if (world > 1 && rank != 0 && !expert) continue;
        host.push_back(t.to(at::kCPU, type).contiguous());
        const at::Tensor& h = host.back();
        tensors.push_back({name, st, h.sizes().vec(), h.data_ptr(), static_cast<uint64_t>(h.nbytes())});
    }
    ModelConfig saved = m.config;
    saved.torch_dtype = torch_dtype_name(type);
    if (world == 1) {
        write_sharded(dir, tensors, max_shard_bytes);
        saved.save(dir);
        return;
    }
    write_safetensors(detail::join_path(dir, shard_file_name(rank, world)), tensors);
    if (rank != 0) return;
    // Rank 0 knows every name from the config: experts live in their owner's shard.
    const auto& ec = m.options.ep->config();
    std::map<std::string, std::string> weight_map;
    uint64_t total = 0;
    for (const auto& [name, shape] : m.config.tensor_shapes()) {
        int owner = 0;
        const std::string marker = ".mlp.experts.";
        const size_t at_pos = name.find(marker);
        if (at_pos != std::string::npos)
            owner = ec.expert_owner(std::stoi(name.substr(at_pos + marker.size())));
        weight_map[name] = shard_file_name(owner, world);
        uint64_t numel = 1;
        for (int64_t s : shape) numel *= static_cast<uint64_t>(s);
        total += numel * st_dtype_size(st);
    }
    write_index(dir, weight_map, total);
    std::filesystem::remove(detail::join_path(dir, "model.safetensors"));
    saved.save(dir);
}

}  // namespace moerl::model
