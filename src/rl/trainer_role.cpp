// The train role: takes a step's experiences, updates the policy, publishes each version (files,
// memory, CUDA IPC or broadcast) and keeps the run's checkpoints.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <utility>

#include "cuda_ipc.hpp"
#include "moerl/control/run_store.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/log.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/device_memory.hpp"
#include "moerl/model/model.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/roles.hpp"
#include "policy_broadcast.hpp"
#include "role_common.hpp"

namespace moerl::rl {

namespace {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace detail;  // role_common.hpp: policy names, the trainers of this process
}  // namespace

// ---- train -----------------------------------------------------------------------------------
struct TrainerRole::Impl {
    RunConfig cfg;
    ControlPlane& cp;
    std::string work_dir;
    std::unique_ptr<PolicyTrainer> trainer;
    int64_t version = 0;
    int64_t env_next = 0;
    std::string consumer = "trainer";
    // Experiences taken but not yet trained on, by step and task id (with their delivery ids).
    std::map<int64_t, std::map<std::string, std::pair<ExperienceRecord, std::string>>> held;
    // Trained on (exactly once): every task of the steps before consumed_below (steps are trained
    // in order), and the ids in `consumed` (an older checkpoint's list).
    int64_t consumed_below = 0;
    std::set<std::string> consumed;
    int64_t duplicates = 0;  // dropped by take_available since the last step

    // How new versions reach the rollout workers (PolicyHandoff, resolved): from memory, by CUDA
    // IPC, or as files (also where CUDA IPC failed).
    enum class Route { kFiles, kMemory, kCudaIpc, kBroadcast };
    Route route = Route::kFiles;
    std::unique_ptr<detail::PolicyBroadcaster> broadcaster;  // Route::kBroadcast
    std::vector<std::string> receivers;                      // of the last broadcast
    std::string in_process_id;   // set when readers here ask this trainer (InProcessPolicies)
    double publish_seconds = 0;  // of the last publish_policy()
    int64_t files_version = -1;  // the version whose files publish_policy or files_instead wrote last

    Impl(const RunConfig& c, ControlPlane& control, std::string dir, PolicyHandoff handoff,
         const RoleProcesses* processes)
        : cfg(c), cp(control), work_dir(std::move(dir)) {
        fs::create_directories(work_dir);
        trainer = std::make_unique<PolicyTrainer>(cfg, work_dir, processes);
        // Over processes this one holds only its own experts: memory will not do.
        const bool spread = processes != nullptr && processes->world_size > 1;
        if (handoff == PolicyHandoff::kBroadcast) {
            MOERL_CHECK(!spread, cfg.source, ": sync.transfer: broadcast needs the trainer in one process");
            const std::string why = detail::policy_broadcast_unavailable();
            MOERL_CHECK(why.empty(), cfg.source, ": sync.transfer: broadcast, but ", why);
            detail::BroadcastOptions o;
            o.address = broadcast_address();
            o.port = static_cast<int>(env::get_int("MOERL_SYNC_PORT", cfg.sync_port));
            MOERL_CHECK(o.port >= 0 && o.port < 65536, "MOERL_SYNC_PORT = ", o.port, " is not a port number");
            o.timeout_s = cfg.sync_timeout_s;
            o.join_timeout_s = cfg.sync_join_timeout_s;
            o.log = [](const std::string& text) { log_line(text); };
            broadcaster = std::make_unique<detail::PolicyBroadcaster>(std::move(o));
            route = Route::kBroadcast;
            in_process_id = InProcessPolicies::add(cp.store->uri(), {trainer.get(), nullptr});
            log_line(
                "policies go to the rollout workers by broadcast from " +
                broadcaster->uri(in_process_id).substr(0, broadcaster->uri(in_process_id).rfind('/') + 1) +
                " (sync.transfer: broadcast)");
        } else if (handoff == PolicyHandoff::kInProcess && !spread) {
            route = Route::kMemory;
            in_process_id = InProcessPolicies::add(cp.store->uri(), {trainer.get(), nullptr});
        } else if (handoff != PolicyHandoff::kFiles) {
            const std::string why = cuda_ipc_unavailable();
            if (why.empty()) {
                route = Route::kCudaIpc;
                in_process_id = InProcessPolicies::add(
                    cp.store->uri(), {trainer.get(), [this](int64_t v, const std::string& failure) {
                                          return files_instead(v, failure);
                                      }});
            } else {
                log_line("policies go between the processes as files: " + why);
            }
        }
    }
    ~Impl() {
        if (!in_process_id.empty()) InProcessPolicies::remove(in_process_id, trainer.get());
    }

