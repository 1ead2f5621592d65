// Expert parallelism inside the model: ranks run as threads of this process, each with its own
// moerl::ep::Buffer on the host transport; results must equal one rank holding every expert.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "ep_ranks.hpp"
#include "model_test_util.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/layers.hpp"
#include "moerl/model/model.hpp"

namespace moerl::model {
namespace {

using test::part;
using test::run_ranks;
using test::TempDir;
using test::tiny_config;

constexpr double kTol = 2e-5;

class EpTest : public ::testing::TestWithParam<int> {
  protected:
    void SetUp() override { at::set_num_threads(1); }
};

TEST_P(EpTest, MoeLayerMatchesLocalWithGradients) {
    const int world = GetParam();
    ModelConfig c = tiny_config();
    const int64_t T = 11, H = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts, K = 2;
    at::manual_seed(21);
    at::Tensor x = at::randn({T, H}), router = at::randn({E, H}) * 0.5;
    at::Tensor gate = at::randn({E, I, H}) * 0.3, up = at::randn({E, I, H}) * 0.3,
               down = at::randn({E, H, I}) * 0.3;
    at::Tensor probe = at::randn({T, H});
    // Token 3 is masked: it goes nowhere on both paths.
    at::Tensor valid = at::ones({T}, at::kBool);
    valid[3] = false;
    auto leaf = [](const at::Tensor& t) { return t.clone().requires_grad_(true); };

    std::vector<at::Tensor> ref_in = {leaf(x), leaf(router), leaf(gate), leaf(up), leaf(down)};
    Routing r = route(ref_in[0], ref_in[1], K, true, valid);
    at::Tensor y_ref = moe_forward(ref_in[0], r, ref_in[2], ref_in[3], ref_in[4], nullptr);
    (y_ref * probe).sum().backward();

    // Uneven token counts; with 4 ranks rank 0 has no token at all and must still take part.
    const std::vector<int64_t> counts =
        world == 2 ? std::vector<int64_t>{6, 5} : std::vector<int64_t>{0, 5, 4, 2};
    std::vector<at::Tensor> y(world), gx(world), grouter(world);
    std::vector<std::vector<at::Tensor>> gexperts(world);
    const int64_t L = E / world;
    run_ranks(world, c, 8, at::kFloat, [&](int rank, ep::Buffer& buffer) {
        int64_t begin = 0;
        for (int q = 0; q < rank; ++q) begin += counts[q];
        const int64_t count = counts[rank];
        at::Tensor xr = leaf(x.narrow(0, begin, count)), rr = leaf(router);
        at::Tensor g = leaf(gate.narrow(0, rank * L, L)), u = leaf(up.narrow(0, rank * L, L)),
                   d = leaf(down.narrow(0, rank * L, L));
        Routing rt = route(xr, rr, K, true, valid.narrow(0, begin, count));
        at::Tensor out = moe_forward(xr, rt, g, u, d, &buffer);
        (out * probe.narrow(0, begin, count)).sum().backward();
        y[rank] = out.detach();
        gx[rank] = xr.grad().defined() ? xr.grad() : at::zeros_like(xr);
        grouter[rank] = rr.grad();
        gexperts[rank] = {g.grad(), u.grad(), d.grad()};
    });
    EXPECT_CLOSE(at::cat(y, 0), y_ref, kTol);
    EXPECT_CLOSE(at::cat(gx, 0), ref_in[0].grad(), kTol);
    at::Tensor grouter_sum = at::zeros_like(router);
    for (auto& g : grouter) grouter_sum += g;
    EXPECT_GT(grouter_sum.abs().sum().item<double>(), 0.0);
    EXPECT_CLOSE(grouter_sum, ref_in[1].grad(), kTol);
    for (int rank = 0; rank < world; ++rank) {
        for (int w = 0; w < 3; ++w) {
            EXPECT_CLOSE(gexperts[rank][w], ref_in[2 + w].grad().narrow(0, rank * L, L), kTol)
                << "rank " << rank << " weight " << w;
        }
    }
}

TEST_P(EpTest, ModelLogitsAndGradientsMatchOneRank) {
    const int world = GetParam();
    ModelConfig c = tiny_config(3, true);
    const std::vector<int64_t> lengths = {9, 4, 7, 9, 2, 6, 8, 5};
    const int64_t B = static_cast<int64_t>(lengths.size()), S = 9;
    at::manual_seed(31);
    at::Tensor ids = at::randint(1, c.vocab_size, {B, S}, at::kLong);
    at::Tensor mask = at::zeros({B, S}, at::kLong);
    for (int64_t i = 0; i < B; ++i) mask[i].narrow(0, S - lengths[i], lengths[i]).fill_(1);
    at::Tensor probe = at::randn({B, S, c.vocab_size});

    MoeModel single(c, {});
    single.init_random(9);
    ForwardOutput ref = single.forward(ids, mask, test::recording());
    ((ref.logits * probe).sum() + ref.token_logprobs.sum()).backward();

    // The ranks with activation checkpointing too: each recomputes its layers in the backward, and
    // the recomputed dispatches pair up across ranks.
    for (bool checkpoint : {false, true}) {
        SCOPED_TRACE(checkpoint ? "activation checkpointing" : "plain backward");
        std::vector<ForwardOutput> outs(world);
        std::vector<std::vector<NamedParameter>> params(world);
        run_ranks(world, c, static_cast<int>(B * S), at::kFloat, [&](int rank, ep::Buffer& buffer) {
            MoeModel model(c, {at::kCPU, at::kFloat, &buffer});
            model.init_random(9);
            auto [begin, count] = part(B, world, rank);
            ForwardOptions options = test::recording();
            options.activation_checkpointing = checkpoint;
            ForwardOutput out =
                model.forward(ids.narrow(0, begin, count), mask.narrow(0, begin, count), options);
            ((out.logits * probe.narrow(0, begin, count)).sum() + out.token_logprobs.sum()).backward();
            outs[rank] = out;
            params[rank] = model.named_parameters();
        });
        std::vector<at::Tensor> logits, logprobs, routing;
        for (auto& o : outs) {
            logits.push_back(o.logits.detach());
            logprobs.push_back(o.token_logprobs.detach());
            routing.push_back(o.routing);
        }
        EXPECT_CLOSE(at::cat(logits, 0), ref.logits, kTol);
        EXPECT_CLOSE(at::cat(logprobs, 0), ref.token_logprobs, kTol);
        EXPECT_TRUE(at::equal(at::cat(routing, 0), ref.routing));

        auto ref_params = single.named_parameters();
        for (size_t i = 0; i < ref_params.size(); ++i) {
            const auto& rp = ref_params[i];
            ASSERT_TRUE(rp.tensor.grad().defined()) << rp.name;
            if (rp.expert) {
                const int64_t L = rp.tensor.size(0) / world;
                for (int rank = 0; rank < world; ++rank) {
                    ASSERT_EQ(params[rank][i].name, rp.name);
                    EXPECT_CLOSE(params[rank][i].tensor.grad(), rp.tensor.grad().narrow(0, rank * L, L), kTol)
                        << rp.name << " rank " << rank;
                }
            } else {  // replicated: the data-parallel sum over ranks equals the one-rank gradient
                at::Tensor sum = at::zeros_like(rp.tensor);
                for (int rank = 0; rank < world; ++rank) sum += params[rank][i].tensor.grad();
                EXPECT_CLOSE(sum, rp.tensor.grad(), kTol) << rp.name;
            }
        }
    }
}

TEST_P(EpTest, DecodeMatchesOneRank) {
    const int world = GetParam();
    ModelConfig c = tiny_config(2);
    const int64_t B = 4, S = 6, steps = 4;
    at::manual_seed(41);
    at::Tensor ids = at::randint(1, c.vocab_size, {B, S}, at::kLong);
    at::Tensor mask = at::ones({B, S}, at::kLong);
    mask[1].narrow(0, 0, 3).zero_();
    mask[2].narrow(0, 0, 5).zero_();
    at::Tensor cont = at::randint(1, c.vocab_size, {steps, B}, at::kLong);

    MoeModel single(c, {});
    single.init_random(10);
    KvCache cache = single.new_cache(B, S + steps);
    std::vector<at::Tensor> ref = {single.prefill(cache, ids, mask).logits};
    for (int64_t s = 0; s < steps; ++s) ref.push_back(single.decode(cache, cont[s]).logits);

    std::vector<std::vector<at::Tensor>> got(world);
    run_ranks(world, c, 16, at::kFloat, [&](int rank, ep::Buffer& buffer) {
        MoeModel model(c, {at::kCPU, at::kFloat, &buffer});
        model.init_random(10);
        auto [begin, count] = part(B, world, rank);
        KvCache kv = model.new_cache(count, S + steps);
        got[rank].push_back(
            model.prefill(kv, ids.narrow(0, begin, count), mask.narrow(0, begin, count)).logits);
        for (int64_t s = 0; s < steps; ++s)
            got[rank].push_back(model.decode(kv, cont[s].narrow(0, begin, count)).logits);
    });
    for (int64_t s = 0; s <= steps; ++s) {
        std::vector<at::Tensor> parts;
        for (int rank = 0; rank < world; ++rank) parts.push_back(got[rank][s]);
        EXPECT_CLOSE(at::cat(parts, 0), ref[s], kTol) << "step " << s;
    }
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpTest, ::testing::Values(2, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(EpCheckpoint, RanksSaveTheirShardsAndOneRankLoadsThem) {
    ModelConfig c = tiny_config(3, true);
    TempDir dir("ep-ckpt");
    run_ranks(2, c, 8, at::kFloat, [&](int, ep::Buffer& buffer) {
        MoeModel model(c, {at::kCPU, at::kFloat, &buffer});
        model.init_random(12);
        model.save_pretrained(dir.path, 0, "float32");
    });
    MoeModel single(c, {});
    single.init_random(12);
    MoeModel loaded = MoeModel::from_pretrained(dir.path, {});
    auto a = single.state_dict(), b = loaded.state_dict();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
    // And an EP rank loads only its experts from the same directory.
    run_ranks(2, c, 8, at::kFloat, [&](int rank, ep::Buffer& buffer) {
        MoeModel model = MoeModel::from_pretrained(dir.path, {at::kCPU, at::kFloat, &buffer});
        EXPECT_EQ(model.first_local_expert(), rank * 4);
        EXPECT_EQ(model.num_local_experts(), 4);
        for (const auto& [name, t] : model.state_dict()) {
            for (const auto& [n2, t2] : a) {
                if (n2 == name) {
                    EXPECT_TRUE(at::equal(t, t2)) << name;
                }
            }
        }
    });
}

TEST(EpErrors, MismatchedBufferIsNamed) {
    ModelConfig c = tiny_config();
    ModelConfig other = c;
    other.num_experts = 4;
    run_ranks(1, other, 4, at::kFloat, [&](int, ep::Buffer& buffer) {
        EXPECT_THAT(test::error_of([&] {
                        MoeModel m(c, {at::kCPU, at::kFloat, &buffer});
                    }),
                    ::testing::HasSubstr("EP buffer has num_experts = 4, but the model config has 8"));
    });
    run_ranks(1, c, 4, at::kFloat, [&](int, ep::Buffer& buffer) {
        MoeModel m(c, {at::kCPU, at::kFloat, &buffer});
        m.init_random(1);
        c10::NoGradGuard no_grad;
        EXPECT_THAT(test::error_of([&] {
                        m.forward(at::ones({1, 5}, at::kLong), at::Tensor());
                    }),
                    ::testing::HasSubstr("MoE layer got 5 tokens, but the EP buffer holds at most 4"));
    });
}

}  // namespace
}  // namespace moerl::model
