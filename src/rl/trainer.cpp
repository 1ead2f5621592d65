#include "moerl/rl/trainer.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/model.hpp"
#include "moerl/model/safetensors.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/rollout.hpp"

namespace moerl::rl {

namespace {
namespace fs = std::filesystem;

std::string unique_job() {
    static std::atomic<int> counter{0};
    return "rl-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

// Model inputs of a list of samples: prompt + response, right-padded.
struct Batch {
    at::Tensor ids, attn, resp_mask, behaviour, advantages, replay;
    int64_t num_tokens = 0;
};

Batch make_batch(const std::vector<const ExperienceRecord*>& recs, const std::vector<double>& adv, int M,
                 int K, bool replay) {
    Batch b;
    const int64_t N = static_cast<int64_t>(recs.size());
    int64_t S = 1;
    for (auto* r : recs) S = std::max<int64_t>(S, r->task.prompt_tokens.size() + r->trajectory.tokens.size());
    b.ids = at::zeros({N, S}, at::kLong);
    b.attn = at::zeros({N, S}, at::kLong);
    b.resp_mask = at::zeros({N, S}, at::kFloat);
    b.behaviour = at::zeros({N, S}, at::kFloat);
    b.advantages = at::tensor(adv, at::kDouble).to(at::kFloat);
    if (replay) b.replay = at::full({N, S, M, K}, -1, at::kShort);
    auto ids = b.ids.accessor<int64_t, 2>();
    auto attn = b.attn.accessor<int64_t, 2>();
    auto mask = b.resp_mask.accessor<float, 2>();
    auto beh = b.behaviour.accessor<float, 2>();
    for (int64_t i = 0; i < N; ++i) {
        const auto& p = recs[i]->task.prompt_tokens;
        const auto& t = recs[i]->trajectory;
        const int64_t P = static_cast<int64_t>(p.size());
        for (int64_t j = 0; j < P; ++j) ids[i][j] = p[j], attn[i][j] = 1;
        for (size_t j = 0; j < t.tokens.size(); ++j) {
            ids[i][P + j] = t.tokens[j];
            attn[i][P + j] = 1;
            mask[i][P + j] = 1;
            beh[i][P + j] = t.logprobs[j];
        }
        const int64_t L = P + static_cast<int64_t>(t.tokens.size());
        if (replay && !t.routing.empty() && t.num_moe_layers == M && t.top_k == K &&
            static_cast<int64_t>(t.routing.size()) == L * M * K) {
            b.replay[i].narrow(0, 0, L).copy_(at::tensor(t.routing, at::kShort).view({L, M, K}));
        }
        b.num_tokens += static_cast<int64_t>(t.tokens.size());
    }
    return b;
}

// [b, t] = log p(ids[b, t] | ids[b, <t]) under softmax(logits / temperature) over the tokens the
// sampler may draw (rollout.allowed_tokens); column 0 is 0.
at::Tensor tempered_logprobs(const at::Tensor& logits, const at::Tensor& ids,
                             const SamplingParams& sampling) {
    const int64_t B = logits.size(0), S = logits.size(1);
    at::Tensor zero = at::zeros({B, 1}, logits.options().dtype(at::kFloat));
    if (S <= 1) return zero;
    at::Tensor z = logits.narrow(1, 0, S - 1).to(at::kFloat) / sampling.temperature;
    if (at::Tensor bias = allowed_token_bias(sampling, logits.size(2), z.options()); bias.defined())
        z = z + bias;
    at::Tensor lp = at::log_softmax(z, -1);
    return at::cat({zero, lp.gather(2, ids.narrow(1, 1, S - 1).unsqueeze(-1)).squeeze(-1)}, 1);
}

}  // namespace

struct PolicyTrainer::Impl {
    struct Rank {
        std::unique_ptr<ep::Store> store;
        std::unique_ptr<ep::Buffer> buffer;
        std::unique_ptr<model::MoeModel> model, ref;
        std::vector<model::NamedParameter> params;
        std::vector<at::Tensor> m, v;
    };
    RunConfig cfg;
    int W = 1;
    std::string store_dir;
    std::vector<Rank> ranks;
    int64_t step = 0;
    std::unique_ptr<std::barrier<>> barrier;
    std::vector<at::Tensor> grad_slots;  // [W] flat dense gradients
    std::vector<double> sq_slots;        // [W] squared expert-gradient norms
    std::vector<TrainStats> stat_slots;  // [W]

