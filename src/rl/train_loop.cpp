// The one training loop (train_loop.hpp): both `moerl run` and `moerl worker --role train`.
#include "moerl/rl/train_loop.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "moerl/control/deferred_ack.hpp"
#include "moerl/control/run_store.hpp"
#include "moerl/core/error.hpp"
#include "moerl/rl/metrics.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/threads.hpp"

namespace moerl::rl {

namespace {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void append_line(const std::string& path, const nlohmann::json& j) {
    if (path.empty()) return;
    std::ofstream out(path, std::ios::app);
    out << j.dump() << "\n";
    out.flush();
    MOERL_CHECK(out.good(), path, ": cannot append");
}

// The rewards of the steps before `first` that metrics.jsonl already holds (a resumed run).
void read_rewards(const std::string& path, std::vector<double>& steps, std::vector<double>& rewards) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded() || !j.contains("step") || !j.contains("reward")) continue;
        steps.push_back(j["step"].get<double>());
        rewards.push_back(j["reward"].get<double>());
    }
}

double mean_of(const std::vector<double>& v, size_t n, bool from_end) {
    if (v.empty()) return 0.0;
    n = std::min(n, v.size());
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += from_end ? v[v.size() - 1 - i] : v[i];
    return s / static_cast<double>(n);
}

// One row of metrics.jsonl: the same fields in every mode.
nlohmann::json metrics_row(const StepResult& r, double tokens_per_s, double step_s) {
    return {{"step", r.step},
            {"version", r.version},
            {"reward", r.reward_mean},
            {"reward_std", r.reward_std},
            {"exact", r.exact_fraction},
            {"loss", r.train.loss},
            {"aux_loss", r.train.aux_loss},
            {"clip_fraction", r.train.clip_fraction},
            {"ratio", r.train.mean_ratio},
            {"is_weight", r.train.mean_is_weight},
            {"kl", r.train.kl},
            {"grad_norm", r.train.grad_norm},
            {"lr", r.train.lr},
            {"response_tokens", r.response_tokens},
            {"staleness", r.staleness_mean},
            {"staleness_max", r.staleness_max},
            {"retried", r.retried},
            {"tokens_per_s", tokens_per_s},
            {"step_seconds", step_s}};
}

class Loop {
  public:
    Loop(const RunConfig& cfg, ControlPlane& cp, const TrainLoopOptions& opt, ExperienceProducer* producer)
        : cfg_(cfg), cp_(cp), opt_(opt), producer_(producer), out_(fs::absolute(cfg.output_dir)) {}

