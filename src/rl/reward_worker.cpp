// The reward stage (reward_worker.hpp): lease, score in batches, push, acknowledge.
#include "moerl/rl/reward_worker.hpp"

#include <chrono>
#include <optional>
#include <vector>

#include "model_options.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/reward_model.hpp"

namespace moerl::rl {

namespace {
using Clock = std::chrono::steady_clock;

int policy_vocab_size(const RunConfig& c) {
    return c.model_path.empty() ? c.model.vocab_size : model::ModelConfig::load(c.model_path).vocab_size;
}

// Checks what can be checked before loading, then loads reward.model_path.
model::RewardModel load_reward_model(const RunConfig& c, const ControlPlane& cp, const std::string& name) {
    MOERL_CHECK(
        cp.scoring != nullptr, "reward worker ", name, ": ", c.source,
        " has no reward.model_path, so nothing is scored: its rollout workers pass experiences to the "
        "trainer directly");
    model::RewardModel rm = model::RewardModel::from_pretrained(
        c.reward_model_path, role_model_options(c, c.reward_device, c.reward_dtype, "reward.device"),
        c.reward_label);
    const int policy_vocab = policy_vocab_size(c);
    MOERL_CHECK(rm.config().vocab_size >= policy_vocab, c.source, ": reward.model_path ", c.reward_model_path,
                " has vocab_size ", rm.config().vocab_size, ", smaller than the policy's ", policy_vocab,
                ": it cannot read every response");
    return rm;
}
}  // namespace

std::string scoring_run_id(const std::string& run_id) { return run_id + "/score"; }

struct RewardWorker::Impl {
    const RunConfig cfg;
    ControlPlane& cp;
    const std::string name;
    model::RewardModel model;
    RewardStats stats;

    Impl(const RunConfig& c, ControlPlane& control, std::string n)
        : cfg(c), cp(control), name(std::move(n)), model(load_reward_model(c, control, name)) {}

    // One batch: up to reward.batch_size leases. Returns how many were passed on; nullopt when
    // none arrived.
    std::optional<size_t> batch(control::Millis wait, const std::atomic<bool>* stop) {
        std::vector<control::Lease> leases;
        while (static_cast<int>(leases.size()) < cfg.reward_batch_size) {
            auto lease = cp.scoring->lease(name, leases.empty() ? wait : control::Millis(0));
            if (!lease) break;
            leases.push_back(std::move(*lease));
        }
        if (leases.empty()) return std::nullopt;
        if (stop && stop->load()) {
            for (const auto& l : leases) cp.scoring->release(l, "");
            stats.released += static_cast<int64_t>(leases.size());
            return 0;
        }
        std::vector<ExperienceRecord> records;
        std::vector<std::vector<int>> sequences;
        for (const auto& l : leases) {
            records.push_back(experience_from_json(l.task.payload));
            const ExperienceRecord& e = records.back();
            std::vector<int> seq = e.task.prompt_tokens;
            seq.insert(seq.end(), e.trajectory.tokens.begin(), e.trajectory.tokens.end());
            sequences.push_back(std::move(seq));
            stats.redone += l.task.attempt > 0 ? 1 : 0;
        }
        const auto t0 = Clock::now();
        const std::vector<double> scores = model.score(sequences, cfg.reward_batch_size);
        stats.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
        ++stats.batches;
        for (size_t i = 0; i < leases.size(); ++i) {
            ExperienceRecord& e = records[i];
            e.reward += cfg.reward_model_weight * scores[i];  // the rollout put the verifier's part
            if (!cp.experience->push({e.task_id, e.attempt, e.oldest_version(), to_json(e)}))
                ++stats.duplicates;
            cp.scoring->ack(leases[i]);
            ++stats.scored;
        }
        return leases.size();
    }

    size_t work(control::Millis wait, const std::atomic<bool>* stop) {
        size_t passed = 0;
        while (!(stop && stop->load())) {
            auto n = batch(wait, stop);
            if (!n) break;
            passed += *n;
        }
        return passed;
    }
};

RewardWorker::RewardWorker(const RunConfig& config, ControlPlane& control, std::string name)
    : impl_(std::make_unique<Impl>(config, control, std::move(name))) {}
RewardWorker::~RewardWorker() = default;
size_t RewardWorker::work(control::Millis wait, const std::atomic<bool>* stop) {
    return impl_->work(wait, stop);
}
const RewardStats& RewardWorker::stats() const { return impl_->stats; }

}  // namespace moerl::rl