    // Runs fn(r) on W threads and rethrows the first failure.
    void on_ranks(const std::function<void(int)>& fn) {
        if (W == 1) return fn(0);
        std::mutex mu;
        std::exception_ptr failure;
        std::vector<std::thread> threads;
        for (int r = 0; r < W; ++r) {
            threads.emplace_back([&, r] {
                try {
                    fn(r);
                } catch (...) {
                    std::lock_guard<std::mutex> lock(mu);
                    if (!failure) failure = std::current_exception();
                }
            });
        }
        for (auto& t : threads) t.join();
        if (failure) std::rethrow_exception(failure);
    }

    void init(int r, int max_tokens) {
        Rank& k = ranks[r];
        model::ModelOptions opts;
        if (W > 1) {
            k.store = ep::make_file_store(store_dir);
            ep::Config ec;
            ec.world_size = W;
            ec.rank = r;
            ec.num_experts = cfg.model.num_experts;
            ec.hidden = cfg.model.hidden_size;
            ec.top_k = cfg.model.num_experts_per_tok;
            ec.max_tokens_per_rank = max_tokens;
            ec.dtype = ep::DType::kFloat32;
            ec.transport = "host";
            ec.job_id = job;
            ec.timeout_s = 120;
            k.buffer = std::make_unique<ep::Buffer>(ec, k.store.get());
            opts.ep = k.buffer.get();
        }
        k.model = std::make_unique<model::MoeModel>(cfg.model, opts);
        if (cfg.model_path.empty()) {
            k.model->init_random(cfg.seed);
        } else {
            k.model->load_weights(cfg.model_path);
        }
        if (cfg.grpo.kl_coef > 0) {
            k.ref = std::make_unique<model::MoeModel>(cfg.model, opts);
            c10::NoGradGuard g;
            auto src = k.model->state_dict();
            auto dst = k.ref->state_dict();
            for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second);
            k.ref->set_requires_grad(false);
        }
        k.params = k.model->named_parameters();
        for (auto& p : k.params) {
            k.m.push_back(at::zeros_like(p.tensor).detach());
            k.v.push_back(at::zeros_like(p.tensor).detach());
        }
    }
    std::string job = unique_job();

    void rank_update(int r, const std::vector<const ExperienceRecord*>& recs, const std::vector<double>& adv,
                     int64_t global_tokens) {
        Rank& k = ranks[r];
        const auto& mc = cfg.model;
        Batch b = make_batch(recs, adv, mc.num_moe_layers(), mc.num_experts_per_tok, cfg.routing_replay);
        TrainStats st;
        at::Tensor prox, ref_lp;
        model::ForwardOptions fo;
        fo.return_logits = true;
        fo.compute_logprobs = false;
        if (cfg.routing_replay) fo.replay_routing = b.replay;
        if (k.ref) {
            c10::NoGradGuard g;
            ref_lp = tempered_logprobs(k.ref->forward(b.ids, b.attn, fo).logits, b.ids, cfg.sampling);
        }
        for (int epoch = 0; epoch < cfg.ppo_epochs; ++epoch) {
            model::ForwardOutput out = k.model->forward(b.ids, b.attn, fo);
            at::Tensor logp = tempered_logprobs(out.logits, b.ids, cfg.sampling);
            if (epoch == 0) prox = logp.detach();
            GrpoInputs in{logp,
                          prox,
                          b.behaviour,
                          b.advantages,
                          b.resp_mask,
                          ref_lp,
                          static_cast<double>(global_tokens)};
            GrpoOutput g = grpo_loss(in, cfg.grpo);
            at::Tensor loss = g.loss + (mc.router_aux_loss_coef / W) * out.aux_loss;
            loss.backward();
            const double grad_norm = step_optimizer(r, epoch);
            if (epoch == 0) {
                st.grad_norm = grad_norm;  // the gradient of the logged loss
                st.loss = g.loss.item<double>();
                st.aux_loss = out.aux_loss.item<double>();
                st.clip_fraction = g.clip_fraction;
                st.mean_ratio = g.mean_ratio;
                st.mean_is_weight = g.mean_is_weight;
                st.truncated_fraction = g.truncated_fraction;
                st.kl = g.kl;
            } else {
                st.clip_fraction = g.clip_fraction;  // the last epoch's is the informative one
            }
        }
        st.num_tokens = b.num_tokens;
        stat_slots[r] = st;
    }

