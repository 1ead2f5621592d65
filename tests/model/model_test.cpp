// The model on one rank (CPU, fp32): MoE layer vs a dense reference, padding, KV cache, routing
// replay, the load-balancing loss and gradients.
#include "moerl/model/model.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "model_test_util.hpp"
#include "moerl/model/layers.hpp"

namespace moerl::model {
namespace {

using test::error_of;
using test::tiny_config;
using ::testing::HasSubstr;

constexpr double kTol = 2e-5;  // fp32, relative to the largest magnitude

at::Tensor randn(at::IntArrayRef shape, double scale = 1.0) { return at::randn(shape) * scale; }

// out[t] = sum over experts e chosen for t of w[t, e] * expert_e(x[t]), every expert applied to
// every token and weighted by a dense [T, E] matrix built independently from the probabilities.
at::Tensor dense_moe_reference(const at::Tensor& x, const at::Tensor& router, int64_t K, bool norm,
                               const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
    const int64_t T = x.size(0), E = router.size(0);
    at::Tensor probs = at::softmax(at::matmul(x, router.t()), -1);
    at::Tensor dense_w = at::zeros({T, E});
    at::Tensor idx = std::get<1>(probs.topk(K, -1));
    at::Tensor chosen = at::zeros({T, E}).scatter(1, idx, 1.0);
    dense_w = probs * chosen;
    if (norm) dense_w = dense_w / dense_w.sum(-1, true);
    at::Tensor out = at::zeros_like(x);
    for (int64_t e = 0; e < E; ++e) {
        at::Tensor h = at::silu(at::matmul(x, gate[e].t())) * at::matmul(x, up[e].t());
        out = out + at::matmul(h, down[e].t()) * dense_w.select(1, e).unsqueeze(1);
    }
    return out;
}

TEST(Layers, MoeMatchesDenseReferenceWithGradients) {
    for (bool norm : {false, true}) {
        at::manual_seed(3);
        const int64_t T = 19, H = 16, I = 12, E = 6, K = 2;
        at::Tensor x = randn({T, H}).requires_grad_(true);
        at::Tensor router = randn({E, H}, 0.5).requires_grad_(true);
        at::Tensor gate = randn({E, I, H}, 0.3).requires_grad_(true);
        at::Tensor up = randn({E, I, H}, 0.3).requires_grad_(true);
        at::Tensor down = randn({E, H, I}, 0.3).requires_grad_(true);
        at::Tensor probe = randn({T, H});
        std::vector<at::Tensor> inputs = {x, router, gate, up, down};

        Routing r = route(x, router, K, norm);
        at::Tensor y = moe_forward(x, r, gate, up, down, nullptr);
        at::Tensor y_ref = dense_moe_reference(x, router, K, norm, gate, up, down);
        EXPECT_CLOSE(y, y_ref, kTol);
        auto g = torch::autograd::grad({(y * probe).sum()}, inputs);
        auto g_ref = torch::autograd::grad({(y_ref * probe).sum()}, inputs);
        for (size_t i = 0; i < inputs.size(); ++i) {
            EXPECT_GT(g_ref[i].abs().sum().item<double>(), 0.0) << i;
            EXPECT_CLOSE(g[i], g_ref[i], kTol) << "input " << i << " norm " << norm;
        }
    }
}

TEST(Layers, MaskedTokensUseNoExpert) {
    at::manual_seed(4);
    at::Tensor x = randn({5, 8}), router = randn({4, 8});
    at::Tensor valid = at::tensor({1, 0, 1, 1, 0}).to(at::kBool);
    Routing r = route(x, router, 2, false, valid);
    EXPECT_EQ(r.topk_idx[1][0].item<int64_t>(), -1);
    EXPECT_EQ(r.topk_idx[4][1].item<int64_t>(), -1);
    at::Tensor y = moe_forward(x, r, randn({4, 6, 8}), randn({4, 6, 8}), randn({4, 8, 6}), nullptr);
    EXPECT_EQ(y[1].abs().sum().item<double>(), 0.0);
    EXPECT_GT(y[0].abs().sum().item<double>(), 0.0);
}

TEST(Layers, MaskedTokensGetNoGradientAndLeaveTheRestAlone) {
    at::manual_seed(5);
    const int64_t H = 8, I = 6, E = 4;
    at::Tensor x = randn({5, H}).requires_grad_(true), router = randn({E, H});
    at::Tensor gate = randn({E, I, H}, 0.3).requires_grad_(true);
    at::Tensor up = randn({E, I, H}, 0.3), down = randn({E, H, I}, 0.3);
    at::Tensor probe = randn({5, H});
    at::Tensor valid = at::tensor({1, 0, 1, 1, 0}).to(at::kBool);
    at::Tensor y = moe_forward(x, route(x, router, 2, false, valid), gate, up, down, nullptr);
    auto g = torch::autograd::grad({(y * probe).sum()}, {x, gate});
    EXPECT_EQ(g[0][1].abs().sum().item<double>(), 0.0);
    EXPECT_EQ(g[0][4].abs().sum().item<double>(), 0.0);
    // The valid tokens alone give the same output and expert gradient.
    at::Tensor keep = at::tensor({0, 2, 3});
    at::Tensor xs = x.detach().index_select(0, keep).requires_grad_(true);
    at::Tensor ys = moe_forward(xs, route(xs, router, 2, false), gate, up, down, nullptr);
    EXPECT_CLOSE(y.index_select(0, keep), ys, kTol);
    auto gs = torch::autograd::grad({(ys * probe.index_select(0, keep)).sum()}, {xs, gate});
    EXPECT_CLOSE(g[0].index_select(0, keep), gs[0], kTol);
    EXPECT_CLOSE(g[1], gs[1], kTol);
}

TEST(Layers, ExpertIdOutOfRangeIsAnError) {
    at::Tensor x = randn({3, 8});
    at::Tensor idx = at::tensor({0, 1, 2, 4, -1, 3}).view({3, 2});  // 4 experts: id 4 is out of range
    at::Tensor w = at::full({3, 2}, 0.5);
    EXPECT_THAT(error_of([&] {
                    experts_forward(x, idx, w, randn({4, 6, 8}), randn({4, 6, 8}), randn({4, 8, 6}));
                }),
                HasSubstr("expert id is >= the 4 local experts"));
}

TEST(Layers, LoadBalanceLossMatchesHfFormula) {
    at::manual_seed(5);
    const int64_t T = 10, E = 4, K = 2;
    at::Tensor router = randn({E, 8}).requires_grad_(true);
    std::vector<at::Tensor> xs = {randn({T, 8}), randn({T, 8})};
    LoadBalanceLoss lb;
    std::vector<at::Tensor> all_probs;
    for (auto& x : xs) {
        Routing r = route(x, router, K, true);
        lb.add_layer(r);
        all_probs.push_back(r.probs);
    }
    // HF load_balancing_loss_func without a mask: concatenate layers, one-hot the top-k.
    at::Tensor probs = at::cat(all_probs, 0);
    at::Tensor sel = std::get<1>(probs.topk(K, -1));
    at::Tensor mask = at::one_hot(sel, E).to(at::kFloat);  // [N, K, E]
    at::Tensor ref = (mask.mean(0) * probs.mean(0).unsqueeze(0)).sum() * E;
    EXPECT_NEAR(lb.value().item<double>(), ref.item<double>(), 1e-6);
    auto g = torch::autograd::grad({lb.value()}, {router}, {}, /*retain_graph=*/true);
    auto g_ref = torch::autograd::grad({ref}, {router});
    EXPECT_CLOSE(g[0], g_ref[0], 1e-5);
}

struct Batch {
    at::Tensor ids, mask;
    std::vector<std::vector<int64_t>> seqs;
};

// Variable-length sequences packed left- or right-padded with token 0.
Batch make_batch(const std::vector<int64_t>& lengths, bool left, int vocab, int64_t seed) {
    at::manual_seed(seed);
    Batch b;
    const int64_t S = *std::max_element(lengths.begin(), lengths.end());
    b.ids = at::zeros({static_cast<int64_t>(lengths.size()), S}, at::kLong);
    b.mask = at::zeros_like(b.ids);
    for (size_t i = 0; i < lengths.size(); ++i) {
        at::Tensor s = at::randint(1, vocab, {lengths[i]}, at::kLong);
        const int64_t start = left ? S - lengths[i] : 0;
        b.ids[i].narrow(0, start, lengths[i]).copy_(s);
        b.mask[i].narrow(0, start, lengths[i]).fill_(1);
        b.seqs.emplace_back(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + lengths[i]);
    }
    return b;
}

at::Tensor as_row(const std::vector<int64_t>& seq) { return at::tensor(seq, at::kLong).unsqueeze(0); }

TEST(Model, PaddingDoesNotChangeResults) {
    MoeModel model(tiny_config(3, true), {});
    model.init_random(1);
    c10::NoGradGuard no_grad;
    for (bool left : {true, false}) {
        Batch b = make_batch({7, 3, 5}, left, 97, 2);
        ForwardOutput out = model.forward(b.ids, b.mask, test::recording());
        for (size_t i = 0; i < b.seqs.size(); ++i) {
            const int64_t n = static_cast<int64_t>(b.seqs[i].size());
            const int64_t start = left ? b.ids.size(1) - n : 0;
            ForwardOutput alone = model.forward(as_row(b.seqs[i]), at::Tensor(), test::recording());
            EXPECT_CLOSE(out.logits[i].narrow(0, start, n), alone.logits[0], kTol);
            EXPECT_CLOSE(out.token_logprobs[i].narrow(0, start + 1, n - 1),
                         alone.token_logprobs[0].narrow(0, 1, n - 1), kTol);
            EXPECT_TRUE(at::equal(out.routing[i].narrow(0, start, n), alone.routing[0]));
            if (n < b.ids.size(1)) {  // padded positions use no expert
                const int64_t pad = left ? 0 : n;
                EXPECT_EQ(out.routing[i][pad].max().item<int64_t>(), -1);
            }
        }
    }
}

TEST(Model, TokenLogprobsAreShiftedLogSoftmax) {
    MoeModel model(tiny_config(), {});
    model.init_random(2);
    c10::NoGradGuard no_grad;
    Batch b = make_batch({6, 6}, true, 97, 3);
    ForwardOutput out = model.forward(b.ids, b.mask);
    at::Tensor lp = at::log_softmax(out.logits, -1);
    EXPECT_EQ(out.token_logprobs[0][0].item<float>(), 0.f);
    EXPECT_NEAR(out.token_logprobs[1][4].item<float>(), lp[1][3][b.ids[1][4].item<int64_t>()].item<float>(),
                1e-5);
    EXPECT_LT(out.token_logprobs.narrow(1, 1, 5).max().item<float>(), 0.f);
}

// selected_logprobs against log_softmax + gather over the full logits: values and gradients, with
// a temperature and an allowed-token bias, in one chunk and in chunks of 1 and 3 rows.
TEST(Layers, SelectedLogprobsMatchFullLogSoftmax) {
    at::manual_seed(11);
    const int64_t N = 13, H = 8, V = 29;
    at::Tensor hidden0 = at::randn({N, H}), weight0 = at::randn({V, H});
    at::Tensor targets = at::randint(0, V, {N}, at::kLong);
    at::Tensor bias = at::zeros({V});
    bias.narrow(0, 20, 9).fill_(-1e9);
    targets = targets.remainder(20);  // drawn from the allowed tokens only
    at::Tensor g = at::randn({N});
    for (const double temperature : {1.0, 0.7}) {
        for (const bool biased : {false, true}) {
            at::Tensor b = biased ? bias : at::Tensor();
            at::Tensor h_ref = hidden0.clone().requires_grad_(true),
                       w_ref = weight0.clone().requires_grad_(true);
            at::Tensor z = at::matmul(h_ref, w_ref.t()) / temperature;
            if (biased) z = z + b;
            at::Tensor ref = at::log_softmax(z, 1).gather(1, targets.unsqueeze(1)).squeeze(1);
            (ref * g).sum().backward();
            for (const int64_t rows : {int64_t{1}, int64_t{3}, N}) {
                at::Tensor h = hidden0.clone().requires_grad_(true), w = weight0.clone().requires_grad_(true);
                at::Tensor lp = selected_logprobs(h, w, targets, temperature, b, rows * V * 4);
                EXPECT_CLOSE(lp, ref, 1e-5) << "T " << temperature << " bias " << biased << " rows " << rows;
                (lp * g).sum().backward();
                EXPECT_CLOSE(h.grad(), h_ref.grad(), 1e-5) << "rows " << rows;
                EXPECT_CLOSE(w.grad(), w_ref.grad(), 1e-5) << "rows " << rows;
            }
            c10::NoGradGuard no_grad;  // the no-grad path keeps no softmax
            EXPECT_CLOSE(selected_logprobs(hidden0, weight0, targets, temperature, b, 2 * V * 4), ref, 1e-5);
        }
    }
    {
        // bf16: the softmax is kept in bf16 (fp32 log_softmax, one rounding), the log-probs in fp32.
        at::Tensor h = hidden0.to(at::kBFloat16).requires_grad_(true),
                   w = weight0.to(at::kBFloat16).requires_grad_(true);
        at::Tensor h_ref = h.detach().to(at::kFloat).requires_grad_(true),
                   w_ref = w.detach().to(at::kFloat).requires_grad_(true);
        at::Tensor ref =
            at::log_softmax(at::matmul(h_ref, w_ref.t()), 1).gather(1, targets.unsqueeze(1)).squeeze(1);
        (ref * g).sum().backward();
        at::Tensor lp = selected_logprobs(h, w, targets, 1.0, {}, 4 * V * 4);
        EXPECT_EQ(lp.scalar_type(), at::kFloat);
        EXPECT_CLOSE(lp, ref, 5e-2);
        (lp * g).sum().backward();
        EXPECT_CLOSE(h.grad().to(at::kFloat), h_ref.grad(), 5e-2);
        EXPECT_CLOSE(w.grad().to(at::kFloat), w_ref.grad(), 5e-2);
    }
    EXPECT_THAT(error_of([&] { selected_logprobs(hidden0, weight0, at::full({N}, V, at::kLong)); }),
                HasSubstr("target ids outside [0, 29)"));
}

// forward with logprob_mask: the chosen positions' log-probs (and their gradients) equal the full
// path's under the same temperature and bias; everything else is 0.
TEST(Model, LogprobMaskMatchesFullLogprobs) {
    ModelConfig c = tiny_config(2, false);
    MoeModel model(c, {});
    model.init_random(12);
    Batch b = make_batch({9, 6, 7}, false, c.vocab_size, 13);
    b.ids = at::where((b.ids >= 50).logical_and(b.ids < 60), b.ids - 40, b.ids);  // none is masked out
    at::Tensor chosen = (at::arange(9).remainder(3) != 1).unsqueeze(0).expand({3, 9}).logical_and(b.mask > 0);
    at::Tensor bias = at::zeros({c.vocab_size});
    bias.narrow(0, 50, 10).fill_(-1e9);
    ForwardOptions full;
    full.logprob_temperature = 0.8;
    full.logprob_bias = bias;
    ForwardOptions selected = full;
    selected.return_logits = false;
    selected.logprob_mask = chosen;
    ForwardOutput ref = model.forward(b.ids, b.mask, full);
    at::Tensor keep = chosen.clone();
    keep.select(1, 0).fill_(false);
    at::Tensor want = ref.token_logprobs * keep;
    (want.sum() + ref.aux_loss).backward();
    std::vector<at::Tensor> ref_grads;
    for (auto& p : model.parameters()) ref_grads.push_back(p.grad().clone());
    model.zero_grad();
    ForwardOutput out = model.forward(b.ids, b.mask, selected);
    EXPECT_FALSE(out.logits.defined());
    EXPECT_CLOSE(out.token_logprobs, want, 1e-5);
    EXPECT_EQ(out.token_logprobs.masked_select(keep.logical_not()).abs().max().item<float>(), 0.f);
    (out.token_logprobs.sum() + out.aux_loss).backward();
    auto params = model.named_parameters();
    for (size_t i = 0; i < params.size(); ++i)
        EXPECT_CLOSE(params[i].tensor.grad(), ref_grads[i], 1e-4) << params[i].name;
}

TEST(Model, DecodeWithKvCacheMatchesFullRecompute) {
    MoeModel model(tiny_config(3, true), {});
    model.init_random(3);
    const std::vector<int64_t> lengths = {5, 2, 4};
    Batch b = make_batch(lengths, /*left=*/true, 97, 4);
    const int64_t steps = 6, B = 3;
    at::Tensor cont = at::randint(1, 97, {steps, B}, at::kLong);  // fixed continuation tokens
    KvCache cache = model.new_cache(B, b.ids.size(1) + steps + 1);
    StepOutput first = model.prefill(cache, b.ids, b.mask, true);
    std::vector<at::Tensor> step_logits = {first.logits};
    std::vector<at::Tensor> step_routing = {first.routing};
    for (int64_t s = 0; s < steps; ++s) {
        StepOutput o = model.decode(cache, cont[s], true);
        step_logits.push_back(o.logits);
        step_routing.push_back(o.routing);
    }
    EXPECT_EQ(cache.length, b.ids.size(1) + steps);
    EXPECT_EQ(cache.next_position[1].item<int64_t>(), lengths[1] + steps);
    c10::NoGradGuard no_grad;
    for (int64_t i = 0; i < B; ++i) {
        std::vector<int64_t> seq = b.seqs[i];
        for (int64_t s = 0; s <= steps; ++s) {
            if (s > 0) seq.push_back(cont[s - 1][i].item<int64_t>());
            ForwardOutput full = model.forward(as_row(seq), at::Tensor(), test::recording());
            const int64_t n = static_cast<int64_t>(seq.size());
            EXPECT_CLOSE(step_logits[s][i], full.logits[0][n - 1], kTol) << "seq " << i << " step " << s;
            EXPECT_TRUE(at::equal(step_routing[s][i].select(0, -1), full.routing[0][n - 1]));
        }
    }
    // Dropping a finished sequence keeps the others' caches.
    cache.select(at::tensor({0, 2}, at::kLong));
    at::Tensor next = at::tensor({5, 9}, at::kLong);
    StepOutput o = model.decode(cache, next);
    std::vector<int64_t> seq = b.seqs[2];
    for (int64_t s = 0; s < steps; ++s) seq.push_back(cont[s][2].item<int64_t>());
    seq.push_back(9);
    ForwardOutput full = model.forward(as_row(seq), at::Tensor());
    EXPECT_CLOSE(o.logits[1], full.logits[0][-1], kTol);
    EXPECT_THAT(error_of([&] {
                    model.decode(cache, at::tensor({1, 2, 3}, at::kLong));
                }),
                HasSubstr("batch 3, but the KV cache holds 2"));
    KvCache small = model.new_cache(1, 4);
    EXPECT_THAT(error_of([&] {
                    model.prefill(small, at::ones({1, 5}, at::kLong), at::Tensor());
                }),
                HasSubstr("KV cache capacity 4 exceeded"));
    EXPECT_THAT(error_of([&] {
                    model.forward(at::full({1, 3}, 97, at::kLong), at::Tensor());
                }),
                HasSubstr("vocab_size = 97"));
}

TEST(Model, ChunkedPrefillMatchesOneShot) {
    MoeModel model(tiny_config(), {});
    model.init_random(4);
    Batch b = make_batch({9, 9}, true, 97, 5);
    KvCache one = model.new_cache(2, 9), two = model.new_cache(2, 9);
    at::Tensor l1 = model.prefill(one, b.ids, b.mask).logits;
    model.prefill(two, b.ids.narrow(1, 0, 4), b.mask.narrow(1, 0, 4));
    at::Tensor l2 = model.prefill(two, b.ids.narrow(1, 4, 5), b.mask.narrow(1, 4, 5)).logits;
    EXPECT_CLOSE(l2, l1, kTol);
}

TEST(Model, RoutingReplayReproducesRecordedExperts) {
    MoeModel model(tiny_config(3, true), {});
    model.init_random(5);
    Batch b = make_batch({8, 5}, true, 97, 6);
    ForwardOutput rec;
    {
        c10::NoGradGuard no_grad;
        rec = model.forward(b.ids, b.mask, test::recording());
    }
    ASSERT_EQ(rec.routing.sizes(), (std::vector<int64_t>{2, 8, 2, 2}));
    {
        c10::NoGradGuard no_grad;  // the policy moves: perturb every router
        for (auto& [name, t] : model.state_dict())
            if (name.find("mlp.gate.weight") != std::string::npos) t.add_(at::randn(t.sizes()) * 0.5);
    }
    ForwardOutput drift = model.forward(b.ids, b.mask, test::recording());
    EXPECT_FALSE(at::equal(drift.routing, rec.routing))
        << "perturbation too small for the test to mean anything";

    ForwardOutput replayed = model.forward(b.ids, b.mask, test::recording(rec.routing));
    EXPECT_TRUE(at::equal(replayed.routing, rec.routing));
    (replayed.token_logprobs.sum() + replayed.aux_loss).backward();
    for (const auto& p : model.named_parameters()) {
        if (p.name.find("mlp.gate.weight") == std::string::npos) continue;
        ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
        EXPECT_GT(p.tensor.grad().abs().sum().item<double>(), 0.0) << p.name;
    }
    // Rows holding -1 fall back to the router; ids out of range are rejected.
    at::Tensor partial = rec.routing.clone();
    partial[0][7][0][1] = -1;
    ForwardOutput mixed = model.forward(b.ids, b.mask, test::recording(partial));
    EXPECT_TRUE(at::equal(mixed.routing[0][7][0], drift.routing[0][7][0]));
    EXPECT_TRUE(at::equal(mixed.routing[1], rec.routing[1]));
    at::Tensor bad = rec.routing.clone();
    bad[1][2][1][0] = 8;
    EXPECT_THAT(error_of([&] { model.forward(b.ids, b.mask, test::replaying(bad)); }),
                HasSubstr("routing replay names expert 8, but num_experts = 8"));
}

TEST(Model, TrainingBackwardReachesEveryParameter) {
    MoeModel model(tiny_config(3, true), {});
    model.init_random(6);
    Batch b = make_batch({12, 9, 12, 4}, false, 97, 7);
    ForwardOutput out = model.forward(b.ids, b.mask);
    ASSERT_TRUE(out.aux_loss.defined());
    EXPECT_GT(out.aux_loss.item<double>(), 0.5);  // E * sum f*P is about 1 when balanced
    at::Tensor loss = -(out.token_logprobs * b.mask).sum() / b.mask.sum() +
                      model.config().router_aux_loss_coef * out.aux_loss;
    loss.backward();
    for (const auto& p : model.named_parameters()) {
        ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
        EXPECT_TRUE(at::isfinite(p.tensor.grad()).all().item<bool>()) << p.name;
        EXPECT_GT(p.tensor.grad().abs().sum().item<double>(), 0.0) << p.name;
    }
    model.zero_grad();
    EXPECT_FALSE(model.parameters()[0].grad().defined());
}

TEST(Model, GradientMatchesFiniteDifference) {
    // Double precision is not a model dtype, so the check perturbs an fp32 weight with a step
    // large enough for fp32 and compares with a loose tolerance.
    MoeModel model(tiny_config(2), {});
    model.init_random(8);
    Batch b = make_batch({6, 4}, true, 97, 8);
    auto loss_of = [&] { return model.forward(b.ids, b.mask).token_logprobs.sum(); };
    loss_of().backward();
    for (const char* name :
         {"model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.experts.down_proj"}) {
        at::Tensor w;
        for (const auto& p : model.named_parameters())
            if (p.name == name) w = p.tensor;
        ASSERT_TRUE(w.defined()) << name;
        const double analytic = w.grad().view(-1)[5].item<double>();
        const double h = 1e-2;
        c10::NoGradGuard no_grad;
        w.view(-1)[5].add_(h);
        const double plus = loss_of().item<double>();
        w.view(-1)[5].sub_(2 * h);
        const double minus = loss_of().item<double>();
        w.view(-1)[5].add_(h);
        EXPECT_NEAR((plus - minus) / (2 * h), analytic, 2e-2 * std::max(1.0, std::abs(analytic))) << name;
    }
}

// Activation checkpointing recomputes each layer in the backward: the loss, the load-balancing
// loss, the routing and every parameter's gradient equal the plain backward's, with routing
// replay and with packed rows as well.
TEST(Model, ActivationCheckpointingGivesTheSameLossAndGradients) {
    MoeModel model(tiny_config(3, true), {});
    model.init_random(11);
    Batch b = make_batch({12, 9, 12, 4}, false, 97, 7);
    at::Tensor segments = at::zeros({2, 20}, at::kLong);
    segments.narrow(1, 0, 9).fill_(1);
    segments.narrow(1, 9, 7).fill_(2);
    at::Tensor packed_ids = at::randint(0, 97, {2, 20}, at::kLong);
    const ForwardOutput recorded = [&] {
        c10::NoGradGuard no_grad;
        ForwardOptions o;
        o.record_routing = true;
        return model.forward(b.ids, b.mask, o);
    }();
    // Half the rows replayed, half routed by the router.
    at::Tensor replay = recorded.routing.clone();
    replay.narrow(0, 0, 2).fill_(-1);

    struct Result {
        double loss = 0, aux = 0;
        at::Tensor routing;
        std::vector<at::Tensor> grads;
    };
    enum Input { kPadded, kReplayed, kPacked };
    auto run = [&](Input input, bool checkpoint) {
        model.zero_grad();
        ForwardOptions o;
        o.record_routing = true;
        o.activation_checkpointing = checkpoint;
        at::Tensor ids = b.ids, mask = b.mask;
        if (input == kReplayed) o.replay_routing = replay;
        if (input == kPacked) {
            ids = packed_ids;
            mask = at::Tensor();
            o.segment_ids = segments;
        }
        ForwardOutput out = model.forward(ids, mask, o);
        at::Tensor weight = input == kPacked ? (segments > 0).to(at::kFloat) : b.mask.to(at::kFloat);
        at::Tensor loss = -(out.token_logprobs * weight).sum() / weight.sum() +
                          model.config().router_aux_loss_coef * out.aux_loss;
        loss.backward();
        Result r{loss.item<double>(), out.aux_loss.item<double>(), out.routing, {}};
        for (const auto& p : model.named_parameters()) r.grads.push_back(p.tensor.grad().clone());
        return r;
    };
    for (Input input : {kPadded, kReplayed, kPacked}) {
        SCOPED_TRACE(input == kPadded ? "padded" : input == kReplayed ? "replayed" : "packed");
        const Result plain = run(input, false);
        const Result checkpointed = run(input, true);
        EXPECT_NEAR(checkpointed.loss, plain.loss, 1e-6 * std::abs(plain.loss));
        EXPECT_NEAR(checkpointed.aux, plain.aux, 1e-6);
        EXPECT_TRUE(checkpointed.routing.equal(plain.routing));
        const auto params = model.named_parameters();
        for (size_t i = 0; i < params.size(); ++i) {
            const double scale = plain.grads[i].abs().max().item<double>();
            ASSERT_GT(scale, 0.0) << params[i].name;
            EXPECT_LE((checkpointed.grads[i] - plain.grads[i]).abs().max().item<double>(), kTol * scale)
                << params[i].name;
        }
    }
    // Without a backward to come (no grad) nothing is checkpointed, and the output is the same.
    c10::NoGradGuard no_grad;
    ForwardOptions o;
    o.activation_checkpointing = true;
    EXPECT_TRUE(
        model.forward(b.ids, b.mask, o).token_logprobs.equal(model.forward(b.ids, b.mask).token_logprobs));
}

}  // namespace
}  // namespace moerl::model
