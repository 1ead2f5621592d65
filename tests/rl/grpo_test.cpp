// GRPO advantages and loss against hand-computed values; clipping and importance weights at their
// boundaries.
#include "moerl/rl/grpo.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "moerl/core/error.hpp"

using namespace moerl::rl;

TEST(GroupAdvantages, HandComputed) {
    // Group 1: mean 0.5, population std 0.5. Group 2: equal rewards -> 0.
    auto a = group_advantages({1.0, 0.0, 0.5, 0.5}, 2, 0.0);
    EXPECT_DOUBLE_EQ(a[0], 1.0);
    EXPECT_DOUBLE_EQ(a[1], -1.0);
    EXPECT_DOUBLE_EQ(a[2], 0.0);
    EXPECT_DOUBLE_EQ(a[3], 0.0);
    // 0,1,2,3: mean 1.5, variance 1.25.
    auto b = group_advantages({0, 1, 2, 3}, 4, 0.0);
    EXPECT_NEAR(b[0], -1.5 / std::sqrt(1.25), 1e-12);
    EXPECT_NEAR(b[3], 1.5 / std::sqrt(1.25), 1e-12);
    // eps keeps the division finite.
    auto c = group_advantages({1, 0}, 2, 1e-6);
    EXPECT_NEAR(c[0], 0.5 / (0.5 + 1e-6), 1e-12);
    EXPECT_THROW(group_advantages({1, 2, 3}, 2), moerl::Error);
}

namespace {
// One sequence, tokens 1..3 are the response; all log-probs given per token.
GrpoInputs one_row(std::vector<float> logp, std::vector<float> prox, std::vector<float> beh, double adv) {
    GrpoInputs in;
    in.logp = at::tensor(logp).view({1, -1}).set_requires_grad(true);
    in.prox_logp = at::tensor(prox).view({1, -1});
    in.behaviour_logp = at::tensor(beh).view({1, -1});
    in.advantages = at::tensor(std::vector<float>{static_cast<float>(adv)});
    in.mask = at::tensor(std::vector<float>{0, 1, 1, 1}).view({1, -1});
    return in;
}
}  // namespace

TEST(GrpoLoss, OnPolicyValueAndGradient) {
    // ratio 1, weight 1: per token -A; token mean over 3 tokens.
    auto in = one_row({0, -0.7f, -1.4f, -0.1f}, {0, -0.7f, -1.4f, -0.1f}, {0, -0.7f, -1.4f, -0.1f}, 2.0);
    GrpoOutput out = grpo_loss(in, GrpoParams{});
    EXPECT_NEAR(out.loss.item<double>(), -2.0, 1e-6);
    out.loss.backward();
    auto g = in.logp.grad();
    EXPECT_NEAR(g[0][0].item<double>(), 0.0, 1e-7);  // prompt token: masked
    for (int t = 1; t < 4; ++t) EXPECT_NEAR(g[0][t].item<double>(), -2.0 / 3.0, 1e-6);
    EXPECT_DOUBLE_EQ(out.clip_fraction, 0.0);
    EXPECT_NEAR(out.mean_ratio, 1.0, 1e-6);
    EXPECT_NEAR(out.mean_is_weight, 1.0, 1e-6);
}