    // sync.address, else MOERL_SYNC_ADDRESS (a pod's IP from the downward API), else the hostname.
    std::string broadcast_address() const {
        if (!cfg.sync_address.empty()) return cfg.sync_address;
        if (auto from_env = env::get("MOERL_SYNC_ADDRESS")) return *from_env;
        char host[256] = {};
        ::gethostname(host, sizeof(host) - 1);
        return host;
    }

    std::vector<detail::BroadcastSource> broadcast_sources() const {
        std::vector<detail::BroadcastSource> sources;
        for (TrainerRankWeights& r : trainer->rank_weights())
            sources.push_back({r.first_expert, std::move(r.weights)});
        return sources;
    }
    void say_receivers(const std::vector<std::string>& now) {
        if (now == receivers) return;
        receivers = now;
        std::string names;
        for (const auto& n : now) names += (names.empty() ? "" : ", ") + n;
        log_line("policy v" + std::to_string(version) + " broadcast to " + std::to_string(now.size()) +
                 " rollout worker" + (now.size() == 1 ? "" : "s") + (now.empty() ? "" : ": " + names) +
                 " (generation " + std::to_string(broadcaster->generation()) + ")");
    }

    // Why CUDA IPC cannot carry the policies ("" where it may: the export may still fail).
    std::string cuda_ipc_unavailable() const {
        if (cfg.train_device != "cuda" || cfg.rollout_device != "cuda")
            return "CUDA IPC needs train.device and rollout.device cuda (here " + cfg.train_device + " and " +
                   cfg.rollout_device + ")";
        if (!detail::cuda_ipc_compiled())
            return "this build has no CUDA runtime (MOERL_WITH_CUDA off), so no CUDA IPC";
        return "";
    }

    void fall_back_to_files(const std::string& why) {
        route = Route::kFiles;
        log_line("policies go between the processes as files from v" + std::to_string(version) +
                 " on: " + why);
    }

    // A rollout rank could not take version v by CUDA IPC: its files instead, and files from now on.
    std::string files_instead(int64_t v, const std::string& why) {
        MOERL_CHECK(v == version, "trainer: asked for policy v", v, " as files, but its weights are v",
                    version);
        if (route == Route::kCudaIpc) fall_back_to_files("CUDA IPC failed in the rollout: " + why);
        const fs::path dir = files_version == v ? policy_files_dir(v) : write_policy_files();
        return "file://" + fs::absolute(dir).string();
    }

    fs::path policy_files_dir(int64_t v) const {
        return fs::path(work_dir) / "policy" / ("v" + std::to_string(v));
    }
    // The current version's files (every rank's experts), the version before last removed: a worker
    // may still be loading the previous one.
    fs::path write_policy_files() {
        const fs::path dir = policy_files_dir(version);
        trainer->save_weights(dir.string());
        copy_tokenizer_files(cfg, dir.string());
        files_version = version;
        std::error_code ec;
        fs::remove_all(policy_files_dir(version - 2), ec);
        return dir;
    }

    // Registers `uri` for the current version (a restarted trainer finds its version registered
    // already in a persistent registry).
    void register_version(const std::string& uri) {
        auto latest = cp.registry->latest();
        if (!latest || latest->first < version) cp.registry->publish(version, uri);
    }

    // Exports the weights' CUDA IPC handles of every trainer process and registers them; false, having
    // said why, when a rank cannot export them.
    bool publish_cuda_ipc() {
        std::string why;
        const std::vector<std::string> parts = trainer->export_weights_ipc(why);
        if (parts.empty()) {
            fall_back_to_files("the CUDA IPC export failed: " + why);
            return false;
        }
        detail::IpcPolicy policy;
        policy.version = version;
        policy.publisher = in_process_id;
        policy.writes = trainer->weight_writes();
        for (const std::string& part : parts) policy.processes.push_back(detail::ipc_process_from_json(part));
        const fs::path dir = fs::path(work_dir) / "policy";
        fs::create_directories(dir);
        const fs::path file = fs::absolute(dir / ("ipc-v" + std::to_string(version) + ".json"));
        write_text(file, detail::ipc_policy_to_json(policy));
        register_version(kCudaIpcPrefix + file.string());
        std::error_code ec;
        fs::remove(dir / ("ipc-v" + std::to_string(version - 2) + ".json"), ec);
        return true;
    }

    bool consumed_by_watermark(const std::string& id) const {
        long long step = -1;
        return std::sscanf(id.c_str(), "s%lld-", &step) == 1 && step >= 0 && step < consumed_below;
    }
    bool is_consumed(const ExperienceRecord& e) const {
        return e.task.step < consumed_below || consumed.count(e.task_id) > 0;
    }

