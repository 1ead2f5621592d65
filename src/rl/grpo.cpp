#include "moerl/rl/grpo.hpp"

#include <ATen/ATen.h>

#include <algorithm>
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

GrpoOutput grpo_loss_queued(const GrpoInputs& in, const GrpoParams& p) {
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
    const at::Tensor count = mask.sum();
    at::Tensor prox = in.prox_logp.detach();
    at::Tensor w_raw = at::exp(prox - in.behaviour_logp.detach());
    at::Tensor w = at::clamp_max(w_raw, p.tis_cap);
    at::Tensor ratio = at::exp(in.logp - prox);
    at::Tensor adv = in.advantages.dim() == 2 ? in.advantages.to(at::kFloat)
                                              : in.advantages.to(at::kFloat).unsqueeze(1).expand_as(ratio);
    at::Tensor unclipped = ratio * adv;
    at::Tensor clipped = at::clamp(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high) * adv;
    at::Tensor per_token = -w * at::minimum(unclipped, clipped);
    at::Tensor kl_sum = at::zeros({}, mask.options());
    if (p.kl_coef > 0) {
        at::Tensor d = in.ref_logp.detach() - in.logp;
        at::Tensor k3 = at::exp(d) - d - 1;
        per_token = per_token + p.kl_coef * k3;
        kl_sum = (k3.detach() * mask).sum();
    }
    // Over the given token count, else this batch's own (at least 1): no synchronisation either way.
    const at::Tensor loss_sum = (per_token * mask).sum();
    GrpoOutput out;
    out.loss = in.num_tokens > 0 ? loss_sum / in.num_tokens : loss_sum / count.clamp_min(1.0);
    // The gradient is zero where the clipped branch is the smaller one and differs from the other.
    const at::Tensor lost = (clipped < unclipped).to(at::kFloat) * mask;
    out.sums = at::stack({count, kl_sum, lost.sum(), (ratio.detach() * mask).sum(), (w * mask).sum(),
                          ((w_raw > p.tis_cap).to(at::kFloat) * mask).sum()});
    return out;
}

void GrpoOutput::read_stats(const double* v) {
    const double local_n = std::max(1.0, v[0]);
    kl = v[1] / local_n;
    clip_fraction = v[2] / local_n;
    mean_ratio = v[3] / local_n;
    mean_is_weight = v[4] / local_n;
    truncated_fraction = v[5] / local_n;
}

GrpoOutput grpo_loss(const GrpoInputs& in, const GrpoParams& p) {
    GrpoOutput out = grpo_loss_queued(in, p);
    const at::Tensor host = out.sums.to(at::kCPU, at::kDouble).contiguous();  // one synchronisation
    out.read_stats(host.data_ptr<double>());
    return out;
}

}  // namespace moerl::rl