    RunSummary run() {
        pin_threads(cfg_.threads);
        // Before any work: the data files parse (a bad line names file:line), the chat template
        // renders and the first prompt fits. Rollout workers never read the data.
        if (cfg_.use_data) make_prompt_source(cfg_)->train(0, 0);
        fs::create_directories(out_);
        auto deferred = std::make_unique<control::DeferredAckBuffer>(std::move(cp_.experience));
        acks_ = deferred.get();
        cp_.experience = std::move(deferred);
        TrainerRole trainer(cfg_, cp_, (out_ / "trainer").string());
        trainer_ = &trainer;
        const int64_t first = trainer.start(opt_.resume);
        saved_next_ = first;
        note(opt_.resume ? "resumed at step " + std::to_string(first) + " from " + cp_.store->uri()
                         : "fresh start, published v0");
        append_line(opt_.audit_path, {{"event", "start"}, {"pid", ::getpid()}, {"first_step", first}});
        if (producer_) producer_->start(opt_.resume ? trainer.resumed_env_next_step() : 0);

        metrics_path_ = (out_ / "metrics.jsonl").string();
        if (opt_.resume) {
            truncate_metrics(metrics_path_, first);
            read_rewards(metrics_path_, steps_axis_, rewards_);
        } else {
            std::ofstream(metrics_path_, std::ios::trunc);
        }
        std::ofstream metrics(metrics_path_, std::ios::app);

        int64_t step = first, done_here = 0;
        bool reached = false, stopped = false;
        for (; step < cfg_.steps; ++step) {
            if (opt_.stop_after >= 0 && done_here >= opt_.stop_after) break;
            if (stop_requested()) {
                stopped = true;
                break;
            }
            if (opt_.check) opt_.check();
            const auto ts = Clock::now();
            const double sampled_per_s = producer_ ? producer_->produce(step) : -1;
            std::optional<StepResult> r = wait_and_train(step);
            if (!r) {  // terminated while waiting: nothing of this step is trained
                stopped = true;
                break;
            }
            ++done_here;
            const double step_s = seconds_since(ts);
            // Without a producer here, the rate at which the rollout workers delivered this step.
            const double tokens_per_s = sampled_per_s >= 0 ? sampled_per_s
                                        : step_s > 0       ? static_cast<double>(r->response_tokens) / step_s
                                                           : 0.0;
            nlohmann::json row = metrics_row(*r, tokens_per_s, step_s);
            if (cfg_.eval.every > 0 && ((step + 1) % cfg_.eval.every == 0 || step + 1 == cfg_.steps))
                evaluate(row);
            metrics << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
            metrics.flush();
            MOERL_CHECK(metrics.good(), metrics_path_, ": cannot append");
            steps_axis_.push_back(static_cast<double>(step));
            rewards_.push_back(r->reward_mean);
            progress(*r, tokens_per_s);
            append_line(opt_.audit_path, {{"event", "step"},
                                          {"pid", ::getpid()},
                                          {"step", step},
                                          {"reward", r->reward_mean},
                                          {"tasks", r->task_ids},
                                          {"retried", r->retried},
                                          {"dup_acks", r->duplicates},
                                          {"staleness_max", r->staleness_max}});
            reached = cfg_.stop_at_reward > 0 && rewards_.size() >= 10 &&
                      mean_of(rewards_, 10, true) >= cfg_.stop_at_reward;
            const int64_t next = step + 1;
            if (reached) {
                step = next;
                break;
            }
            if (cfg_.checkpoint_every > 0 && next % cfg_.checkpoint_every == 0 && next < cfg_.steps)
                checkpoint(next);
        }
        if (opt_.progress && inline_progress()) std::fprintf(stderr, "\n");

        RunSummary s;
        s.stopped = stopped;
        s.reached_reward = reached;
        s.steps_done = step;
        s.final_reward = mean_of(rewards_, 10, true);
        s.first_reward = mean_of(rewards_, 10, false);
        s.metrics_path = metrics_path_;
        s.svg_path = (out_ / "reward.svg").string();
        write_reward_svg(s.svg_path, steps_axis_, rewards_,
                         cfg_.name + ": mean reward (" + (cfg_.use_data ? "data" : cfg_.task.kind) + ")");
        if (stopped) {
            // The steps since the last checkpoint are not durable: their experiences stay
            // unacknowledged and a resumed trainer trains them again.
            note("terminated before step " + std::to_string(step) +
                 "; resume restarts from the newest checkpoint (step " + std::to_string(saved_next_) + ")");
        } else {
            if (saved_next_ != step) checkpoint(step);
            if (reached || step >= cfg_.steps) {
                nlohmann::json done = {
                    {"next_step", step}, {"version", trainer.version()}, {"reached_reward", reached}};
                control::write_run_done(*cp_.store, done.dump(), (out_ / "tmp").string());
                append_line(opt_.audit_path, {{"event", "done"}, {"pid", ::getpid()}, {"next_step", step}});
                note("run finished after step " + std::to_string(step) + "; metrics: " + metrics_path_);
            }
        }
        s.wall_seconds = seconds_since(t0_);
        return s;
    }

  private:
    bool stop_requested() const { return opt_.stop && opt_.stop->load(); }
    bool inline_progress() const { return opt_.who.empty() && ::isatty(2); }
    std::string prefix() const { return "[" + (opt_.who.empty() ? cfg_.name : opt_.who) + "] "; }
    void note(const std::string& text) const {
        if (opt_.log) opt_.log(text);
    }

