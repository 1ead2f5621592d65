#include "moerl/rl/trainer.hpp"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <sys/stat.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "cuda_ipc.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/ep/c10d_store.hpp"
#include "moerl/model/adamw.hpp"
#include "moerl/model/device_memory.hpp"
#include "moerl/model/model.hpp"
#include "moerl/model/safetensors.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/rollout.hpp"
#include "rank_group.hpp"

// AdamW as one fused CUDA kernel from LibTorch 2.1 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define MOERL_HAVE_FUSED_ADAMW 1
#endif

namespace moerl::rl {

namespace {
namespace fs = std::filesystem;

std::string unique_job() {
    static std::atomic<int> counter{0};
    return "rl-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

// Model inputs of a list of samples. Padded: one row per sample, right-padded. Packed: one row
// holding the samples one after another, each its own segment (no padding). What the model reads
// (ids, attn or segments, the log-probability mask, replay) stays on the host, where the model
// checks and lays it out without reading the GPU back; what the loss reads is on `device`.
struct Batch {
    at::Tensor ids, attn, segments, logprob_mask, replay;  // host
    at::Tensor resp_mask, behaviour, advantages;           // device
    int64_t num_tokens = 0;                                // response tokens
    int64_t total_tokens = 0;                              // prompt + response
    double attention_pairs = 0;                            // L (L + 1) / 2 a sequence
};

Batch make_batch(const std::vector<const ExperienceRecord*>& recs, const std::vector<double>& adv, int M,
                 int K, bool replay, bool packed, at::Device device) {
    Batch b;
    const int64_t N = static_cast<int64_t>(recs.size());
    auto length = [](const ExperienceRecord* r) {
        return static_cast<int64_t>(r->task.prompt_tokens.size() + r->trajectory.tokens.size());
    };
    int64_t rows = N, S = 1;
    if (packed) {
        rows = 1;
        S = 0;
        for (auto* r : recs) S += length(r);
        S = std::max<int64_t>(S, 1);
    } else {
        for (auto* r : recs) S = std::max(S, length(r));
    }
    at::Tensor ids = at::zeros({rows, S}, at::kLong);
    at::Tensor valid = at::zeros({rows, S}, at::kLong);  // attention mask, or segment ids when packed
    at::Tensor resp = at::zeros({rows, S}, at::kFloat);
    at::Tensor beh = at::zeros({rows, S}, at::kFloat);
    at::Tensor advs = packed ? at::zeros({rows, S}, at::kFloat) : at::tensor(adv, at::kDouble).to(at::kFloat);
    at::Tensor rep;
    if (replay) rep = at::full({rows, S, M, K}, -1, at::kShort);
    auto ids_a = ids.accessor<int64_t, 2>();
    auto valid_a = valid.accessor<int64_t, 2>();
    auto resp_a = resp.accessor<float, 2>();
    auto beh_a = beh.accessor<float, 2>();
    int64_t col = 0;
    for (int64_t i = 0; i < N; ++i) {
        const auto& p = recs[i]->task.prompt_tokens;
        const auto& t = recs[i]->trajectory;
        const int64_t row = packed ? 0 : i, at0 = packed ? col : 0, mark = packed ? i + 1 : 1;
        const int64_t P = static_cast<int64_t>(p.size()), L = length(recs[i]);
        for (int64_t j = 0; j < P; ++j) ids_a[row][at0 + j] = p[j], valid_a[row][at0 + j] = mark;
        for (size_t j = 0; j < t.tokens.size(); ++j) {
            ids_a[row][at0 + P + j] = t.tokens[j];
            valid_a[row][at0 + P + j] = mark;
            resp_a[row][at0 + P + j] = 1;
            beh_a[row][at0 + P + j] = t.logprobs[j];
        }
        if (packed) advs[0].narrow(0, at0, L).fill_(adv[i]);
        if (replay && !t.routing.empty() && t.num_moe_layers == M && t.top_k == K &&
            static_cast<int64_t>(t.routing.size()) == L * M * K) {
            rep[row].narrow(0, at0, L).copy_(at::tensor(t.routing, at::kShort).view({L, M, K}));
        }
        b.num_tokens += static_cast<int64_t>(t.tokens.size());
        b.total_tokens += L;
        b.attention_pairs += 0.5 * static_cast<double>(L) * static_cast<double>(L + 1);
        col += L;
    }
    b.ids = ids;
    (packed ? b.segments : b.attn) = valid;
    b.logprob_mask = resp > 0;
    if (replay) b.replay = rep;
    // Through pinned memory: no wait for the GPU's queue.
    b.resp_mask = model::to_device_async(resp, device, at::kFloat);
    b.behaviour = model::to_device_async(beh, device, at::kFloat);
    b.advantages = model::to_device_async(advs, device, at::kFloat);
    return b;
}

// Sample indices, longest first (ties in input order).
std::vector<size_t> longest_first(const std::vector<int64_t>& lengths) {
    std::vector<size_t> order(lengths.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lengths[a] > lengths[b]; });
    return order;
}

// Splits samples of lengths `lengths` into micro-batches of at most `budget` tokens, longest
// first into the first that has room (a sample longer than the budget gets one of its own).
std::vector<std::vector<size_t>> pack_first_fit(const std::vector<int64_t>& lengths, int64_t budget) {
    std::vector<std::vector<size_t>> bins;
    std::vector<int64_t> used;
    for (size_t i : longest_first(lengths)) {
        size_t k = 0;
        while (k < bins.size() && used[k] + lengths[i] > budget) ++k;
        if (k == bins.size()) bins.emplace_back(), used.push_back(0);
        bins[k].push_back(i);
        used[k] += lengths[i];
    }
    return bins;
}

// Splits samples into exactly `count` micro-batches (count <= samples), longest first into the
// one with the fewest tokens.
std::vector<std::vector<size_t>> pack_balanced(const std::vector<int64_t>& lengths, size_t count) {
    std::vector<std::vector<size_t>> bins(count);
    std::vector<int64_t> used(count, 0);
    for (size_t i : longest_first(lengths)) {
        const size_t k = std::min_element(used.begin(), used.end()) - used.begin();
        bins[k].push_back(i);
        used[k] += lengths[i];
    }
    return bins;
}

}  // namespace

// What one rank's micro-batches of one update add up to.
struct RankSums {
    TrainStats stats;                        // loss summed; the rest weighted by response tokens below
    double weighted_tokens = 0;              // response tokens behind the weighted means
    double diff_sum = 0;                     // sum of |behaviour - trainer| log-prob over response tokens
    double ratio_sum = 0, ratio_sq_sum = 0;  // exp(trainer - behaviour) and its square

