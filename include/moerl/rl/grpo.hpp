// GRPO: group-normalised advantages and the clipped, importance-weighted token-level loss.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace moerl::rl {

struct GrpoParams {
    double clip_low = 0.2;   // ratio floor 1 - clip_low, in [0, 1)
    double clip_high = 0.2;  // ratio ceiling 1 + clip_high, > 0
    double kl_coef = 0.0;    // weight of the k3 KL estimate to the reference policy, >= 0
    double tis_cap = 2.0;    // truncation of the importance weight pi_prox / pi_behaviour, >= 1
    double adv_eps = 1e-6;   // added to the group std
};

// rewards of num_groups * group_size samples, group-major. A_i = (r_i - mean_g) / (std_g + eps),
// std over the group with divisor G (population). A group with equal rewards gets 0.
std::vector<double> group_advantages(const std::vector<double>& rewards, int group_size, double eps = 1e-6);

struct GrpoInputs {
    at::Tensor logp;            // [N, S] fp32 current policy log-probs (differentiable)
    at::Tensor prox_logp;       // [N, S] the policy at the start of this step (no grad)
    at::Tensor behaviour_logp;  // [N, S] log-probs recorded by rollout
    at::Tensor advantages;      // [N] fp32 per sample, or [N, S] per token (packed rows)
    at::Tensor mask;            // [N, S] fp32, 1 on response tokens
    at::Tensor ref_logp;        // [N, S] reference policy (optional; needed when kl_coef > 0)
    double num_tokens = 0;      // token-level mean divisor; 0 = mask.sum() (set it to the global
                                // count when the batch is split over ranks)
};

struct GrpoOutput {
    at::Tensor loss;  // scalar
    // The statistics below as sums over the response tokens, on the loss's device: [6] fp32 of
    // (tokens, k3 KL, tokens that lost their gradient to the clip, ratio, importance weight, tokens
    // whose weight hit tis_cap). read_stats() turns them into the means.
    at::Tensor sums;
    static constexpr int kNumSums = 6;
    double clip_fraction = 0;  // tokens whose ratio was clipped and that lost their gradient
    double mean_ratio = 0;
    double mean_is_weight = 0;      // mean truncated importance weight
    double truncated_fraction = 0;  // tokens whose importance weight hit tis_cap
    double kl = 0;                  // mean k3 KL to the reference (0 without one)

    // The means from sums copied to the host as doubles ([kNumSums], in sums' order).
    void read_stats(const double* host_sums);
};

// Per token: w = min(exp(prox - behaviour), tis_cap) (no grad); r = exp(logp - prox);
// l = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3(ref, logp);
// loss = sum(l * mask) / num_tokens. The statistics are read (one synchronisation).
GrpoOutput grpo_loss(const GrpoInputs& in, const GrpoParams& params);

// The same with the statistics left in `sums` on the device: a trainer reads every micro-batch's
// at once, after its update is queued.
GrpoOutput grpo_loss_queued(const GrpoInputs& in, const GrpoParams& params);

}  // namespace moerl::rl
