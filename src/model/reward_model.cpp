// RewardModel: checkpoint checks, the scalar head on MoeModel's final hidden states, save and load.
#include "moerl/model/reward_model.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "dtype_names.hpp"
#include "file_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/json.hpp"
#include "moerl/model/safetensors.hpp"

namespace moerl::model {
namespace {

using nlohmann::json;
constexpr const char* kScore = "score.weight";

// config.json's architectures as one string for messages ("" when absent).
std::string architectures(const json& j) {
    std::string out;
    if (!j.contains("architectures") || !j.at("architectures").is_array()) return out;
    for (const json& a : j.at("architectures"))
        if (a.is_string()) out += (out.empty() ? "" : ", ") + a.get<std::string>();
    return out;
}

// transformers: num_labels is the size of id2label when config.json has one, else num_labels, else 2.
int config_num_labels(const json& j, const std::string& source) {
    if (j.contains("id2label") && !j.at("id2label").is_null()) {
        MOERL_CHECK(j.at("id2label").is_object(), source, ": id2label must be an object, got ",
                    j.at("id2label").dump());
        return static_cast<int>(j.at("id2label").size());
    }
    if (j.contains("num_labels") && !j.at("num_labels").is_null()) {
        MOERL_CHECK(j.at("num_labels").is_number_integer() && j.at("num_labels").get<int64_t>() >= 1, source,
                    ": num_labels must be an integer >= 1, got ", j.at("num_labels").dump());
        return static_cast<int>(j.at("num_labels").get<int64_t>());
    }
    return 2;
}

}  // namespace

RewardCheckpointInfo inspect_reward_checkpoint(const std::string& dir, int label) {
    const std::string source = detail::join_path(dir, "config.json");
    RewardCheckpointInfo info;
    info.backbone = ModelConfig::load(dir);
    const json j = parse_json(detail::read_text_file(source), source);
    const std::string arch = architectures(j);
    CheckpointReader reader(dir);
    if (!reader.contains(kScore)) {
        const bool causal =
            reader.contains("lm_head.weight") || arch.find("ForCausalLM") != std::string::npos;
        MOERL_CHECK(!causal, "checkpoint ", dir, " is a causal language model (",
                    reader.contains("lm_head.weight") ? "lm_head.weight" : "architectures " + arch,
                    "), not a reward model: expected a *ForSequenceClassification checkpoint with ", kScore,
                    " [num_labels, hidden_size]");
        MOERL_FAIL(
            "checkpoint ", dir, " has no tensor ", kScore, " (architectures: ", arch.empty() ? "none" : arch,
            "): expected the [num_labels, hidden_size] head of a *ForSequenceClassification checkpoint");
    }
    const TensorInfo& t = reader.info(kScore);
    MOERL_CHECK(c10::isFloatingType(detail::to_scalar_type(t.dtype)), "checkpoint ", dir, ": ", kScore,
                " has dtype ", st_dtype_name(t.dtype), ", expected a floating type");
    const int64_t hidden = info.backbone.hidden_size;
    MOERL_CHECK(t.shape.size() == 2 && t.shape[0] >= 1 && t.shape[1] == hidden, "checkpoint ", dir, ": ",
                kScore, " has shape ", at::IntArrayRef(t.shape),
                ", expected [num_labels, hidden_size = ", hidden, "]");
    info.num_labels = static_cast<int>(t.shape[0]);
    const int declared = config_num_labels(j, source);
    MOERL_CHECK(declared == info.num_labels, "checkpoint ", dir, ": ", kScore, " has ", info.num_labels,
                " rows, but config.json declares ", declared,
                " labels (id2label, or num_labels; transformers' default is 2)");
    if (label < 0) {
        MOERL_CHECK(info.num_labels == 1, "checkpoint ", dir, " has ", info.num_labels,
                    " labels; a reward is one of them: choose it with reward.label (0..", info.num_labels - 1,
                    ")");
        label = 0;
    }
    MOERL_CHECK(label < info.num_labels, "reward label ", label, " is out of range: checkpoint ", dir,
                " has ", info.num_labels, " labels (0..", info.num_labels - 1, ")");
    info.label = label;
    if (j.contains("pad_token_id") && !j.at("pad_token_id").is_null()) {
        MOERL_CHECK(j.at("pad_token_id").is_number_integer(), source,
                    ": pad_token_id must be an integer, got ", j.at("pad_token_id").dump());
        info.pad_token_id = j.at("pad_token_id").get<int64_t>();
    }
    return info;
}

at::Tensor last_token_index(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                            std::optional<int64_t> pad_token_id) {
    MOERL_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq], got shape ", input_ids.sizes());
    at::Tensor real = attention_mask.defined()
                          ? attention_mask.to(input_ids.device()).to(at::kBool)
                          : at::ones_like(input_ids, input_ids.options().dtype(at::kBool));
    if (pad_token_id) real = real.logical_and(input_ids.ne(*pad_token_id));
    // Column numbers where the token counts, 0 elsewhere: the largest is the last such column.
    at::Tensor cols = at::arange(input_ids.size(1), input_ids.options().dtype(at::kLong));
    return (cols.unsqueeze(0) * real.to(at::kLong)).argmax(1);
}

RewardModel::RewardModel(const ModelConfig& backbone, int num_labels, int label,
                         std::optional<int64_t> pad_token_id, const ModelOptions& options)
    : backbone_(backbone,
                [&] {
                    ModelOptions o = options;
                    o.lm_head = false;
                    return o;
                }()),
      num_labels_(num_labels),
      label_(label),
      pad_token_id_(pad_token_id) {
    MOERL_CHECK(num_labels >= 1, "reward model: num_labels ", num_labels, " must be >= 1");
    MOERL_CHECK(label >= 0 && label < num_labels, "reward model: label ", label, " must be in [0, ",
                num_labels, ")");
    score_ = at::zeros({num_labels, backbone.hidden_size},
                       at::TensorOptions().device(options.device).dtype(options.dtype));
}