    // As one fp64 tensor (summed over ranks), and back.
    at::Tensor pack() const {
        const TrainStats& t = stats;
        return at::tensor(
            std::vector<double>{t.loss, t.aux_loss, t.clip_fraction, t.mean_ratio, t.mean_is_weight,
                                t.truncated_fraction, t.kl, static_cast<double>(t.num_tokens),
                                static_cast<double>(t.total_tokens), weighted_tokens, diff_sum, ratio_sum,
                                ratio_sq_sum, t.attention_pairs},
            at::kDouble);
    }
    static RankSums unpack(const at::Tensor& packed) {
        const at::Tensor h = packed.to(at::kCPU, at::kDouble).contiguous();
        const double* v = h.data_ptr<double>();
        RankSums s;
        TrainStats& t = s.stats;
        t.loss = v[0], t.aux_loss = v[1], t.clip_fraction = v[2], t.mean_ratio = v[3],
        t.mean_is_weight = v[4];
        t.truncated_fraction = v[5], t.kl = v[6];
        t.num_tokens = std::llround(v[7]), t.total_tokens = std::llround(v[8]);
        s.weighted_tokens = v[9], s.diff_sum = v[10], s.ratio_sum = v[11], s.ratio_sq_sum = v[12];
        t.attention_pairs = v[13];
        return s;
    }
};

struct PolicyTrainer::Impl {
    struct Rank {
        std::unique_ptr<ep::Store> store;
        std::unique_ptr<ep::Buffer> buffer;
        // `model` runs forward and backward in the training dtype; with bf16 `master` holds the fp32
        // weights AdamW updates (and checkpoints save), copied into `model` after each step.
        std::unique_ptr<model::MoeModel> model, master, ref;
        std::vector<model::NamedParameter> params;  // model's (their grads)
        std::vector<at::Tensor> weights;            // what AdamW updates: master's or params'
        // Per parameter: whether this rank updates it. Its own experts, and its share of the dense
        // weights (every rank holds those and their summed gradients, but only one keeps their
        // AdamW moments and steps them; the others take the result: the optimizer state is sharded).
        std::vector<bool> updates;
        // AdamW's moments (of train.moments_dtype); undefined for the dense weights of other ranks.
        std::vector<at::Tensor> m, v;
    };
    RunConfig cfg;
    int W = 1;               // ranks in all
    int first_rank = 0;      // the rank of ranks[0]: this process's rank under `processes`
    bool processes = false;  // one rank per process (procs); else W threads here
    RoleProcesses procs;
    std::unique_ptr<detail::RankGroup> group;
    at::Device device = at::kCPU;
    at::ScalarType dtype = at::kFloat;
    std::string store_dir;
    std::vector<Rank> ranks;  // this process's
    int64_t step = 0;
    RankSums total;         // every rank's sums of the last update
    double first_norm = 0;  // gradient norm of the last update's first epoch

    // Runs fn(r) for each rank of this process (threads when several), rethrows the first failure.
    void on_ranks(const std::function<void(int)>& fn) {
        if (ranks.size() == 1) return fn(0);
        std::mutex mu;
        std::exception_ptr failure;
        std::vector<std::thread> threads;
        for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
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

    // The weights AdamW owns, as a model (save and load go through it).
    model::MoeModel& owner(Rank& k) { return k.master ? *k.master : *k.model; }

    // model <- master, after the optimizer step or a load.
    void copy_master(Rank& k) {
        if (!k.master) return;
        c10::NoGradGuard g;
        for (size_t i = 0; i < k.params.size(); ++i) k.params[i].tensor.copy_(k.weights[i]);
    }

    void init(int r, int max_tokens) {
        Rank& k = ranks[r];
        model::ModelOptions opts;
        opts.device = device;
        opts.dtype = dtype;
        if (W > 1) {
            if (processes) {
                k.store = std::make_unique<ep::C10dStore>(
                    c10::make_intrusive<c10d::PrefixStore>("trainer-ep", procs.store));
            } else {
                k.store = ep::make_file_store(store_dir);
            }
            ep::Config ec = model::ep_config_for(cfg.model, dtype, W, first_rank + r, max_tokens);
            ec.set_transport(processes ? procs.ep_transport : "host");
            if (device.is_cuda()) ec.device = device.index();
            ec.job_id = job;
            ec.timeout_s = processes ? procs.timeout_s : 120;
            k.buffer = std::make_unique<ep::Buffer>(ec, k.store.get());
            opts.ep = k.buffer.get();
        }
        k.model = std::make_unique<model::MoeModel>(cfg.model, opts);
        if (dtype != at::kFloat) {
            model::ModelOptions master_opts = opts;
            master_opts.dtype = at::kFloat;
            k.master = std::make_unique<model::MoeModel>(cfg.model, master_opts);
            k.master->set_requires_grad(false);
        }
        if (cfg.model_path.empty()) {
            owner(k).init_random(cfg.seed);
        } else {
            owner(k).load_weights(cfg.model_path);
        }
        k.params = k.model->named_parameters();
        if (k.master) {
            for (auto& p : k.master->named_parameters()) k.weights.push_back(p.tensor);
        } else {
            for (auto& p : k.params) k.weights.push_back(p.tensor);
        }
        MOERL_CHECK(k.weights.size() == k.params.size(), "trainer: master weights do not match the model");
        copy_master(k);
        if (cfg.grpo.kl_coef > 0) {
            k.ref = std::make_unique<model::MoeModel>(cfg.model, opts);
            c10::NoGradGuard g;
            auto src = k.model->state_dict();
            auto dst = k.ref->state_dict();
            for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second);
            k.ref->set_requires_grad(false);
        }
        k.updates = updated_here(k.params, first_rank + r);
        // bf16 moments live only in the GPU update's pass (config validation asks for cuda + bf16).
        const bool bf16_moments = cfg.moments_dtype == "bf16";
        MOERL_CHECK(!bf16_moments || (k.master && device.is_cuda() && model::adamw_master_available()),
                    "train.moments_dtype: bf16 needs the GPU trainer's update pass (train.device: cuda, "
                    "train.dtype: bf16, a build with the CUDA trainer kernels)");
        const at::ScalarType moments = bf16_moments ? at::kBFloat16 : at::kFloat;
        for (size_t i = 0; i < k.weights.size(); ++i) {
            const at::Tensor& w = k.weights[i];
            k.m.push_back(k.updates[i] ? at::zeros_like(w, w.options().dtype(moments)).detach()
                                       : at::Tensor());
            k.v.push_back(k.updates[i] ? at::zeros_like(w, w.options().dtype(moments)).detach()
                                       : at::Tensor());
        }
    }