TEST(GrpoLoss, GlobalTokenCountDivides) {
    auto in = one_row({0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, 1.0);
    in.num_tokens = 6;  // this rank holds half of the batch's tokens
    EXPECT_NEAR(grpo_loss(in, GrpoParams{}).loss.item<double>(), -0.5, 1e-6);
}

TEST(GrpoLoss, ClippingAtTheBoundaries) {
    GrpoParams p;
    p.clip_low = 0.2;
    p.clip_high = 0.2;
    const float above = std::log(1.2f + 1e-3f), below = std::log(1.2f - 1e-3f);
    const float low_out = std::log(0.8f - 1e-3f), low_in = std::log(0.8f + 1e-3f);
    // Positive advantage: ratio just above 1 + eps is clipped (no gradient), just below is not.
    // Negative advantage: ratio just below 1 - eps is clipped, just above is not.
    struct Case {
        float log_ratio;
        double adv;
        bool clipped;
    } cases[] = {{above, 1.0, true},   {below, 1.0, false},   {low_out, 1.0, false},
                 {above, -1.0, false}, {low_out, -1.0, true}, {low_in, -1.0, false}};
    for (const auto& c : cases) {
        auto in = one_row({0, c.log_ratio, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, c.adv);
        GrpoOutput out = grpo_loss(in, p);
        out.loss.backward();
        const double g = in.logp.grad()[0][1].item<double>();
        const double ratio = std::exp(static_cast<double>(c.log_ratio));
        const double expected_value =
            c.clipped ? (c.adv > 0 ? 1.2 : 0.8) * c.adv : ratio * c.adv;  // the token's min(...) term
        // token 1's loss term plus tokens 2,3 at ratio 1, all over 3 tokens
        EXPECT_NEAR(out.loss.item<double>(), -(expected_value + 2 * c.adv) / 3.0, 1e-5) << c.log_ratio;
        if (c.clipped) {
            EXPECT_EQ(g, 0.0) << "ratio " << ratio << " adv " << c.adv;
            EXPECT_NEAR(out.clip_fraction, 1.0 / 3.0, 1e-9);
        } else {
            EXPECT_NEAR(g, -ratio * c.adv / 3.0, 1e-5) << "ratio " << ratio << " adv " << c.adv;
            EXPECT_EQ(out.clip_fraction, 0.0);
        }
    }
}

TEST(GrpoLoss, TruncatedImportanceWeights) {
    GrpoParams p;
    p.tis_cap = 2.0;
    // prox - behaviour: log 1.5 (kept), log 2 (the cap, kept), log 5 (truncated to 2).
    auto in =
        one_row({0, 0, 0, 0}, {0, 0, 0, 0}, {0, -std::log(1.5f), -std::log(2.0f), -std::log(5.0f)}, 1.0);
    GrpoOutput out = grpo_loss(in, p);
    EXPECT_NEAR(out.loss.item<double>(), -(1.5 + 2.0 + 2.0) / 3.0, 1e-5);
    EXPECT_NEAR(out.mean_is_weight, (1.5 + 2 + 2) / 3.0, 1e-5);
    EXPECT_NEAR(out.truncated_fraction, 1.0 / 3.0, 1e-9);
    out.loss.backward();
    EXPECT_NEAR(in.logp.grad()[0][3].item<double>(), -2.0 / 3.0, 1e-5);
    // A behaviour policy more likely than the current one gives weights below 1, untruncated.
    auto in2 = one_row({0, 0, 0, 0}, {0, 0, 0, 0}, {0, std::log(2.0f), 0, 0}, 1.0);
    EXPECT_NEAR(grpo_loss(in2, p).loss.item<double>(), -(0.5 + 1 + 1) / 3.0, 1e-5);
}

TEST(GrpoLoss, KlToReference) {
    GrpoParams p;
    p.kl_coef = 0.5;
    auto in = one_row({0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, 0.0);
    in.ref_logp = at::tensor(std::vector<float>{0, std::log(0.5f), 0, 0}).view({1, -1});
    GrpoOutput out = grpo_loss(in, p);
    // k3 at d = log 0.5: 0.5 - log 0.5 - 1.
    const double k3 = 0.5 - std::log(0.5) - 1;
    EXPECT_NEAR(out.kl, k3 / 3.0, 1e-6);
    EXPECT_NEAR(out.loss.item<double>(), 0.5 * k3 / 3.0, 1e-6);
    GrpoParams no_ref;
    no_ref.kl_coef = 0.1;
    in.ref_logp = at::Tensor();
    EXPECT_THROW(grpo_loss(in, no_ref), moerl::Error);
}
