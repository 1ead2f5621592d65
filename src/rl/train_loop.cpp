// The one training loop (train_loop.hpp): both `moerl run` and `moerl worker --role train`.
#include "moerl/rl/train_loop.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <vector>

#include "moerl/control/deferred_ack.hpp"
#include "moerl/control/run_lock.hpp"
#include "moerl/control/run_store.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "moerl/rl/metrics.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/threads.hpp"
#include "role_metrics.hpp"

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

// "45s", "3m07s", "2h05m".
std::string duration_text(double seconds) {
    const long long s = static_cast<long long>(seconds + 0.5);
    char buf[32];
    if (s < 60)
        std::snprintf(buf, sizeof buf, "%llds", s);
    else if (s < 3600)
        std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
    else
        std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
    return buf;
}

// Columns of the terminal on stderr (TIOCGWINSZ, else COLUMNS, else 80).
size_t terminal_columns() {
    struct winsize ws {};
    if (::ioctl(2, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
    if (auto columns = env::get("COLUMNS")) {
        const long n = std::strtol(columns->c_str(), nullptr, 10);
        if (n > 0) return static_cast<size_t>(n);
    }
    return 80;
}

// The fields of `parts` (text, priority) in order, leaving out the lowest priorities until the
// line is at most `width` characters.
std::string fit_line(std::vector<std::pair<std::string, int>> parts, size_t width) {
    auto length = [&] {
        size_t n = 0;
        for (const auto& p : parts) n += p.first.size() + 2;
        return n;
    };
    while (parts.size() > 1 && length() > width) {
        auto lowest = std::min_element(parts.begin(), parts.end(),
                                       [](const auto& a, const auto& b) { return a.second < b.second; });
        parts.erase(lowest);
    }
    std::string line;
    for (const auto& p : parts) line += (line.empty() ? "" : "  ") + p.first;
    return line.substr(0, width);
}

// One row of metrics.jsonl: the same fields in every mode.
// The producer's phase times are null where the rollout runs elsewhere.
nlohmann::json metrics_row(const StepResult& r, double tokens_per_s, double step_s, const ProducedStep* p) {
    auto here = [p](double v) { return p ? nlohmann::json(v) : nlohmann::json(nullptr); };
    return {
        {"step", r.step},
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
        {"step_seconds", step_s},
        {"logprob_diff", r.train.logprob_diff},
        {"ratio_std", r.train.behaviour_ratio_std},
        {"rollout_s", here(p ? p->generate_s : 0)},
        {"reward_s", here(p ? p->reward_s : 0)},
        {"sync_s", here(p ? p->sync_s : 0)},
        {"sync_bytes", p ? nlohmann::json(p->sync_bytes) : nlohmann::json(nullptr)},
        {"sync_path", p && !p->sync_path.empty() ? nlohmann::json(p->sync_path) : nlohmann::json(nullptr)},
        {"rollout_released_bytes", p ? nlohmann::json(p->rollout_released_bytes) : nlohmann::json(nullptr)},
        {"rollout_kept_bytes", p ? nlohmann::json(p->rollout_kept_bytes) : nlohmann::json(nullptr)},
        {"prompt_tokens", p ? nlohmann::json(p->prompt_tokens) : nlohmann::json(nullptr)},
        {"prompt_tokens_shared", p ? nlohmann::json(p->prompt_tokens_shared) : nlohmann::json(nullptr)},
        {"train_s", r.train_seconds},
        {"train_peak_bytes", r.train_peak_bytes},
        {"decode_s", here(p ? p->decode.seconds : 0)},
        {"decode_bytes", here(p ? p->decode.bytes : 0)},
        {"decode_steps", p ? nlohmann::json(p->decode.steps) : nlohmann::json(nullptr)},
        {"rollout_peak_bytes", p ? nlohmann::json(p->peak_bytes) : nlohmann::json(nullptr)},
        {"train_tokens", r.train.total_tokens},
        {"attention_pairs", r.train.attention_pairs},
        {"publish_s", r.publish_seconds}};
}

class Loop {
  public:
    Loop(const RunConfig& cfg, ControlPlane& cp, const TrainLoopOptions& opt, ExperienceProducer* producer)
        : cfg_(cfg),
          cp_(cp),
          opt_(opt),
          producer_(producer),
          out_(fs::absolute(cfg.output_dir)),
          role_metrics_(opt.metrics) {}

    RunSummary run() {
        pin_threads(cfg_.threads);
        // Before any work: the data files parse (a bad line names file:line), the chat template
        // renders and the first prompt fits. Rollout workers never read the data.
        if (cfg_.use_data) make_prompt_source(cfg_)->train(0, 0);
        fs::create_directories(out_);
        // One process per output directory (metrics.jsonl, staging files): created here.
        dir_lock_ = control::lock_run_directory(out_.string());
        MOERL_CHECK(opt_.resume || control::published_checkpoints(*cp_.store, "ckpt-").empty(),
                    "output directory ", out_.string(), " already holds checkpoints (", cp_.store->uri(),
                    "): pass --resume to continue that run, or choose another --out");
        auto deferred = std::make_unique<control::DeferredAckBuffer>(std::move(cp_.experience));
        acks_ = deferred.get();
        cp_.experience = std::move(deferred);
        role_metrics_.time_publishes(cp_);
        TrainerRole trainer(cfg_, cp_, (out_ / "trainer").string(), opt_.handoff, opt_.trainer_processes);
        trainer_ = &trainer;
        const std::string resumed_from = opt_.resume ? describe_resume() : "";
        const int64_t first = trainer.start(opt_.resume);
        saved_next_ = first;
        note((opt_.resume ? "resumed at step " : "starting at step ") + std::to_string(first + 1) + "/" +
             std::to_string(cfg_.steps) +
             (opt_.resume ? " from " + resumed_from : "; checkpoints go to " + cp_.store->uri()));
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

        int64_t step = first;
        bool reached = reward_reached(), stopped = false;
        if (reached)
            note(
                "the run already reached its reward target (10-step mean >= run.stop_at_reward) before "
                "step " +
                std::to_string(first + 1) + "; nothing to train");
        for (; step < cfg_.steps && !reached; ++step) {
            if (opt_.stop_after >= 0 && done_here_ >= opt_.stop_after) break;
            if (stop_requested()) {
                stopped = true;
                break;
            }
            if (opt_.check) opt_.check();
            const auto ts = Clock::now();
            ProducedStep produced;
            if (producer_) produced = producer_->produce(step);
            const double sampled_per_s = producer_ ? produced.tokens_per_s : -1;
            std::optional<StepResult> r = wait_and_train(step);
            if (!r) {  // terminated while waiting: nothing of this step is trained
                stopped = true;
                break;
            }
            ++done_here_;
            const double step_s = seconds_since(ts);
            // Without a producer here, the rate at which the rollout workers delivered this step.
            const double tokens_per_s = sampled_per_s >= 0 ? sampled_per_s
                                        : step_s > 0       ? static_cast<double>(r->response_tokens) / step_s
                                                           : 0.0;
            role_metrics_.step(*r, step_s);
            nlohmann::json row = metrics_row(*r, tokens_per_s, step_s, producer_ ? &produced : nullptr);
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
            reached = reward_reached();
            const int64_t next = step + 1;
            if (reached) {
                step = next;
                break;
            }
            if (cfg_.checkpoint_every > 0 && next % cfg_.checkpoint_every == 0 && next < cfg_.steps)
                checkpoint(next);
        }
        if (inline_line_open_) std::fprintf(stderr, "\n");
        inline_line_open_ = false;

        RunSummary s;
        s.stopped = stopped;
        s.reached_reward = reached;
        s.steps_done = step;
        s.final_reward = mean_of(rewards_, 10, true);
        s.first_reward = mean_of(rewards_, 10, false);
        s.metrics_path = metrics_path_;
        s.svg_path = (out_ / "reward.svg").string();
        s.checkpoints = cp_.store->uri();
        write_reward_svg(s.svg_path, steps_axis_, rewards_,
                         cfg_.name + ": mean reward (" + (cfg_.use_data ? "data" : cfg_.task.kind) + ")");
        if (stopped) {
            // The steps since the last checkpoint are not durable: their experiences stay
            // unacknowledged and a resumed trainer trains them again.
            // (`moerl run` says so itself, with the command that continues.)
            if (opt_.log)
                note("terminated after step " + std::to_string(step) +
                     "; a resume restarts from the newest checkpoint (at step " +
                     std::to_string(saved_next_) + ")");
        } else {
            if (saved_next_ != step && opt_.final_checkpoint) checkpoint(step);
            if (!opt_.final_weights_dir.empty()) {
                trainer.save_weights(opt_.final_weights_dir);
                if (opt_.log)
                    note("policy of step " + std::to_string(step) + " written to " + opt_.final_weights_dir);
            }
            if (reached || step >= cfg_.steps) {
                nlohmann::json done = {
                    {"next_step", step}, {"version", trainer.version()}, {"reached_reward", reached}};
                control::write_run_done(*cp_.store, done.dump(), (out_ / "tmp").string());
                append_line(opt_.audit_path, {{"event", "done"}, {"pid", ::getpid()}, {"next_step", step}});
                if (opt_.log)
                    note(std::string("run finished after step ") + std::to_string(step) +
                         (reached ? " (reward target reached)" : "") + "; metrics: " + metrics_path_ +
                         "; checkpoints: " + cp_.store->uri());
            }
        }
        s.checkpoint_step = saved_next_;
        s.wall_seconds = seconds_since(t0_);
        return s;
    }

  private:
    bool stop_requested() const { return opt_.stop && opt_.stop->load(); }
    bool inline_progress() const { return opt_.who.empty() && ::isatty(2); }
    std::string prefix() const { return "[" + (opt_.who.empty() ? cfg_.name : opt_.who) + "] "; }
    // Through opt_.log (timestamped, role-prefixed) or, without one, "[run.name] text" on stderr.
    void note(const std::string& text) const {
        if (opt_.log) {
            opt_.log(text);
            return;
        }
        std::fprintf(stderr, "%s%s%s\n", inline_line_open_ ? "\n" : "", prefix().c_str(), text.c_str());
        inline_line_open_ = false;
        std::fflush(stderr);
    }
    bool reward_reached() const {
        return cfg_.stop_at_reward > 0 && rewards_.size() >= 10 &&
               mean_of(rewards_, 10, true) >= cfg_.stop_at_reward;
    }
    // "checkpoint ckpt-00000100 in URI" and the newer ones skipped for lack of a manifest.
    std::string describe_resume() const {
        const auto names = control::published_checkpoints(*cp_.store, "ckpt-");
        if (names.empty()) return cp_.store->uri();  // start() says what is wrong
        std::string text = "checkpoint " + names.back() + " in " + cp_.store->uri();
        std::set<std::string> skipped;
        for (const auto& key : cp_.store->list("ckpt-")) {
            const std::string name = key.substr(0, key.find('/'));
            if (name > names.back()) skipped.insert(name);
        }
        for (const auto& name : skipped) text += "; skipped " + name + " (incomplete: no manifest.json)";
        return text;
    }

    // Takes the step's experiences in short waits, so that a termination notice is seen; says
    // every 30 s what it waits for, and fails after step_timeout_s when that is set.
    std::optional<StepResult> wait_and_train(int64_t step) {
        const auto t = Clock::now();
        auto next_note = t + std::chrono::seconds(opt_.wait_note_s);
        auto next_reissue = t + std::chrono::seconds(5);
        bool reissued = false;
        while (!stop_requested()) {
            role_metrics_.sample(cp_);
            recover_if_reset(step);
            auto r = trainer_->train_step(step, control::Millis(500));
            if (r) return r;
            if (producer_ == nullptr && Clock::now() > next_reissue) {
                // Experiences missing and no task open: they were lost with the control plane's
                // data (before this trainer started, or unnoticed). Putting a step again is a no-op
                // for its tasks still open or done, so this is safe whenever it runs.
                next_reissue = Clock::now() + std::chrono::seconds(5);
                if (cp_.tasks->outstanding() == 0) {
                    if (!reissued)
                        note("step " + std::to_string(step + 1) + "/" + std::to_string(cfg_.steps) +
                             ": experiences missing and no task open in the queue; re-issuing the tasks of "
                             "steps " +
                             std::to_string(step + 1) + ".." +
                             std::to_string(std::min(cfg_.steps, step + cfg_.max_staleness + 1)));
                    reissued = true;
                    put_in_flight_steps(step);
                }
            }
            MOERL_CHECK(opt_.step_timeout_s <= 0 || seconds_since(t) < opt_.step_timeout_s,
                        "trainer: the experiences of step ", step + 1, "/", cfg_.steps,
                        " did not arrive within ", opt_.step_timeout_s, " s");
            if (Clock::now() > next_note) {
                next_note = Clock::now() + std::chrono::seconds(opt_.wait_note_s);
                const size_t need = static_cast<size_t>(cfg_.prompts_per_step) * cfg_.group_size;
                const size_t have = trainer_->num_held(step);
                note("step " + std::to_string(step + 1) + "/" + std::to_string(cfg_.steps) + ": waiting " +
                     duration_text(seconds_since(t)) + " for " + std::to_string(need - std::min(need, have)) +
                     " of " + std::to_string(need) + " experiences (" +
                     std::to_string(cp_.tasks->outstanding()) +
                     " tasks open in the queue; a worker killed with its leases frees them after "
                     "control.lease_timeout_ms " +
                     std::to_string(cfg_.lease_timeout_ms) + ")");
            }
        }
        return std::nullopt;
    }

    // The control plane lost its data (a Redis restarted empty): the policy version and the
    // tasks of the steps in flight are gone, and nothing would ever produce the experiences
    // this step still needs. Tasks are a pure function of (seed, step, prompt, sample): put the
    // in-flight steps again (a no-op for tasks still there) and publish the version again.
    void recover_if_reset(int64_t step) {
        if (!opt_.control_plane_reset || !opt_.control_plane_reset()) return;
        const int64_t last = std::min(cfg_.steps, step + cfg_.max_staleness + 1);
        note("the control plane lost the run's data (Redis restarted without its data?): publishing v" +
             std::to_string(trainer_->version()) + " again and re-issuing the tasks of steps " +
             std::to_string(step + 1) + ".." + std::to_string(last) + "; experiences already taken are kept");
        trainer_->republish_policy();
        put_in_flight_steps(step);
    }

    // The tasks of `step` and of the steps the env may have put ahead of it.
    void put_in_flight_steps(int64_t step) {
        const int64_t last = std::min(cfg_.steps, step + cfg_.max_staleness + 1);
        for (int64_t s = step; s < last; ++s) put_step_tasks(cfg_, *cp_.tasks, s);
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

    // One line a step: rewritten in place on a terminal (cut to its width), else a plain line.
    // Fields by priority: step, reward and the stop rule, time and ETA come first.
    void progress(const StepResult& r, double tokens_per_s) const {
        if (!opt_.progress) return;
        auto f = [](const char* format, auto... values) {
            char buf[96];
            std::snprintf(buf, sizeof buf, format, values...);
            return std::string(buf);
        };
        const double elapsed = seconds_since(t0_);
        const int64_t left = cfg_.steps - (r.step + 1);
        std::vector<std::pair<std::string, int>> parts;
        parts.push_back(
            {f("step %lld/%lld", static_cast<long long>(r.step + 1), static_cast<long long>(cfg_.steps)), 9});
        parts.push_back({f("reward %.3f", r.reward_mean), 6});
        parts.push_back({cfg_.stop_at_reward > 0 ? f("avg10 %.3f (stop at %.2f)", mean_of(rewards_, 10, true),
                                                     cfg_.stop_at_reward)
                                                 : f("avg10 %.3f", mean_of(rewards_, 10, true)),
                         8});
        parts.push_back({f("exact %.0f%%", 100 * r.exact_fraction), 3});
        parts.push_back({f("v%lld", static_cast<long long>(r.version)), 1});
        parts.push_back({f("tok/s %.0f", tokens_per_s), 4});
        parts.push_back({f("stale %.2f", r.staleness_mean), 2});
        parts.push_back({f("loss %+.4f", r.train.loss), 2});
        if (r.retried > 0) parts.push_back({f("retried %lld", static_cast<long long>(r.retried)), 5});
        std::string eta = duration_text(elapsed);
        if (left > 0 && done_here_ > 0)
            eta += (cfg_.stop_at_reward > 0 ? " ETA <=" : " ETA ") +
                   duration_text(elapsed / static_cast<double>(done_here_) * static_cast<double>(left));
        parts.push_back({eta, 7});
        if (!inline_progress()) {
            if (opt_.log) {
                opt_.log(fit_line(parts, 1000));
            } else {
                std::fprintf(stderr, "%s%s\n", prefix().c_str(), fit_line(parts, 1000).c_str());
            }
        } else {
            const size_t width = terminal_columns();
            const std::string pre = prefix();
            const std::string line =
                pre + fit_line(parts, width > pre.size() + 1 ? width - pre.size() - 1 : 1);
            // \r, the line, then clear to the end of the line (no stray characters of a longer one).
            std::fprintf(stderr, "\r%s\033[K", line.substr(0, width - 1).c_str());
            inline_line_open_ = true;
        }
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
    std::unique_ptr<Evaluator> evaluator_;   // made at the first eval (eval.every > 0)
    int64_t saved_next_ = 0;                 // next_step of the newest checkpoint (or of the start)
    int64_t done_here_ = 0;                  // steps trained by this call
    mutable bool inline_line_open_ = false;  // the terminal's cursor is after a progress line
    std::unique_ptr<control::RunLock> dir_lock_;
    std::string metrics_path_;
    std::vector<double> steps_axis_, rewards_;
    TrainMetrics role_metrics_;
};

}  // namespace

RunSummary train_loop(const RunConfig& config, ControlPlane& control, const TrainLoopOptions& options,
                      ExperienceProducer* producer) {
    return Loop(config, control, options, producer).run();
}

}  // namespace moerl::rl