    // Which parameters rank `rank` updates: every expert it holds, and the dense weights it owns:
    // each dense weight, in order, goes to the rank with the fewest dense elements so far (the
    // lowest on a tie), the same on every rank.
    std::vector<bool> updated_here(const std::vector<model::NamedParameter>& params, int rank) const {
        std::vector<int64_t> load(W, 0);
        std::vector<bool> out;
        for (const auto& p : params) {
            if (p.expert) {
                out.push_back(true);
                continue;
            }
            const int owner = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
            load[owner] += p.tensor.numel();
            out.push_back(owner == rank);
        }
        return out;
    }
    std::string job = unique_job();

    // The sampler's log-probabilities (temperature, allowed tokens) of the response tokens only:
    // no [B, S, V] logits are made.
    model::ForwardOutput forward(const model::MoeModel& net, const Batch& b) const {
        model::ForwardOptions fo;
        fo.return_logits = false;
        fo.compute_logprobs = true;
        fo.logprob_mask = b.logprob_mask;
        fo.logprob_temperature = cfg.sampling.temperature;
        fo.logprob_bias = token_bias;
        if (cfg.routing_replay) fo.replay_routing = b.replay;
        if (b.segments.defined()) fo.segment_ids = b.segments;
        fo.activation_checkpointing = cfg.activation_checkpointing;
        return net.forward(b.ids, b.attn, fo);
    }
    at::Tensor token_bias;  // allowed_token_bias of the sampling config, on the device

    // One update of rank r: ppo_epochs passes over its micro-batches, each a forward and backward
    // (gradients accumulate), then one optimizer step per pass.
    void rank_update(int r, const std::vector<const ExperienceRecord*>& recs, const std::vector<double>& adv,
                     const std::vector<std::vector<size_t>>& micro, int64_t global_tokens) {
        Rank& k = ranks[r];
        const auto& mc = cfg.model;
        const bool packed = cfg.micro_batch_tokens > 0;
        std::vector<Batch> batches;
        for (const auto& part : micro) {
            std::vector<const ExperienceRecord*> sub;
            std::vector<double> sub_adv;
            for (size_t i : part) sub.push_back(recs[i]), sub_adv.push_back(adv[i]);
            batches.push_back(make_batch(sub, sub_adv, mc.num_moe_layers(), mc.num_experts_per_tok,
                                         cfg.routing_replay, packed, device));
        }
        const size_t n = batches.size();
        std::vector<at::Tensor> prox(n), ref_lp(n);
        if (k.ref) {
            c10::NoGradGuard g;
            for (size_t i = 0; i < n; ++i) ref_lp[i] = forward(*k.ref, batches[i]).token_logprobs;
        }
        RankSums sums;
        // The load-balancing loss is not a sum over tokens: each micro-batch's counts 1/n.
        const double aux_scale = mc.router_aux_loss_coef / W / static_cast<double>(std::max<size_t>(1, n));
        for (int epoch = 0; epoch < cfg.ppo_epochs; ++epoch) {
            // Each micro-batch's statistics stay on the device until the update is queued: one
            // copy to the host an epoch (with the gradient norm), not four a micro-batch, so the GPU
            // is not left waiting between the backward and the update.
            std::vector<at::Tensor> rows(n);
            for (size_t i = 0; i < n; ++i) {
                const Batch& b = batches[i];
                model::ForwardOutput out = forward(*k.model, b);
                at::Tensor logp = out.token_logprobs;
                if (epoch == 0) prox[i] = logp.detach();
                GrpoInputs in{logp,
                              prox[i],
                              b.behaviour,
                              b.advantages,
                              b.resp_mask,
                              ref_lp[i],
                              static_cast<double>(global_tokens)};
                GrpoOutput g = grpo_loss_queued(in, cfg.grpo);
                (g.loss + aux_scale * out.aux_loss).backward();
                c10::NoGradGuard no_grad;
                // Training-inference mismatch, on the weights that sampled (when on-policy).
                at::Tensor d = (prox[i] - b.behaviour) * b.resp_mask;
                at::Tensor ratio = at::exp(prox[i] - b.behaviour) * b.resp_mask;
                rows[i] =
                    at::cat({g.sums.to(at::kFloat),
                             at::stack({g.loss.detach().to(at::kFloat), out.aux_loss.detach().to(at::kFloat),
                                        d.abs().sum(), ratio.sum(), (ratio * ratio).sum()})});
            }
            const at::Tensor norm_t = step_optimizer(r, epoch);
            at::Tensor host = at::stack(rows).reshape(-1);
            // A norm on the device comes along in the same copy; one summed on the host is exact as it is.
            if (norm_t.is_cuda()) host = at::cat({host, norm_t.to(host.scalar_type()).reshape(1)});
            host = host.to(at::kCPU, at::kDouble).contiguous();
            const double* v = host.data_ptr<double>();
            double clip = 0, weighted = 0;
            for (size_t i = 0; i < n; ++i) {
                const double* row = v + i * kStatsRow;
                GrpoOutput g;
                g.read_stats(row);
                const double w = static_cast<double>(batches[i].num_tokens);
                clip += w * g.clip_fraction;
                weighted += w;
                if (epoch > 0) continue;
                TrainStats& st = sums.stats;
                st.loss += row[kLoss];
                st.aux_loss += row[kAuxLoss] / static_cast<double>(n);
                st.mean_ratio += w * g.mean_ratio;
                st.mean_is_weight += w * g.mean_is_weight;
                st.truncated_fraction += w * g.truncated_fraction;
                st.kl += w * g.kl;
                sums.diff_sum += row[kDiff];
                sums.ratio_sum += row[kRatio];
                sums.ratio_sq_sum += row[kRatioSq];
            }
            const double grad_norm = norm_t.is_cuda() ? v[n * kStatsRow] : norm_t.item<double>();
            if (epoch == 0) {
                if (r == 0) first_norm = grad_norm;  // the gradient of the logged loss
                sums.weighted_tokens = weighted;
            }
            // The last epoch's clip fraction is the informative one.
            sums.stats.clip_fraction = weighted > 0 ? clip : 0;
        }
        for (auto& b : batches)
            sums.stats.num_tokens += b.num_tokens, sums.stats.total_tokens += b.total_tokens,
                sums.stats.attention_pairs += b.attention_pairs;
        at::Tensor every_rank = sums.pack();
        if (W > 1) group->sum(r, every_rank);
        if (r == 0) total = RankSums::unpack(every_rank);
    }