    void publish_policy() {
        const auto t0 = Clock::now();
        if (route == Route::kMemory) {  // no files: the workers copy the weights when they sync
            register_version(kMemoryPrefix + in_process_id);
        } else if (route == Route::kBroadcast) {
            const std::string uri = broadcaster->uri(in_process_id);
            say_receivers(broadcaster->send(version, broadcast_sources(), [&] { register_version(uri); }));
        } else if (route != Route::kCudaIpc || !publish_cuda_ipc()) {
            register_version("file://" + fs::absolute(write_policy_files()).string());
        }
        publish_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    }

    void take_available(control::Millis wait) {
        auto deliveries = cp.experience->take(consumer, 1 << 20, wait);
        for (auto& d : deliveries) {
            ExperienceRecord e = experience_from_json(d.experience.payload);
            if (is_consumed(e)) {  // trained on before a restart: done with it
                cp.experience->ack({d.delivery_id});
                ++duplicates;
                continue;
            }
            const int64_t s = e.task.step;
            const std::string id = e.task_id;  // the right side of = is evaluated first
            held[s][id] = {std::move(e), d.delivery_id};
        }
    }

    std::optional<StepResult> step(int64_t s, control::Millis wait) {
        const size_t need = static_cast<size_t>(cfg.prompts_per_step) * cfg.group_size;
        auto deadline = Clock::now() + wait;
        // Workers that joined since the last version (new, restarted, or left out of the group) get
        // the current one now rather than at the next step: they may be what this step waits for.
        if (route == Route::kBroadcast && broadcaster->has_joiners()) {
            const std::vector<std::string> got = broadcaster->serve_joiners(version, broadcast_sources());
            if (!got.empty()) {
                std::string names;
                for (const auto& n : got) names += (names.empty() ? "" : ", ") + n;
                log_line("policy v" + std::to_string(version) + " broadcast to joining rollout worker" +
                         (got.size() == 1 ? " " : "s ") + names);
            }
        }
        take_available(control::Millis(0));
        while (held[s].size() < need) {
            auto left = std::chrono::duration_cast<control::Millis>(deadline - Clock::now());
            if (left.count() <= 0) return std::nullopt;
            take_available(left);
        }
        // Group-major order: (prompt, sample), so groups are contiguous.
        std::vector<ExperienceRecord> batch;
        std::vector<std::string> deliveries;
        for (int p = 0; p < cfg.prompts_per_step; ++p) {
            for (int g = 0; g < cfg.group_size; ++g) {
                auto it = held[s].find(task_id(s, p, g));
                MOERL_CHECK(it != held[s].end(), "trainer: step ", s, " lacks task ", task_id(s, p, g));
                batch.push_back(std::move(it->second.first));
                deliveries.push_back(it->second.second);
            }
        }
        held.erase(s);
        std::vector<double> rewards;
        for (auto& e : batch) rewards.push_back(e.reward);
        std::vector<double> adv = group_advantages(rewards, cfg.group_size, cfg.grpo.adv_eps);
        StepResult r;
        r.step = s;
        double sum = 0, sq = 0, exact = 0, stale = 0;
        for (auto& e : batch) {
            sum += e.reward;
            sq += e.reward * e.reward;
            exact += e.correct ? 1 : 0;
            for (int64_t v : e.trajectory.versions) {
                stale += static_cast<double>(version - v);
                r.staleness_max = std::max(r.staleness_max, version - v);
            }
            r.response_tokens += static_cast<int64_t>(e.trajectory.tokens.size());
            r.task_ids.push_back(e.task_id);
            r.retried += e.attempt > 0 ? 1 : 0;
        }
        r.duplicates = std::exchange(duplicates, 0);
        const double n = static_cast<double>(batch.size());
        r.reward_mean = sum / n;
        r.reward_std = std::sqrt(std::max(0.0, sq / n - r.reward_mean * r.reward_mean));
        r.exact_fraction = exact / n;
        r.staleness_mean = r.response_tokens ? stale / static_cast<double>(r.response_tokens) : 0;
        const bool gpu = cfg.train_device == "cuda";
        const at::Device device(at::kCUDA, 0);  // this process's trainer rank 0: the first GPU
        if (gpu) model::reset_peak_allocated_bytes(device);
        const auto t_train = Clock::now();
        r.train = trainer->update(batch, adv);
        r.train_seconds = std::chrono::duration<double>(Clock::now() - t_train).count();
        if (gpu) r.train_peak_bytes = model::peak_allocated_bytes(device);
        consumed_below = std::max(consumed_below, s + 1);
        version = s + 1;
        publish_policy();
        r.publish_seconds = publish_seconds;
        r.version = version;
        cp.experience->ack(deliveries);
        return r;
    }

