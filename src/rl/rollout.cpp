// Continuous-batching generation on top of MoeModel's prefill/decode. The active batch shares one
// KV cache; joining sequences are prefilled in their own cache and merged in, right-aligned (the
// model's positions come from next_position, so leading empty columns are harmless).
#include "moerl/rl/rollout.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <numeric>

#include "moerl/core/error.hpp"
#include "moerl/model/model.hpp"

namespace moerl::rl {

namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

// Merges b's sequences after a's, aligning both to the right; `room` columns are left free.
model::KvCache merge_caches(model::KvCache& a, model::KvCache& b, int64_t room) {
    if (a.batch_size() == 0) return std::move(b);
    auto used_span = [](const model::KvCache& c) {
        // Leading columns no sequence uses can be dropped.
        at::Tensor any = c.key_valid.narrow(1, 0, c.length).any(0);
        int64_t first = 0;
        auto acc = any.accessor<bool, 1>();
        while (first < c.length && !acc[first]) ++first;
        return std::make_pair(first, c.length - first);
    };
    auto [a0, an] = used_span(a);
    auto [b0, bn] = used_span(b);
    const int64_t L = std::max(an, bn), Ba = a.batch_size(), Bb = b.batch_size();
    model::KvCache out;
    out.capacity = L + room;
    out.length = L;
    auto place = [&](const at::Tensor& src_a, const at::Tensor& src_b, at::Tensor proto) {
        std::vector<int64_t> shape(proto.sizes().begin(), proto.sizes().end());
        shape[0] = Ba + Bb;
        const int col = proto.dim() == 4 ? 2 : 1;
        shape[col] = out.capacity;
        at::Tensor t = at::zeros(shape, proto.options());
        t.narrow(0, 0, Ba).narrow(col, L - an, an).copy_(src_a.narrow(col, a0, an));
        t.narrow(0, Ba, Bb).narrow(col, L - bn, bn).copy_(src_b.narrow(col, b0, bn));
        return t;
    };
    for (size_t l = 0; l < a.keys.size(); ++l) {
        out.keys.push_back(place(a.keys[l], b.keys[l], a.keys[l]));
        out.values.push_back(place(a.values[l], b.values[l], a.values[l]));
    }
    out.key_valid = place(a.key_valid, b.key_valid, a.key_valid);
    out.next_position = at::cat({a.next_position, b.next_position});
    return out;
}

}  // namespace

double uniform_draw(uint64_t seed, uint64_t draw) {
    return static_cast<double>(splitmix64(splitmix64(seed) ^ (draw * 0xD1B54A32D192ED03ULL)) >> 11) *
           0x1.0p-53;
}