    // A micro-batch's statistics on the device, in this order: GrpoOutput::sums, the loss, the
    // load-balancing loss, then the mismatch sums |prox - behaviour|, ratio and ratio^2.
    static constexpr size_t kLoss = GrpoOutput::kNumSums, kAuxLoss = kLoss + 1, kDiff = kLoss + 2,
                            kRatio = kLoss + 3, kRatioSq = kLoss + 4, kStatsRow = kLoss + 5;

    // Sums dense gradients across ranks, clips by the global norm, applies AdamW (to the fp32
    // master weights when training in bf16). Returns the global norm before clipping (the same on
    // every rank), as a scalar tensor: on one GPU rank it stays on the device, and the clipping
    // scale with it, so the update is queued without waiting for the backward to finish.
    at::Tensor step_optimizer(int r, int epoch) {
        Rank& k = ranks[r];
        c10::NoGradGuard g;
        // bf16 on a GPU: one pass a parameter (model::adamw_master_step) reads the gradients as the
        // backward left them and writes the model's bf16 weights itself. Only the dense gradients
        // summed over ranks go through one fp32 vector; on one rank none do.
        const bool master_kernel = k.master && k.weights.front().is_cuda() && model::adamw_master_available();
        auto summed = [&](const model::NamedParameter& p) { return !p.expert && (W > 1 || !master_kernel); };
        std::vector<at::Tensor> dense, own;  // own: gradients whose norm is summed from their parts
        for (auto& p : k.params) {
            at::Tensor grad = p.tensor.grad();
            if (!grad.defined())
                grad = at::zeros_like(p.tensor, p.tensor.options().dtype(at::kFloat));
            else if (!master_kernel || summed(p))
                grad = grad.to(at::kFloat);
            (summed(p) ? dense : own).push_back(grad);
        }
        at::Tensor flat =
            dense.empty() ? at::zeros({0}, k.weights.front().options().dtype(at::kFloat)) : at::cat([&] {
                std::vector<at::Tensor> v;
                for (auto& d : dense) v.push_back(d.reshape(-1));
                return v;
            }());
        at::Tensor own_sq_t;  // on the device
        if (!own.empty()) {
            std::vector<at::Tensor> norms;
            for (auto& e : own) norms.push_back(at::linalg_vector_norm(e, 2, {}, false, at::kFloat));
            own_sq_t = at::stack(norms).pow(2).sum();
        }
        // One rank with the AdamW pass: every gradient is its own, and the norm never leaves the device.
        const bool norm_on_device = master_kernel && W == 1 && flat.numel() == 0 && own_sq_t.defined();
        at::Tensor norm_t, scale_t;
        double scale = 1.0;  // when the clip is computed on the host
        if (norm_on_device) {
            norm_t = own_sq_t.sqrt();
            if (cfg.grad_clip > 0)
                scale_t = at::where(norm_t > cfg.grad_clip, cfg.grad_clip / (norm_t + 1e-6),
                                    at::ones({}, norm_t.options()))
                              .reshape(1);
        } else {
            double own_sq = own_sq_t.defined() ? own_sq_t.item<double>() : 0.0;  // one sync for all
            if (W > 1) {
                group->sum(r, flat);
                at::Tensor sq = at::full({1}, own_sq, at::kDouble);
                group->sum(r, sq);
                own_sq = sq.item<double>();
            }
            const double flat_sq = flat.numel() == 0 ? 0.0 : flat.pow(2).sum().item<double>();
            const double norm = std::sqrt(flat_sq + own_sq);
            scale = (cfg.grad_clip > 0 && norm > cfg.grad_clip) ? cfg.grad_clip / (norm + 1e-6) : 1.0;
            norm_t = at::scalar_tensor(norm, at::kDouble);
        }
        const int64_t t = step_count_for_update + epoch + 1;
        const double bc1 = 1 - std::pow(cfg.beta1, static_cast<double>(t));
        const double bc2 = 1 - std::pow(cfg.beta2, static_cast<double>(t));
        std::vector<at::Tensor> grads;
        int64_t offset = 0;
        size_t ei = 0;
        for (size_t i = 0; i < k.params.size(); ++i) {
            const at::Tensor& p = k.weights[i];
            if (!summed(k.params[i])) {
                grads.push_back(own[ei++]);
            } else {
                grads.push_back(flat.narrow(0, offset, p.numel()).view(p.sizes()));
                offset += p.numel();
            }
        }
        if (master_kernel) {
            model::AdamwStep step{lr, cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.adam_eps, t, scale};
            step.grad_scale_on_device = scale_t;
            for (size_t i = 0; i < k.params.size(); ++i) {
                if (!k.updates[i]) continue;
                // A different stream of rounding bits for each step and tensor (bf16 moments).
                step.rounding_seed =
                    static_cast<uint32_t>(t * 0x9e3779b1u) ^ static_cast<uint32_t>(i * 0x85ebca6bu);
                model::adamw_master_step(k.weights[i], grads[i].contiguous(), k.m[i], k.v[i],
                                         k.params[i].tensor, step);
            }
            share_dense_updates(r, flat);
            // The dense weights another rank updated came in with the share above.
            for (size_t i = 0; i < k.params.size() && W > 1; ++i)
                if (!k.updates[i]) k.params[i].tensor.copy_(k.weights[i]);
            k.model->zero_grad();
            if (W > 1) group->barrier(r);
            return norm_t;
        }
#ifdef MOERL_HAVE_FUSED_ADAMW
        if (k.weights.front().is_cuda()) {
            // One fused kernel over every tensor (PyTorch's AdamW(fused=True) step); the step count
            // is the one after this step, as torch.optim passes it. The clipping goes in as its
            // gradient scale (the kernel divides by it): no pass of its own over the gradients.
            std::vector<at::Tensor> ws, gs, ms, vs;
            for (size_t i = 0; i < k.params.size(); ++i)
                if (k.updates[i])
                    ws.push_back(k.weights[i]), gs.push_back(grads[i]), ms.push_back(k.m[i]),
                        vs.push_back(k.v[i]);
            std::vector<at::Tensor> steps(gs.size(),
                                          at::full({}, static_cast<double>(t), grads.front().options()));
            if (!gs.empty() && scale != 1.0)
                at::_fused_adamw_(ws, gs, ms, vs, {}, steps, lr, cfg.beta1, cfg.beta2, cfg.weight_decay,
                                  cfg.adam_eps, /*amsgrad=*/false, /*maximize=*/false,
                                  at::full({1}, 1.0 / scale, grads.front().options()));
            else if (!gs.empty())
                at::_fused_adamw_(ws, gs, ms, vs, {}, steps, lr, cfg.beta1, cfg.beta2, cfg.weight_decay,
                                  cfg.adam_eps, /*amsgrad=*/false, /*maximize=*/false);
            share_dense_updates(r, flat);
            k.model->zero_grad();
            copy_master(k);
            if (W > 1) group->barrier(r);
            return norm_t;
        }
#endif
        for (size_t i = 0; i < k.params.size(); ++i) {
            if (!k.updates[i]) continue;
            at::Tensor p = k.weights[i];
            at::Tensor grad = grads[i] * scale;
            k.m[i].mul_(cfg.beta1).add_(grad, 1 - cfg.beta1);
            k.v[i].mul_(cfg.beta2).addcmul_(grad, grad, 1 - cfg.beta2);
            if (cfg.weight_decay > 0) p.mul_(1 - lr * cfg.weight_decay);
            at::Tensor denom = (k.v[i] / bc2).sqrt_().add_(cfg.adam_eps);
            p.addcdiv_(k.m[i], denom, -lr / bc1);
        }
        share_dense_updates(r, flat);
        k.model->zero_grad();
        copy_master(k);
        if (W > 1) group->barrier(r);
        return norm_t;
    }