RewardModel RewardModel::from_pretrained(const std::string& dir, const ModelOptions& options, int label) {
    RewardCheckpointInfo info = inspect_reward_checkpoint(dir, label);
    RewardModel rm(info.backbone, info.num_labels, info.label, info.pad_token_id, options);
    rm.backbone_.load_weights(dir);
    CheckpointReader reader(dir);
    const TensorInfo& t = reader.info(kScore);
    at::Tensor src = at::empty(t.shape, at::TensorOptions().dtype(detail::to_scalar_type(t.dtype)));
    std::memcpy(src.data_ptr(), reader.data(kScore), t.nbytes);
    c10::NoGradGuard no_grad;
    rm.score_.copy_(src);
    return rm;
}

void RewardModel::init_random(uint64_t seed) {
    c10::NoGradGuard no_grad;
    backbone_.init_random(seed);
    at::Generator gen = at::detail::createCPUGenerator(seed ^ 0x5c0aeULL);
    score_.copy_(at::empty(score_.sizes(), at::kFloat).normal_(0.0, config().initializer_range, gen));
}

void RewardModel::save_pretrained(const std::string& dir, const std::string& dtype) const {
    const std::string stored = dtype.empty() ? config().torch_dtype : dtype;
    const at::ScalarType type = detail::parse_torch_dtype(stored);
    const StDType st = detail::to_st_dtype(type);
    std::filesystem::create_directories(dir);
    auto named = backbone_.state_dict();
    named.push_back({kScore, score_.detach()});
    std::vector<at::Tensor> host;  // the converted copies, alive while writing
    std::vector<TensorBytes> tensors;
    for (const auto& [name, t] : named) {
        host.push_back(t.to(at::kCPU, type).contiguous());
        tensors.push_back({name, st, host.back().sizes().vec(), host.back().data_ptr(),
                           static_cast<uint64_t>(host.back().nbytes())});
    }
    write_sharded(dir, tensors, 0);
    ModelConfig saved = config();
    saved.torch_dtype = stored;
    json extra = json::parse(saved.extra_json.empty() ? "{}" : saved.extra_json);
    extra["architectures"] = json::array({"Qwen3MoeForSequenceClassification"});
    json id2label = json::object(), label2id = json::object();
    for (int i = 0; i < num_labels_; ++i) {
        id2label[std::to_string(i)] = "LABEL_" + std::to_string(i);
        label2id["LABEL_" + std::to_string(i)] = i;
    }
    extra["id2label"] = id2label;
    extra["label2id"] = label2id;
    extra.erase("num_labels");
    extra["pad_token_id"] = pad_token_id_ ? json(*pad_token_id_) : json(nullptr);
    saved.extra_json = extra.dump();
    saved.save(dir);
}

at::Tensor RewardModel::logits(const at::Tensor& input_ids, const at::Tensor& attention_mask) const {
    c10::NoGradGuard no_grad;
    ForwardOptions fo;
    fo.return_logits = false;
    fo.compute_logprobs = false;
    fo.return_hidden = true;
    ForwardOutput out = backbone_.forward(input_ids, attention_mask, fo);
    const at::Device device = out.hidden.device();
    at::Tensor idx =
        last_token_index(input_ids.to(device, at::kLong),
                         attention_mask.defined() ? attention_mask.to(device) : at::Tensor(), pad_token_id_);
    const int64_t B = out.hidden.size(0), H = out.hidden.size(2);
    at::Tensor pooled = out.hidden.gather(1, idx.view({B, 1, 1}).expand({B, 1, H})).squeeze(1);  // [B, H]
    return at::matmul(pooled, score_.t()).to(at::kFloat);
}

std::vector<double> RewardModel::score(const std::vector<std::vector<int>>& sequences, int max_batch) const {
    MOERL_CHECK(max_batch >= 1, "reward model: batch size ", max_batch, " must be >= 1");
    std::vector<double> out;
    out.reserve(sequences.size());
    const int64_t fill = pad_token_id_.value_or(0);
    for (size_t first = 0; first < sequences.size(); first += static_cast<size_t>(max_batch)) {
        const size_t n = std::min(sequences.size() - first, static_cast<size_t>(max_batch));
        size_t longest = 0;
        for (size_t i = 0; i < n; ++i) {
            MOERL_CHECK(!sequences[first + i].empty(), "reward model: sequence ", first + i,
                        " is empty; expected at least one token");
            longest = std::max(longest, sequences[first + i].size());
        }
        const int64_t B = static_cast<int64_t>(n), S = static_cast<int64_t>(longest);
        at::Tensor ids = at::full({B, S}, fill, at::kLong);
        at::Tensor mask = at::zeros({B, S}, at::kLong);
        auto ids_a = ids.accessor<int64_t, 2>();
        auto mask_a = mask.accessor<int64_t, 2>();
        for (int64_t b = 0; b < B; ++b) {
            const auto& seq = sequences[first + static_cast<size_t>(b)];
            for (size_t t = 0; t < seq.size(); ++t) {
                ids_a[b][static_cast<int64_t>(t)] = seq[t];
                mask_a[b][static_cast<int64_t>(t)] = 1;
            }
        }
        at::Tensor l = logits(ids, mask).select(1, label_).to(at::kCPU).to(at::kDouble).contiguous();
        const double* p = l.data_ptr<double>();
        out.insert(out.end(), p, p + B);
    }
    return out;
}

}  // namespace moerl::model