std::pair<int, float> sample_token(const float* logits, int V, const SamplingParams& p, double u) {
    std::vector<double> z(V);
    double mx = -INFINITY;
    for (int i = 0; i < V; ++i) mx = std::max(mx, z[i] = logits[i] / p.temperature);
    double sum = 0;
    for (int i = 0; i < V; ++i) sum += std::exp(z[i] - mx);
    const double log_norm = mx + std::log(sum);
    std::vector<int> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
    int keep = (p.top_k > 0) ? std::min(p.top_k, V) : V;
    if (p.top_p < 1.0) {
        double mass = 0;
        for (int i = 0; i < keep; ++i) {
            mass += std::exp(z[order[i]] - log_norm);
            if (mass >= p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    double kept = 0;
    for (int i = 0; i < keep; ++i) kept += std::exp(z[order[i]] - log_norm);
    double target = u * kept, acc = 0;
    int token = order[keep - 1];
    for (int i = 0; i < keep; ++i) {
        acc += std::exp(z[order[i]] - log_norm);
        if (target < acc) {
            token = order[i];
            break;
        }
    }
    return {token, static_cast<float>(z[token] - log_norm)};
}

struct RolloutEngine::Impl {
    struct Seq {
        GenRequest req;
        Trajectory traj;
        int next_input = -1;  // last sampled token, not yet in the cache
    };
    const model::MoeModel& model;
    SamplingParams params;
    int max_batch;
    bool record_routing;
    int num_moe_layers, top_k, vocab;
    std::deque<GenRequest> waiting;
    std::vector<Seq> active;  // row i of the cache
    model::KvCache cache;
    int64_t tokens = 0;

    Impl(const model::MoeModel& m, const SamplingParams& p, int mb, bool rr)
        : model(m), params(p), max_batch(mb), record_routing(rr) {
        num_moe_layers = m.config().num_moe_layers();
        top_k = m.config().num_experts_per_tok;
        vocab = m.config().vocab_size;
    }

    size_t route_width() const { return static_cast<size_t>(num_moe_layers) * top_k; }

    void append_routing(Seq& s, const at::Tensor& r /* [S, M, K] int16 */, int64_t first_col) {
        if (!record_routing) return;
        at::Tensor part = r.narrow(0, first_col, r.size(0) - first_col).contiguous();
        const int16_t* p = part.data_ptr<int16_t>();
        s.traj.routing.insert(s.traj.routing.end(), p, p + part.numel());
    }

    // Samples the next token of s from logits; returns true when s is finished.
    bool sample(Seq& s, const float* logits, int64_t version) {
        const double u = uniform_draw(s.req.seed, s.traj.rng_draws++);
        auto [tok, lp] = sample_token(logits, vocab, params, u);
        s.traj.tokens.push_back(tok);
        s.traj.logprobs.push_back(lp);
        s.traj.versions.push_back(version);
        ++tokens;
        s.next_input = tok;
        if (std::find(params.stop_tokens.begin(), params.stop_tokens.end(), tok) !=
            params.stop_tokens.end()) {
            s.traj.terminated = true;
            return true;
        }
        return static_cast<int>(s.traj.tokens.size()) >= s.req.max_new_tokens;
    }

    GenResult finish(Seq& s) {
        if (record_routing) {
            // The last sampled token was never fed to the model: its experts are unknown.
            const size_t want = (s.req.prompt.size() + s.traj.tokens.size()) * route_width();
            s.traj.routing.resize(want, -1);
        }
        return {s.req.id, std::move(s.traj)};
    }

    void keep_rows(const std::vector<int64_t>& rows) {
        std::vector<Seq> kept;
        for (int64_t r : rows) kept.push_back(std::move(active[r]));
        active = std::move(kept);
        if (active.empty()) {
            cache = model::KvCache();
        } else {
            cache.select(at::tensor(rows, at::kLong));
        }
    }

    void admit(int64_t version, std::vector<GenResult>& done) {
        const size_t n =
            std::min(waiting.size(), static_cast<size_t>(std::max(0, max_batch - (int)active.size())));
        if (n == 0) return;
        std::vector<Seq> joining;
        int64_t longest = 0;
        for (size_t i = 0; i < n; ++i) {
            Seq s;
            s.req = std::move(waiting.front());
            waiting.pop_front();
            s.traj = s.req.prefix;
            s.traj.num_moe_layers = num_moe_layers;
            s.traj.top_k = top_k;
            s.traj.routing.clear();  // recomputed below for prompt and prefix
            longest = std::max<int64_t>(longest, s.req.prompt.size() + s.traj.tokens.size());
            joining.push_back(std::move(s));
        }
        const int64_t B = static_cast<int64_t>(n);
        at::Tensor ids = at::zeros({B, longest}, at::kLong);
        at::Tensor mask = at::zeros({B, longest}, at::kLong);
        std::vector<int64_t> pad(n);
        for (size_t i = 0; i < n; ++i) {
            std::vector<int64_t> ctx(joining[i].req.prompt.begin(), joining[i].req.prompt.end());
            ctx.insert(ctx.end(), joining[i].traj.tokens.begin(), joining[i].traj.tokens.end());
            pad[i] = longest - static_cast<int64_t>(ctx.size());
            ids[i].narrow(0, pad[i], ctx.size()).copy_(at::tensor(ctx, at::kLong));
            mask[i].narrow(0, pad[i], ctx.size()).fill_(1);
        }
        int64_t room = 0;
        for (auto& s : joining)
            room = std::max<int64_t>(room, s.req.max_new_tokens - (int64_t)s.traj.tokens.size());
        for (auto& s : active)
            room = std::max<int64_t>(room, s.req.max_new_tokens - (int64_t)s.traj.tokens.size());
        model::KvCache fresh = model.new_cache(B, longest + room + 1);
        model::StepOutput out = model.prefill(fresh, ids, mask, record_routing);
        at::Tensor logits = out.logits.contiguous();
        std::vector<int64_t> keep;
        for (size_t i = 0; i < n; ++i) {
            Seq& s = joining[i];
            if (record_routing) append_routing(s, out.routing[i], pad[i]);
            bool finished = static_cast<int>(s.traj.tokens.size()) >= s.req.max_new_tokens ||
                            sample(s, logits[i].data_ptr<float>(), version);
            if (finished) {
                done.push_back(finish(s));
            } else {
                keep.push_back(static_cast<int64_t>(i));
            }
        }
        if (keep.empty()) return;
        if (keep.size() < n) fresh.select(at::tensor(keep, at::kLong));
        for (int64_t k : keep) active.push_back(std::move(joining[k]));
        cache = merge_caches(cache, fresh, room + 1);
    }

    std::vector<GenResult> step(int64_t version) {
        at::NoGradGuard no_grad;
        std::vector<GenResult> done;
        const size_t before = active.size();
        admit(version, done);
        if (active.empty()) return done;
        (void)before;
        std::vector<int64_t> in;
        for (auto& s : active) in.push_back(s.next_input);
        model::StepOutput out = model.decode(cache, at::tensor(in, at::kLong), record_routing);
        at::Tensor logits = out.logits.contiguous();
        std::vector<int64_t> keep;
        for (size_t i = 0; i < active.size(); ++i) {
            Seq& s = active[i];
            if (record_routing) append_routing(s, out.routing[i], 0);
            if (sample(s, logits[i].data_ptr<float>(), version)) {
                done.push_back(finish(s));
            } else {
                keep.push_back(static_cast<int64_t>(i));
            }
        }
        if (keep.size() < active.size()) keep_rows(keep);
        return done;
    }
};

RolloutEngine::RolloutEngine(const model::MoeModel& model, const SamplingParams& params, int max_batch,
                             bool record_routing)
    : impl_(std::make_unique<Impl>(model, params, max_batch, record_routing)) {
    MOERL_CHECK(max_batch >= 1, "rollout max_batch must be >= 1, got ", max_batch);
    MOERL_CHECK(params.temperature > 0, "sampling temperature must be > 0, got ", params.temperature);
}
RolloutEngine::~RolloutEngine() = default;

void RolloutEngine::add(GenRequest request) {
    MOERL_CHECK(!request.prompt.empty(), "rollout request ", request.id, " has an empty prompt");
    impl_->waiting.push_back(std::move(request));
}

std::vector<GenResult> RolloutEngine::step(int64_t policy_version) { return impl_->step(policy_version); }

std::vector<GenResult> RolloutEngine::run_to_completion(int64_t policy_version) {
    std::vector<GenResult> all;
    while (!idle()) {
        auto d = step(policy_version);
        for (auto& r : d) all.push_back(std::move(r));
    }
    return all;
}

std::vector<GenResult> RolloutEngine::drain() {
    std::vector<GenResult> out;
    for (auto& s : impl_->active) {
        s.traj.routing.clear();  // a resumed sequence recomputes it in its prefill
        out.push_back({s.req.id, std::move(s.traj)});
    }
    for (auto& r : impl_->waiting) out.push_back({r.id, r.prefix});
    impl_->active.clear();
    impl_->waiting.clear();
    impl_->cache = model::KvCache();
    return out;
}

size_t RolloutEngine::num_active() const { return impl_->active.size(); }
size_t RolloutEngine::num_waiting() const { return impl_->waiting.size(); }
int64_t RolloutEngine::tokens_generated() const { return impl_->tokens; }

}  // namespace moerl::rl