    // Every dense weight from the rank that updated it, to the others: a sum over ranks in which
    // only the owner's copy is nonzero (x + 0 is x: every rank ends with the owner's bits). `like`:
    // a dense-sized fp32 tensor on the weights' device.
    void share_dense_updates(int r, const at::Tensor& like) {
        if (W == 1) return;
        Rank& k = ranks[r];
        at::Tensor updated = at::zeros_like(like);
        int64_t offset = 0;
        for (size_t i = 0; i < k.params.size(); ++i) {
            if (k.params[i].expert) continue;
            const int64_t n = k.weights[i].numel();
            if (k.updates[i]) updated.narrow(0, offset, n).copy_(k.weights[i].reshape(-1));
            offset += n;
        }
        group->sum(r, updated);
        offset = 0;
        for (size_t i = 0; i < k.params.size(); ++i) {
            if (k.params[i].expert) continue;
            const int64_t n = k.weights[i].numel();
            if (!k.updates[i]) k.weights[i].copy_(updated.narrow(0, offset, n).view(k.weights[i].sizes()));
            offset += n;
        }
    }
    int64_t step_count_for_update = 0;  // optimizer steps before the current update
    double lr = 0;                      // learning rate of the current update (schedule)

    // ---- the update, saves and loads, on every rank of this process ----
    TrainStats update_here(const std::vector<ExperienceRecord>& batch,
                           const std::vector<double>& advantages) {
        MOERL_CHECK(batch.size() == advantages.size(), "update: ", batch.size(), " samples but ",
                    advantages.size(), " advantages");
        MOERL_CHECK(static_cast<int>(batch.size()) >= W, "update: ", batch.size(), " samples cannot feed ", W,
                    " ranks");
        int64_t global_tokens = 0;
        for (const auto& e : batch) global_tokens += static_cast<int64_t>(e.trajectory.tokens.size());
        std::vector<std::vector<const ExperienceRecord*>> parts(W);
        std::vector<std::vector<double>> adv(W);
        for (size_t i = 0; i < batch.size(); ++i) {
            parts[i % W].push_back(&batch[i]);
            adv[i % W].push_back(advantages[i]);
        }
        // Micro-batches: every rank runs the same number (the MoE layers are collective).
        std::vector<std::vector<std::vector<size_t>>> micro(W);
        if (cfg.micro_batch_tokens <= 0) {
            for (int r = 0; r < W; ++r) {
                micro[r].emplace_back(parts[r].size());
                for (size_t i = 0; i < parts[r].size(); ++i) micro[r][0][i] = i;
            }
        } else {
            std::vector<std::vector<int64_t>> lengths(W);
            size_t most = 0, fewest_samples = SIZE_MAX;
            for (int r = 0; r < W; ++r) {
                for (auto* e : parts[r])
                    lengths[r].push_back(
                        static_cast<int64_t>(e->task.prompt_tokens.size() + e->trajectory.tokens.size()));
                micro[r] = pack_first_fit(lengths[r], cfg.micro_batch_tokens);
                most = std::max(most, micro[r].size());
                fewest_samples = std::min(fewest_samples, parts[r].size());
            }
            const size_t count = std::min(most, fewest_samples);
            for (int r = 0; r < W; ++r)
                if (micro[r].size() != count) micro[r] = pack_balanced(lengths[r], count);
        }
        lr = cfg.lr_at(step_count_for_update / cfg.ppo_epochs);
        on_ranks([&](int r) {
            const int g = first_rank + r;
            rank_update(r, parts[g], adv[g], micro[g], std::max<int64_t>(1, global_tokens));
        });
        const RankSums& s = total;
        TrainStats t = s.stats;  // the loss: each rank's is already divided by the global count
        t.aux_loss /= W;
        const double w = std::max(1.0, s.weighted_tokens);
        t.clip_fraction /= w;
        t.mean_ratio /= w;
        t.mean_is_weight /= w;
        t.truncated_fraction /= w;
        t.kl /= w;
        const double tokens = std::max<double>(1.0, static_cast<double>(t.num_tokens));
        t.logprob_diff = s.diff_sum / tokens;
        const double mean_ratio = s.ratio_sum / tokens;
        t.behaviour_ratio_std = std::sqrt(std::max(0.0, s.ratio_sq_sum / tokens - mean_ratio * mean_ratio));
        t.grad_norm = first_norm;
        t.lr = lr;
        step_count_for_update += cfg.ppo_epochs;
        step = step_count_for_update;
        return t;
    }