    // Takes the step's experiences in short waits, so that a termination notice is seen; says
    // every 30 s what it waits for, and fails after step_timeout_s when that is set.
    std::optional<StepResult> wait_and_train(int64_t step) {
        const auto t = Clock::now();
        auto next_note = t + std::chrono::seconds(30);
        while (!stop_requested()) {
            auto r = trainer_->train_step(step, control::Millis(500));
            if (r) return r;
            MOERL_CHECK(opt_.step_timeout_s <= 0 || seconds_since(t) < opt_.step_timeout_s,
                        "trainer: the experiences of step ", step, " did not arrive within ",
                        opt_.step_timeout_s, " s");
            if (Clock::now() > next_note) {
                next_note = Clock::now() + std::chrono::seconds(30);
                note("still waiting for the experiences of step " + std::to_string(step));
            }
        }
        return std::nullopt;
    }

    // Greedy pass@1 and mean reward of the policy just published, into the step's metrics row.
    void evaluate(nlohmann::json& row) {
        if (!evaluator_) evaluator_ = std::make_unique<Evaluator>(cfg_, cp_, (out_ / "eval").string());
        const EvalResult e = evaluator_->run();
        row["eval_pass_at_1"] = e.pass_at_1;
        row["eval_reward"] = e.reward;
        row["eval_prompts"] = e.prompts;
        row["eval_seconds"] = e.seconds;
        row["eval_sample"] = e.sample;
        if (!opt_.progress) return;
        std::fprintf(
            stderr, "%s%seval v%lld: pass@1 %.3f  reward %.3f  (%lld prompts, greedy, %.1fs)  first: %s\n",
            inline_progress() ? "\n" : "", prefix().c_str(), static_cast<long long>(e.version), e.pass_at_1,
            e.reward, static_cast<long long>(e.prompts), e.seconds,
            nlohmann::json(e.sample).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    }

    // A checkpoint for `next_step`, then the acknowledgement of the experiences it holds.
    void checkpoint(int64_t next_step) {
        if (opt_.check) opt_.check();
        trainer_->save_checkpoint(next_step, std::min(cfg_.steps, next_step + cfg_.max_staleness));
        acks_->commit();
        saved_next_ = next_step;
    }

    void progress(const StepResult& r, double tokens_per_s) const {
        if (!opt_.progress) return;
        const bool inline_line = inline_progress();
        char retried[32] = "";
        if (r.retried > 0)
            std::snprintf(retried, sizeof retried, "  retried %lld", static_cast<long long>(r.retried));
        std::fprintf(stderr,
                     "%s%sstep %lld/%lld  v%lld  reward %.3f (avg10 %.3f)  exact %3.0f%%  tok/s %6.0f  "
                     "staleness %.2f  loss %+.4f%s  %.0fs%s",
                     inline_line ? "\r" : "", prefix().c_str(), static_cast<long long>(r.step + 1),
                     static_cast<long long>(cfg_.steps), static_cast<long long>(r.version), r.reward_mean,
                     mean_of(rewards_, 10, true), 100 * r.exact_fraction, tokens_per_s, r.staleness_mean,
                     r.train.loss, retried, seconds_since(t0_), inline_line ? "   " : "\n");
        std::fflush(stderr);
    }

    const RunConfig& cfg_;
    ControlPlane& cp_;
    const TrainLoopOptions& opt_;
    ExperienceProducer* producer_;
    const fs::path out_;
    const Clock::time_point t0_ = Clock::now();
    control::DeferredAckBuffer* acks_ = nullptr;
    TrainerRole* trainer_ = nullptr;
    std::unique_ptr<Evaluator> evaluator_;  // made at the first eval (eval.every > 0)
    int64_t saved_next_ = 0;                // next_step of the newest checkpoint (or of the start)
    std::string metrics_path_;
    std::vector<double> steps_axis_, rewards_;
};

}  // namespace

RunSummary train_loop(const RunConfig& config, ControlPlane& control, const TrainLoopOptions& options,
                      ExperienceProducer* producer) {
    return Loop(config, control, options, producer).run();
}

}  // namespace moerl::rl
