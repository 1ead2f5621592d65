#include "moerl/rl/grpo.hpp"

#include <ATen/ATen.h>

#include <cmath>

#include "moerl/core/error.hpp"

namespace moerl::rl {

std::vector<double> group_advantages(const std::vector<double>& rewards, int group_size, double eps) {
    MOERL_CHECK(group_size >= 1 && rewards.size() % group_size == 0, "group_advantages: ", rewards.size(),
                " rewards are not a whole number of groups of ", group_size);
    std::vector<double> adv(rewards.size());
    for (size_t g = 0; g < rewards.size(); g += group_size) {
        double mean = 0, var = 0;
        for (int i = 0; i < group_size; ++i) mean += rewards[g + i];
        mean /= group_size;
        for (int i = 0; i < group_size; ++i) var += (rewards[g + i] - mean) * (rewards[g + i] - mean);
        const double std = std::sqrt(var / group_size);
        for (int i = 0; i < group_size; ++i)
            adv[g + i] = std > 0 ? (rewards[g + i] - mean) / (std + eps) : 0.0;
    }
    return adv;
}

GrpoOutput grpo_loss(const GrpoInputs& in, const GrpoParams& p) {
    MOERL_CHECK(in.logp.dim() == 2 && in.prox_logp.sizes() == in.logp.sizes() &&
                    in.behaviour_logp.sizes() == in.logp.sizes() && in.mask.sizes() == in.logp.sizes(),
                "grpo_loss: logp ", in.logp.sizes(), ", prox_logp ", in.prox_logp.sizes(),
                ", behaviour_logp ", in.behaviour_logp.sizes(), " and mask ", in.mask.sizes(),
                " must all be [N, S]");
    MOERL_CHECK((in.advantages.dim() == 1 && in.advantages.size(0) == in.logp.size(0)) ||
                    in.advantages.sizes() == in.logp.sizes(),
                "grpo_loss: advantages ", in.advantages.sizes(), ", expected [", in.logp.size(0), "] or ",
                in.logp.sizes());
    MOERL_CHECK(p.kl_coef == 0 || in.ref_logp.defined(), "grpo_loss: kl_coef = ", p.kl_coef,
                " needs reference log-probs");
    const at::Tensor mask = in.mask.to(at::kFloat);
    const double n = in.num_tokens > 0 ? in.num_tokens : std::max(1.0, mask.sum().item<double>());
    const double local_n = std::max(1.0, mask.sum().item<double>());
    at::Tensor prox = in.prox_logp.detach();
    at::Tensor w_raw = at::exp(prox - in.behaviour_logp.detach());
    at::Tensor w = at::clamp_max(w_raw, p.tis_cap);
    at::Tensor ratio = at::exp(in.logp - prox);
    at::Tensor adv = in.advantages.dim() == 2 ? in.advantages.to(at::kFloat)
                                              : in.advantages.to(at::kFloat).unsqueeze(1).expand_as(ratio);
    at::Tensor unclipped = ratio * adv;
    at::Tensor clipped = at::clamp(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high) * adv;
    at::Tensor per_token = -w * at::minimum(unclipped, clipped);
    GrpoOutput out;
    if (p.kl_coef > 0) {
        at::Tensor d = in.ref_logp.detach() - in.logp;
        at::Tensor k3 = at::exp(d) - d - 1;
        per_token = per_token + p.kl_coef * k3;
        out.kl = (k3.detach() * mask).sum().item<double>() / local_n;
    }
    out.loss = (per_token * mask).sum() / n;
    // The gradient is zero where the clipped branch is the smaller one and differs from the other.
    at::Tensor lost = (clipped < unclipped).to(at::kFloat) * mask;
    out.clip_fraction = lost.sum().item<double>() / local_n;
    out.mean_ratio = (ratio.detach() * mask).sum().item<double>() / local_n;
    out.mean_is_weight = (w * mask).sum().item<double>() / local_n;
    out.truncated_fraction = ((w_raw > p.tis_cap).to(at::kFloat) * mask).sum().item<double>() / local_n;
    return out;
}

}  // namespace moerl::rl