    void save_weights_here(const std::string& dir) {
        on_ranks([&](int r) { owner(ranks[r]).save_pretrained(dir, 0, "float32"); });
        // Every rank's shard is in rank 0's directory when rank 0 returns.
        if (processes) collect_on_first(dir, [&](int q) { return model::shard_file_name(q, W); });
    }

    // ---- files between the processes: ranks on machines without a shared filesystem ----
    static std::string read_whole(const fs::path& p) {
        std::ifstream in(p, std::ios::binary);
        MOERL_CHECK(in.good(), "cannot read ", p.string());
        std::ostringstream ss;
        ss << in.rdbuf();
        return ss.str();
    }
    static void write_whole(const fs::path& p, const std::string& bytes) {
        fs::create_directories(p.parent_path());
        const fs::path tmp = p.string() + ".part";
        {
            std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
            out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
            out.close();
            MOERL_CHECK(out.good(), "cannot write ", tmp.string());
        }
        fs::rename(tmp, p);
    }
    // Which file `p` is: device, inode, size and modification time (empty when there is none). Equal
    // on two ranks exactly when they see one file (a shared filesystem), without reading it: the
    // policy's weights are handed over every step.
    static std::string identity_of(const fs::path& p) {
        struct stat st {};
        if (::stat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
        return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" +
               std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
               std::to_string(st.st_mtim.tv_nsec);
    }

    // Ranks 1.. hand rank 0 the file each wrote into `dir` (name_of(rank)); rank 0 takes the ones
    // it does not already see (as it does on a shared filesystem).
    void collect_on_first(const std::string& dir, const std::function<std::string(int)>& name_of) {
        const std::vector<std::string> identities =
            group->gather(first_rank > 0 ? identity_of(fs::path(dir) / name_of(first_rank)) : "");
        std::string wanted;
        if (first_rank == 0) {
            nlohmann::json ranks_wanted = nlohmann::json::array();
            for (int q = 1; q < W; ++q)
                if (identity_of(fs::path(dir) / name_of(q)) != identities[q]) ranks_wanted.push_back(q);
            wanted = ranks_wanted.dump();
        }
        group->broadcast(wanted);
        const auto who = nlohmann::json::parse(wanted).get<std::vector<int>>();
        const bool mine_wanted = std::find(who.begin(), who.end(), first_rank) != who.end();
        const std::vector<std::string> files =
            group->gather(mine_wanted ? read_whole(fs::path(dir) / name_of(first_rank)) : "");
        if (first_rank == 0)
            for (int q : who) write_whole(fs::path(dir) / name_of(q), files[q]);
        if (mine_wanted) {  // rank 0 is on another filesystem: leave nothing behind here
            std::error_code ec;
            fs::remove(fs::path(dir) / name_of(first_rank), ec);
            fs::remove(dir, ec);  // when empty
        }
    }

    // Every rank gets the files of rank 0's `dir` it does not see itself.
    void spread_from_first(const std::string& dir) {
        std::string listing;
        if (first_rank == 0) {
            nlohmann::json files = nlohmann::json::object();
            for (const auto& e : fs::directory_iterator(dir))
                if (e.is_regular_file()) files[e.path().filename().string()] = identity_of(e.path());
            listing = files.dump();
        }
        group->broadcast(listing);
        nlohmann::json needed = nlohmann::json::array();
        const nlohmann::json files = nlohmann::json::parse(listing);
        for (const auto& [name, identity] : files.items())
            if (first_rank > 0 && identity_of(fs::path(dir) / name) != identity.get<std::string>())
                needed.push_back(name);
        std::string wanted;
        if (first_rank == 0) {
            std::set<std::string> all;
            for (const std::string& part : group->gather(""))
                if (!part.empty())
                    for (const auto& n : nlohmann::json::parse(part)) all.insert(n.get<std::string>());
            wanted = nlohmann::json(all).dump();
        } else {
            group->gather(needed.dump());
        }
        group->broadcast(wanted);
        for (const auto& n : nlohmann::json::parse(wanted)) {
            const std::string name = n.get<std::string>();
            std::string bytes = first_rank == 0 ? read_whole(fs::path(dir) / name) : "";
            group->broadcast(bytes);
            if (std::find(needed.begin(), needed.end(), n) != needed.end())
                write_whole(fs::path(dir) / name, bytes);
        }
        received_ = needed.get<std::vector<std::string>>();
    }
    std::vector<std::string> received_;  // what the last spread_from_first wrote here

    // Removes what spread_from_first wrote into `dir` (rank 0 removes its own copy after a load).
    void forget_received(const std::string& dir) {
        std::error_code ec;
        for (const auto& name : received_) fs::remove(fs::path(dir) / name, ec);
        if (!received_.empty()) fs::remove(dir, ec);  // when empty
        received_.clear();
    }

    void save_optimizer_here(const std::string& dir) {
        fs::create_directories(dir);
        on_ranks([&](int r) {
            auto& k = ranks[r];
            std::vector<model::TensorBytes> tensors;
            std::vector<at::Tensor> keep;
            for (size_t i = 0; i < k.params.size(); ++i) {
                if (!k.updates[i]) continue;  // another rank's share of the dense weights
                for (int which = 0; which < 2; ++which) {
                    at::Tensor t = (which == 0 ? k.m[i] : k.v[i]).to(at::kCPU, at::kFloat).contiguous();
                    keep.push_back(t);
                    tensors.push_back({(which == 0 ? "exp_avg." : "exp_avg_sq.") + k.params[i].name,
                                       model::StDType::kF32,
                                       std::vector<int64_t>(t.sizes().begin(), t.sizes().end()), t.data_ptr(),
                                       static_cast<uint64_t>(t.numel()) * 4});
                }
            }
            model::write_safetensors(
                (fs::path(dir) / ("optimizer-rank" + std::to_string(first_rank + r) + ".safetensors"))
                    .string(),
                tensors);
        });
        if (first_rank == 0)
            std::ofstream(fs::path(dir) / "optimizer.json")
                << nlohmann::json{{"step", step_count_for_update}, {"ranks", W}, {"type", "adamw"}}.dump(2);
        if (processes)
            collect_on_first(dir,
                             [](int q) { return "optimizer-rank" + std::to_string(q) + ".safetensors"; });
    }

    void load_here(const std::string& dir) {
        if (processes) spread_from_first(dir);  // a rank on another machine gets the checkpoint
        on_ranks([&](int r) {
            owner(ranks[r]).load_weights(dir);
            copy_master(ranks[r]);
        });
        const fs::path opt = fs::path(dir) / "optimizer.json";
        if (fs::exists(opt)) {
            std::ifstream in(opt);
            auto j = nlohmann::json::parse(in);
            MOERL_CHECK(j.at("ranks").get<int>() == W, "checkpoint ", dir, ": optimizer state of ",
                        j.at("ranks").get<int>(), " EP ranks, but this run has ranks.ep = ", W);
            step_count_for_update = step = j.at("step").get<int64_t>();
            on_ranks([&](int r) {
                auto& k = ranks[r];
                model::SafetensorsFile f(
                    (fs::path(dir) / ("optimizer-rank" + std::to_string(first_rank + r) + ".safetensors"))
                        .string());
                c10::NoGradGuard g;
                for (size_t i = 0; i < k.params.size(); ++i) {
                    if (!k.updates[i]) continue;
                    for (int which = 0; which < 2; ++which) {
                        const std::string name = (which == 0 ? "exp_avg." : "exp_avg_sq.") + k.params[i].name;
                        const model::TensorInfo* info = f.find(name);
                        MOERL_CHECK(info != nullptr, "checkpoint ", dir, ": optimizer state has no ", name);
                        at::Tensor& dst = which == 0 ? k.m[i] : k.v[i];
                        MOERL_CHECK(info->nbytes == static_cast<uint64_t>(dst.numel()) * 4, "checkpoint ",
                                    dir, ": ", name, " has ", info->nbytes, " bytes, expected ",
                                    dst.numel() * 4);
                        at::Tensor host = at::empty(dst.sizes(), at::kFloat);
                        std::memcpy(host.data_ptr(), f.data(*info), info->nbytes);
                        dst.copy_(host);
                    }
                }
            });
        }
        // Rank 0 may remove `dir` once it returns: every rank has read it by then.
        if (processes) group->barrier(0);
        forget_received(dir);
    }

    // ---- CUDA IPC export of this process's ranks ----
    std::unique_ptr<detail::IpcExporter> exporter;  // made at the first export
    int64_t writes = 0;                             // rank 0: updates and loads begun

    // {"export": IpcProcess JSON} or {"error": why this process cannot export its weights}.
    std::string export_here() {
        try {
            if (!exporter) exporter = std::make_unique<detail::IpcExporter>();
            std::vector<detail::IpcSource> sources;
            for (size_t r = 0; r < ranks.size(); ++r)
                sources.push_back({first_rank + static_cast<int>(r), ranks[r].model->first_local_expert(),
                                   ranks[r].model->named_parameters()});
            return nlohmann::json{{"export", detail::ipc_process_to_json(exporter->export_weights(sources))}}
                .dump();
        } catch (const Error& e) {
            return nlohmann::json{{"error", e.message()}}.dump();
        } catch (const std::exception& e) {
            return nlohmann::json{{"error", e.what()}}.dump();
        }
    }

    // ---- rank 0's calls, carried to the other processes ----
    // A call is its JSON (one line) and, after a newline, `tail`: bytes carried as they are (an
    // update's experience records, whose megabytes a JSON string would escape and unescape).
    void call(const nlohmann::json& what, const std::string& tail = {}) {
        if (processes) group->send_call(tail.empty() ? what.dump() : what.dump() + "\n" + tail);
    }
    nlohmann::json next_call(std::string* tail = nullptr) {
        std::string bytes = group->receive_call();
        const size_t end = bytes.find('\n');
        if (tail != nullptr) *tail = end == std::string::npos ? std::string() : bytes.substr(end + 1);
        if (end != std::string::npos) bytes.resize(end);
        return nlohmann::json::parse(bytes);
    }
};

PolicyTrainer::PolicyTrainer(const RunConfig& config, const std::string& work_dir,
                             const RoleProcesses* processes)
    : impl_(std::make_unique<Impl>()) {
    Impl& m = *impl_;
    m.cfg = config;
    m.W = config.ep_ranks;
    const bool spread = processes != nullptr && processes->world_size > 1;
    if (spread) {
        const RoleProcesses& p = *processes;
        MOERL_CHECK(p.rank >= 0 && p.rank < p.world_size, "trainer processes: rank ", p.rank, " of ",
                    p.world_size);
        MOERL_CHECK(config.ep_ranks == p.world_size, config.source, ": the trainer runs as ", p.world_size,
                    " processes, one expert-parallel rank each, but ranks.ep is ", config.ep_ranks);
        m.processes = true;
        m.procs = p;
        m.first_rank = p.rank;
        m.job = "trainer";  // one per store: every process must name the same group
    }
    if (config.train_device == "cuda") {
        MOERL_CHECK(at::hasCUDA(), config.source,
                    ": train.device: cuda, but this LibTorch build or machine has no CUDA device");
        const int gpus = static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
        m.device =
            at::Device(at::kCUDA, spread ? static_cast<c10::DeviceIndex>(processes->local_rank % gpus) : 0);
    }
    m.dtype = config.train_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    m.token_bias = allowed_token_bias(config.sampling, config.model.vocab_size,
                                      at::TensorOptions().device(m.device).dtype(at::kFloat));
    if (spread) {
        m.group = detail::make_process_group(*processes, "trainer");
        m.ranks.resize(1);
    } else {
        m.group = detail::make_thread_group(m.W);
        m.ranks.resize(m.W);
        m.store_dir = (fs::path(work_dir) / ("ep-" + m.job)).string();
        fs::create_directories(m.store_dir);
    }
    const int64_t max_len = config.max_sequence_tokens();
    const int64_t samples = (int64_t{config.prompts_per_step} * config.group_size + m.W - 1) / m.W;
    const int max_tokens = static_cast<int>(samples * max_len);
    m.on_ranks([&](int r) { m.init(r, max_tokens); });
}

PolicyTrainer::~PolicyTrainer() {
    if (!impl_) return;
    try {
        if (impl_->processes && impl_->first_rank == 0) impl_->call({{"call", "stop"}});
    } catch (...) {
    }
    try {
        impl_->on_ranks([&](int r) {
            if (impl_->ranks[r].buffer) impl_->ranks[r].buffer->destroy();
        });
        if (!impl_->store_dir.empty()) std::filesystem::remove_all(impl_->store_dir);
    } catch (...) {
    }
}

TrainStats PolicyTrainer::update(const std::vector<ExperienceRecord>& batch,
                                 const std::vector<double>& advantages) {
    Impl& m = *impl_;
    ++m.writes;
    if (m.processes) {
        std::string records;
        std::vector<size_t> sizes;
        for (const auto& e : batch) {
            const std::string text = to_json(e);
            sizes.push_back(text.size());
            records += text;
        }
        m.call({{"call", "update"}, {"record_bytes", sizes}, {"advantages", advantages}}, records);
    }
    try {
        TrainStats stats = m.update_here(batch, advantages);
        // The update's last kernels (AdamW, the masters' bf16 copies) are still queued when it
        // returns: waiting here makes its time the update's, not that of whatever runs next on the
        // device (the weight sync).
        const at::Device device = m.ranks.front().model->options().device;
        if (device.is_cuda()) at::detail::getCUDAHooks().deviceSynchronize(device.index());
        return stats;
    } catch (const c10::OutOfMemoryError& e) {
        int64_t tokens = 0;
        for (const auto& r : batch)
            tokens += static_cast<int64_t>(r.task.prompt_tokens.size() + r.trajectory.tokens.size());
        const std::string what = e.what_without_backtrace();
        MOERL_FAIL("train: the GPU ran out of memory in the update of ", batch.size(), " samples (", tokens,
                   " tokens, train.micro_batch_tokens = ", m.cfg.micro_batch_tokens,
                   m.cfg.activation_checkpointing ? "" : ", train.activation_checkpointing off",
                   "): lower train.micro_batch_tokens (0 trains the whole batch at once), "
                   "prompts_per_step or group_size, or rollout.max_new_tokens",
                   m.cfg.activation_checkpointing ? "" : ", or set train.activation_checkpointing: true",
                   ". LibTorch: ", what.substr(0, what.find('\n')));
    }
}

void PolicyTrainer::save_weights(const std::string& dir) const {
    impl_->call({{"call", "save_weights"}, {"dir", dir}});
    impl_->save_weights_here(dir);
}

std::vector<std::pair<std::string, at::Tensor>> PolicyTrainer::weights() const {
    std::vector<std::pair<std::string, at::Tensor>> all;
    for (auto& k : impl_->ranks)
        for (auto& t : k.model->state_dict()) all.push_back(std::move(t));
    return all;
}

std::vector<TrainerRankWeights> PolicyTrainer::rank_weights() const {
    std::vector<TrainerRankWeights> all;
    for (auto& k : impl_->ranks) all.push_back({k.model->first_local_expert(), k.model->named_parameters()});
    return all;
}

std::vector<std::string> PolicyTrainer::export_weights_ipc(std::string& why_not) {
    Impl& m = *impl_;
    m.call({{"call", "export_ipc"}});
    const std::string mine = m.export_here();
    const std::vector<std::string> parts =
        m.processes ? m.group->gather(mine) : std::vector<std::string>{mine};
    std::vector<std::string> out;
    for (size_t q = 0; q < parts.size(); ++q) {
        const nlohmann::json j = nlohmann::json::parse(parts[q]);
        if (j.contains("error")) {
            why_not = (m.processes ? "trainer rank " + std::to_string(q) + ": " : std::string()) +
                      j.at("error").get<std::string>();
            return {};
        }
        out.push_back(j.at("export").get<std::string>());
    }
    return out;
}

int64_t PolicyTrainer::weight_writes() const { return impl_->writes; }

void PolicyTrainer::save_optimizer(const std::string& dir) const {
    impl_->call({{"call", "save_optimizer"}, {"dir", dir}});
    impl_->save_optimizer_here(dir);
}

void PolicyTrainer::load(const std::string& dir) {
    ++impl_->writes;
    impl_->call({{"call", "load"}, {"dir", dir}});
    impl_->load_here(dir);
}

void PolicyTrainer::follow() {
    Impl& m = *impl_;
    MOERL_CHECK(m.processes && m.first_rank > 0,
                "follow: only ranks 1.. of a trainer over processes follow rank 0");
    for (;;) {
        std::string tail;
        const nlohmann::json c = m.next_call(&tail);
        const std::string what = c.at("call").get<std::string>();
        if (what == "stop") return;
        if (what == "update") {
            std::vector<ExperienceRecord> batch;
            size_t at = 0;
            for (const size_t n : c.at("record_bytes").get<std::vector<size_t>>()) {
                MOERL_CHECK(at + n <= tail.size(), "trainer rank ", m.first_rank,
                            ": an update's records hold ", tail.size(), " bytes, fewer than their sizes say");
                batch.push_back(experience_from_json(tail.substr(at, n)));
                at += n;
            }
            m.update_here(batch, c.at("advantages").get<std::vector<double>>());
        } else if (what == "save_weights") {
            m.save_weights_here(c.at("dir").get<std::string>());
        } else if (what == "save_optimizer") {
            m.save_optimizer_here(c.at("dir").get<std::string>());
        } else if (what == "load") {
            m.load_here(c.at("dir").get<std::string>());
        } else if (what == "export_ipc") {
            m.group->gather(m.export_here());
        } else {
            MOERL_FAIL("trainer rank ", m.first_rank, ": rank 0 made an unknown call '", what, "'");
        }
    }
}

int64_t PolicyTrainer::optimizer_steps() const { return impl_->step_count_for_update; }
int PolicyTrainer::num_ranks() const { return impl_->W; }

}  // namespace moerl::rl