    // Sums dense gradients across ranks, clips by the global norm, applies AdamW. Returns the
    // global norm before clipping (the same on every rank).
    double step_optimizer(int r, int epoch) {
        Rank& k = ranks[r];
        c10::NoGradGuard g;
        std::vector<at::Tensor> dense, expert;
        for (auto& p : k.params) {
            at::Tensor grad = p.tensor.grad();
            if (!grad.defined()) grad = at::zeros_like(p.tensor);
            (p.expert ? expert : dense).push_back(grad);
        }
        at::Tensor flat = at::cat([&] {
            std::vector<at::Tensor> v;
            for (auto& d : dense) v.push_back(d.reshape(-1));
            return v;
        }());
        double expert_sq = 0;
        for (auto& e : expert) expert_sq += e.pow(2).sum().item<double>();
        if (W > 1) {
            grad_slots[r] = flat;
            sq_slots[r] = expert_sq;
            barrier->arrive_and_wait();
            at::Tensor sum = grad_slots[0].clone();
            for (int q = 1; q < W; ++q) sum.add_(grad_slots[q]);
            expert_sq = 0;
            for (int q = 0; q < W; ++q) expert_sq += sq_slots[q];
            barrier->arrive_and_wait();  // every rank has read the slots
            flat = sum;
        }
        const double norm = std::sqrt(flat.pow(2).sum().item<double>() + expert_sq);
        const double scale =
            (cfg.grad_clip > 0 && norm > cfg.grad_clip) ? cfg.grad_clip / (norm + 1e-6) : 1.0;
        const int64_t t = step_count_for_update + epoch + 1;
        const double bc1 = 1 - std::pow(cfg.beta1, static_cast<double>(t));
        const double bc2 = 1 - std::pow(cfg.beta2, static_cast<double>(t));
        int64_t offset = 0;
        size_t ei = 0;
        for (size_t i = 0; i < k.params.size(); ++i) {
            at::Tensor p = k.params[i].tensor;
            at::Tensor grad;
            if (k.params[i].expert) {
                grad = expert[ei++];
            } else {
                grad = flat.narrow(0, offset, p.numel()).view(p.sizes());
                offset += p.numel();
            }
            grad = grad * scale;
            k.m[i].mul_(cfg.beta1).add_(grad, 1 - cfg.beta1);
            k.v[i].mul_(cfg.beta2).addcmul_(grad, grad, 1 - cfg.beta2);
            if (cfg.weight_decay > 0) p.mul_(1 - lr * cfg.weight_decay);
            at::Tensor denom = (k.v[i] / bc2).sqrt_().add_(cfg.adam_eps);
            p.addcdiv_(k.m[i], denom, -lr / bc1);
        }
        k.model->zero_grad();
        if (W > 1) barrier->arrive_and_wait();
        return norm;
    }
    int64_t step_count_for_update = 0;  // optimizer steps before the current update
    double lr = 0;                      // learning rate of the current update (schedule)
};

PolicyTrainer::PolicyTrainer(const RunConfig& config, const std::string& work_dir)
    : impl_(std::make_unique<Impl>()) {
    Impl& m = *impl_;
    m.cfg = config;
    m.W = config.ep_ranks;
    m.ranks.resize(m.W);
    m.grad_slots.resize(m.W);
    m.sq_slots.resize(m.W);
    m.stat_slots.resize(m.W);
    m.barrier = std::make_unique<std::barrier<>>(m.W);
    m.store_dir = (fs::path(work_dir) / ("ep-" + m.job)).string();
    fs::create_directories(m.store_dir);
    const int64_t max_len = config.max_sequence_tokens();
    const int64_t samples = (int64_t{config.prompts_per_step} * config.group_size + m.W - 1) / m.W;
    const int max_tokens = static_cast<int>(samples * max_len);
    m.on_ranks([&](int r) { m.init(r, max_tokens); });
}

PolicyTrainer::~PolicyTrainer() {
    if (!impl_) return;
    try {
        impl_->on_ranks([&](int r) {
            if (impl_->ranks[r].buffer) impl_->ranks[r].buffer->destroy();
        });
        std::filesystem::remove_all(impl_->store_dir);
    } catch (...) {
    }
}

TrainStats PolicyTrainer::update(const std::vector<ExperienceRecord>& batch,
                                 const std::vector<double>& advantages) {
    Impl& m = *impl_;
    MOERL_CHECK(batch.size() == advantages.size(), "update: ", batch.size(), " samples but ",
                advantages.size(), " advantages");
    MOERL_CHECK(static_cast<int>(batch.size()) >= m.W, "update: ", batch.size(), " samples cannot feed ", m.W,
                " ranks");
    int64_t global_tokens = 0;
    for (const auto& e : batch) global_tokens += static_cast<int64_t>(e.trajectory.tokens.size());
    std::vector<std::vector<const ExperienceRecord*>> parts(m.W);
    std::vector<std::vector<double>> adv(m.W);
    for (size_t i = 0; i < batch.size(); ++i) {
        parts[i % m.W].push_back(&batch[i]);
        adv[i % m.W].push_back(advantages[i]);
    }
    m.lr = m.cfg.lr_at(m.step_count_for_update / m.cfg.ppo_epochs);
    m.on_ranks([&](int r) { m.rank_update(r, parts[r], adv[r], std::max<int64_t>(1, global_tokens)); });
    TrainStats total;
    for (int r = 0; r < m.W; ++r) {
        const TrainStats& s = m.stat_slots[r];
        const double w = static_cast<double>(s.num_tokens) / std::max<int64_t>(1, global_tokens);
        total.loss += s.loss;  // each rank's loss is already divided by the global count
        total.aux_loss += s.aux_loss / m.W;
        total.clip_fraction += w * s.clip_fraction;
        total.mean_ratio += w * s.mean_ratio;
        total.mean_is_weight += w * s.mean_is_weight;
        total.truncated_fraction += w * s.truncated_fraction;
        total.kl += w * s.kl;
        total.num_tokens += s.num_tokens;
    }
    total.grad_norm = m.stat_slots[0].grad_norm;
    total.lr = m.lr;
    m.step_count_for_update += m.cfg.ppo_epochs;
    m.step = m.step_count_for_update;
    return total;
}

void PolicyTrainer::save_weights(const std::string& dir) const {
    impl_->on_ranks([&](int r) { impl_->ranks[r].model->save_pretrained(dir, 0, "float32"); });
}

void PolicyTrainer::save_optimizer(const std::string& dir) const {
    Impl& m = *impl_;
    fs::create_directories(dir);
    m.on_ranks([&](int r) {
        auto& k = m.ranks[r];
        std::vector<model::TensorBytes> tensors;
        std::vector<at::Tensor> keep;
        for (size_t i = 0; i < k.params.size(); ++i) {
            for (int which = 0; which < 2; ++which) {
                at::Tensor t = (which == 0 ? k.m[i] : k.v[i]).to(at::kFloat).contiguous();
                keep.push_back(t);
                tensors.push_back({(which == 0 ? "exp_avg." : "exp_avg_sq.") + k.params[i].name,
                                   model::StDType::kF32,
                                   std::vector<int64_t>(t.sizes().begin(), t.sizes().end()), t.data_ptr(),
                                   static_cast<uint64_t>(t.numel()) * 4});
            }
        }
        model::write_safetensors(
            (fs::path(dir) / ("optimizer-rank" + std::to_string(r) + ".safetensors")).string(), tensors);
    });
    std::ofstream(fs::path(dir) / "optimizer.json")
        << nlohmann::json{{"step", m.step_count_for_update}, {"ranks", m.W}, {"type", "adamw"}}.dump(2);
}

void PolicyTrainer::load(const std::string& dir) {
    Impl& m = *impl_;
    m.on_ranks([&](int r) { m.ranks[r].model->load_weights(dir); });
    const fs::path opt = fs::path(dir) / "optimizer.json";
    if (!fs::exists(opt)) return;
    std::ifstream in(opt);
    auto j = nlohmann::json::parse(in);
    MOERL_CHECK(j.at("ranks").get<int>() == m.W, "checkpoint ", dir, ": optimizer state of ",
                j.at("ranks").get<int>(), " EP ranks, but this run has ranks.ep = ", m.W);
    m.step_count_for_update = m.step = j.at("step").get<int64_t>();
    m.on_ranks([&](int r) {
        auto& k = m.ranks[r];
        model::SafetensorsFile f(
            (fs::path(dir) / ("optimizer-rank" + std::to_string(r) + ".safetensors")).string());
        c10::NoGradGuard g;
        for (size_t i = 0; i < k.params.size(); ++i) {
            for (int which = 0; which < 2; ++which) {
                const std::string name = (which == 0 ? "exp_avg." : "exp_avg_sq.") + k.params[i].name;
                const model::TensorInfo* info = f.find(name);
                MOERL_CHECK(info != nullptr, "checkpoint ", dir, ": optimizer state has no ", name);
                at::Tensor& dst = which == 0 ? k.m[i] : k.v[i];
                MOERL_CHECK(info->nbytes == static_cast<uint64_t>(dst.numel()) * 4, "checkpoint ", dir, ": ",
                            name, " has ", info->nbytes, " bytes, expected ", dst.numel() * 4);
                std::memcpy(dst.data_ptr(), f.data(*info), info->nbytes);
            }
        }
    });
}

int64_t PolicyTrainer::optimizer_steps() const { return impl_->step_count_for_update; }
int PolicyTrainer::num_ranks() const { return impl_->W; }

}  // namespace moerl::rl