    void save(int64_t next_step, int64_t env_next_step) {
        const std::string name = checkpoint_name(next_step);
        const fs::path dir = fs::path(work_dir) / "staging" / name;
        nlohmann::json st;
        st["next_step"] = next_step;
        st["version"] = version;
        st["env_next_step"] = env_next_step;
        st["data"] = prompt_source(cfg).state(env_next_step);
        st["seed"] = cfg.seed;
        // Compact: a watermark plus the ids it does not cover (none when steps are trained in order).
        st["consumed_below_step"] = consumed_below;
        nlohmann::json others = nlohmann::json::array();
        for (const auto& id : consumed)
            if (!consumed_by_watermark(id)) others.push_back(id);
        st["consumed"] = others;
        nlohmann::json pending = nlohmann::json::array();
        for (auto& [s, m] : held)
            for (auto& [id, e] : m) pending.push_back(to_json(e.first));
        st["pending"] = pending;
        fs::remove_all(dir);
        st["data"] = prompt_source(cfg).state(env_next_step);
        try {
            trainer->save_weights(dir.string());
            copy_tokenizer_files(cfg, dir.string());
            trainer->save_optimizer(dir.string());
            std::ofstream state(dir / "trainer_state.json");
            state << st.dump();
            state.close();
            MOERL_CHECK(state.good(), "cannot write ", (dir / "trainer_state.json").string());
            control::publish_checkpoint(*cp.store, dir.string(), name, version, next_step);
        } catch (...) {
            std::error_code ec;  // a full disk: leave no staging files behind
            fs::remove_all(dir, ec);
            throw;
        }
        fs::remove_all(dir);
        control::prune_checkpoints(*cp.store, "ckpt-", static_cast<size_t>(cfg.keep_checkpoints));
    }

    int64_t start(bool resume) {
        int64_t next_step = 0;
        if (resume) {
            const auto names = control::published_checkpoints(*cp.store, "ckpt-");
            MOERL_CHECK(!names.empty(), "--resume: no checkpoint in ", cp.store->uri());
            const std::string& newest = names.back();
            const fs::path dir = fs::path(work_dir) / "resume" / newest;
            fs::remove_all(dir);
            control::fetch_checkpoint(*cp.store, newest, dir.string());
            trainer->load(dir.string());
            std::ifstream in(dir / "trainer_state.json");
            auto st = nlohmann::json::parse(in);
            MOERL_CHECK(st.at("seed").get<uint64_t>() == cfg.seed,
                        "--resume: the checkpoint was made with seed ", st.at("seed").get<uint64_t>(),
                        ", but the config says run.seed = ", cfg.seed);
            next_step = st.at("next_step").get<int64_t>();
            version = st.at("version").get<int64_t>();
            env_next = st.at("env_next_step").get<int64_t>();
            try {
                prompt_source(cfg).check_state(st.value("data", nlohmann::json()));
            } catch (const Error& e) {
                MOERL_FAIL("--resume: ", e.message());
            }
            consumed = st.at("consumed").get<std::set<std::string>>();
            // Every step before the checkpoint's was trained (older checkpoints list every id).
            consumed_below = std::max(st.value("consumed_below_step", int64_t{0}), next_step);
            std::erase_if(consumed, [&](const std::string& id) { return consumed_by_watermark(id); });
            for (const auto& text : st.at("pending")) {
                ExperienceRecord e = experience_from_json(text.get<std::string>());
                cp.experience->push({e.task_id, e.attempt, e.oldest_version(), text.get<std::string>()});
            }
            fs::remove_all(dir);
        }
        publish_policy();
        return next_step;
    }
};

TrainerRole::TrainerRole(const RunConfig& config, ControlPlane& control, std::string work_dir,
                         PolicyHandoff handoff, const RoleProcesses* processes)
    : impl_(std::make_unique<Impl>(config, control, std::move(work_dir), handoff, processes)) {}
TrainerRole::~TrainerRole() = default;
int64_t TrainerRole::start(bool resume) { return impl_->start(resume); }
std::optional<StepResult> TrainerRole::train_step(int64_t step, control::Millis wait) {
    return impl_->step(step, wait);
}
void TrainerRole::save_checkpoint(int64_t next_step, int64_t env_next_step) {
    impl_->save(next_step, env_next_step);
}
int64_t TrainerRole::resumed_env_next_step() const { return impl_->env_next; }
int64_t TrainerRole::version() const { return impl_->version; }
size_t TrainerRole::num_held(int64_t step) const {
    auto it = impl_->held.find(step);
    return it == impl_->held.end() ? 0 : it->second.size();
}
void TrainerRole::republish_policy() { impl_->publish_policy(); }
void TrainerRole::save_weights(const std::string& dir) const { impl_->trainer->save_weights(dir); }

}  // namespace moerl::rl
