// The env, rollout and train roles on top of the control plane.
#include "moerl/rl/roles.hpp"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <utility>

#include "cuda_ipc.hpp"
#include "model_options.hpp"
#include "moerl/control/run_store.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/log.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/ep/c10d_store.hpp"
#include "moerl/model/model.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/reward_worker.hpp"
#include "moerl/rl/rollout.hpp"
#include "policy_broadcast.hpp"
#include "role_common.hpp"

namespace moerl::rl {

namespace {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace detail;  // role_common.hpp: policy names, the trainers of this process

// How a policy URI arrives (RolloutStats::sync_path).
std::string policy_path(const std::string& uri) {
    if (uri.rfind(kMemoryPrefix, 0) == 0) return "memory";
    if (is_cuda_ipc(uri)) return "cuda-ipc";
    if (detail::is_broadcast_uri(uri)) return "broadcast";
    if (uri.rfind("file://", 0) == 0) return "file";
    return "store";
}

std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    MOERL_CHECK(in.good(), "cannot read ", path);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::string error_text(const std::exception& e) {
    const auto* m = dynamic_cast<const Error*>(&e);
    return m ? m->message() : e.what();
}

model::ModelOptions rollout_model_options(const RunConfig& c) {
    return role_model_options(c, c.rollout_device, c.rollout_dtype, "rollout.device");
}

// The rollout model of one rank of an engine: every expert, or over processes this rank's share
// (an EP buffer over them, sized for a prefill of max_batch whole sequences).
struct RolloutModel {
    std::unique_ptr<ep::C10dStore> store;
    std::unique_ptr<ep::Buffer> buffer;
    std::unique_ptr<model::MoeModel> model;

    RolloutModel(const RunConfig& c, const RoleProcesses* p) {
        model::ModelOptions o = rollout_model_options(c);
        if (p != nullptr && p->world_size > 1) {
            MOERL_CHECK(p->world_size == c.rollout_ranks, c.source, ": the rollout engine runs as ",
                        p->world_size, " processes, but ranks.rollout is ", c.rollout_ranks);
            if (o.device.is_cuda()) {
                const int gpus = static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
                o.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(p->local_rank % gpus));
            }
            store = std::make_unique<ep::C10dStore>(
                c10::make_intrusive<c10d::PrefixStore>("rollout-ep", p->store));
            ep::Config ec = model::ep_config_for(
                c.model, o.dtype, p->world_size, p->rank,
                static_cast<int>(int64_t{c.rollout_max_batch} * c.max_sequence_tokens()));
            ec.set_transport(p->ep_transport);
            if (o.device.is_cuda()) ec.device = o.device.index();
            ec.job_id = "rollout";
            ec.timeout_s = p->timeout_s;
            // Prefill only: the decode steps of a GPU engine have a low-latency buffer of their own.
            ec.low_latency = false;
            buffer = std::make_unique<ep::Buffer>(ec, store.get());
            o.ep = buffer.get();
        }
        model = std::make_unique<model::MoeModel>(c.model, o);
    }
    ~RolloutModel() {
        try {
            if (buffer) buffer->destroy();
        } catch (...) {
        }
    }
    // After a rank died: the buffer's teardown is collective and would wait for it in vain; the
    // process is about to exit, which frees the buffer's memory.
    void abandon_buffer() { (void)buffer.release(); }
};
}  // namespace

namespace detail {

std::string checkpoint_name(int64_t next_step) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "ckpt-%08lld", static_cast<long long>(next_step));
    return buf;
}

// Writes `text` to `path` whole: a reader sees the old file or the new one.
void write_text(const fs::path& path, const std::string& text) {
    const fs::path tmp = path.string() + ".part";
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        out << text;
        out.close();
        MOERL_CHECK(out.good(), "cannot write ", tmp.string());
    }
    fs::rename(tmp, path);
}

}  // namespace detail

model::ModelOptions role_model_options(const RunConfig& c, const std::string& device,
                                       const std::string& dtype, const char* key) {
    model::ModelOptions o;
    o.dtype = dtype == "bf16" || dtype == "fp8" ? at::kBFloat16 : at::kFloat;  // fp8: the engine's copies
    if (device == "cuda") {
        MOERL_CHECK(at::hasCUDA(), c.source, ": ", key,
                    ": cuda, but this LibTorch build or machine has no CUDA device");
        o.device = at::Device(at::kCUDA, 0);
    }
    return o;
}
namespace {
// The local directory of a published policy: its own for file://, else fetched from the store.
std::string policy_dir(ControlPlane& cp, const std::string& uri, const std::string& cache_dir) {
    if (uri.rfind("file://", 0) == 0) return uri.substr(7);
    MOERL_CHECK(uri.rfind(kStorePrefix, 0) == 0, "registry: unknown policy URI '", uri, "'");
    const std::string ckpt = uri.substr(std::string(kStorePrefix).size());
    const std::string dir = (fs::path(cache_dir) / "policy" / ckpt).string();
    control::fetch_checkpoint(*cp.store, ckpt, dir, (fs::path(cache_dir) / "cache").string());
    return dir;
}

// Loads published policies into one model.
class PolicyLoader {
  public:
    explicit PolicyLoader(model::MoeModel& model) : model_(model) {}

    // Loads `uri` into the model: copied from the trainer's memory for mem:// (this process) and
    // cuda-ipc:// (processes of this machine), else read from its files. Returns the bytes copied
    // (0 for files).
    int64_t load(ControlPlane& cp, const std::string& uri, const std::string& cache_dir) {
        last_ipc_.reset();
        if (is_cuda_ipc(uri)) {
            const std::string file = uri.substr(std::string(kCudaIpcPrefix).size());
            detail::IpcPolicy policy = detail::ipc_policy_from_json(read_text(file), file);
            if (!ipc_) ipc_ = std::make_unique<detail::IpcImporter>(model_);
            const int64_t bytes = ipc_->copy(policy);
            last_ipc_ = std::move(policy);
            return bytes;
        }
        const bool broadcast = detail::is_broadcast_uri(uri);
        if (uri.rfind(kMemoryPrefix, 0) != 0 && !broadcast) {
            model_.load_weights(policy_dir(cp, uri, cache_dir));
            return 0;
        }
        // A broadcast policy read in the trainer's process (its evaluator) comes from memory.
        const std::string id =
            broadcast ? detail::broadcast_uri_id(uri) : uri.substr(std::string(kMemoryPrefix).size());
        const int64_t bytes = InProcessPolicies::copy(id, model_);
        if (model_.options().device.is_cuda()) at::zeros({1}, model_.options().device).item();  // copies done
        return bytes;
    }

    // After a cuda-ipc:// load, this rank's and every other's: whether the trainer began no update
    // or load since it exported the weights, so that no copy mixed two versions. (Every write to
    // the trainer's weights begins on its rank 0, which is in this process with the rollout's rank
    // 0: the trainer publishes CUDA IPC only then.) True after other loads.
    bool unchanged_since_export() const {
        if (!last_ipc_) return true;
        const std::optional<int64_t> writes = InProcessPolicies::weight_writes(last_ipc_->publisher);
        MOERL_CHECK(writes.has_value(), "cuda-ipc policy v", last_ipc_->version,
                    ": its trainer is not in this process, so nothing tells whether it changed the weights "
                    "during the copy");
        return *writes == last_ipc_->writes;
    }

  private:
    model::MoeModel& model_;
    std::unique_ptr<detail::IpcImporter> ipc_;   // cuda-ipc://: the handles opened
    std::optional<detail::IpcPolicy> last_ipc_;  // the last cuda-ipc:// policy loaded
};

// Loads the registry's `latest` policy with load_all(uri) (this rank's load and, for an engine over
// processes, every rank's). Where CUDA IPC fails on a rank, the trainer (in this process) writes the
// version as files, and publishes files from then on; where the trainer changed its weights during
// the copies, they are made again from the newest version. Returns the bytes copied; `latest`
// becomes what was loaded. `healthy`, when given, says whether a failure leaves the loaders able to
// load again (an engine that lost a rank does not: its failure is rethrown as it is).
int64_t load_latest(ControlPlane& cp, const PolicyLoader& loader, std::pair<int64_t, std::string>& latest,
                    const std::function<int64_t(const std::string&)>& load_all,
                    const std::function<bool()>& healthy = {}) {
    for (int attempt = 1;; ++attempt) {
        int64_t bytes = 0;
        try {
            bytes = load_all(latest.second);
        } catch (const std::exception& e) {
            if (!is_cuda_ipc(latest.second) || (healthy && !healthy())) throw;
            std::optional<std::string> files =
                InProcessPolicies::files_instead(cp.store->uri(), latest.first, error_text(e));
            if (!files) throw;
            latest.second = *files;
            bytes = load_all(latest.second);
        }
        if (loader.unchanged_since_export()) return bytes;
        MOERL_CHECK(attempt < 3, "rollout: the trainer changed its weights during each of ", attempt,
                    " copies of a policy by CUDA IPC (the newest: v", latest.first, ")");
        auto newest = cp.registry->latest();
        MOERL_CHECK(newest.has_value(), "rollout: the registry lost its policies");
        latest = *newest;
    }
}
}  // namespace

ControlPlane ControlPlane::connect(const RunConfig& c, const std::string& run_id) {
    ControlPlane cp;
    cp.tasks = control::make_task_queue(c.queue, run_id, control::Millis(c.lease_timeout_ms));
    cp.experience = control::make_experience_buffer(c.buffer, run_id);
    cp.registry = control::make_registry(c.registry, run_id);
    cp.store = control::make_checkpoint_store(c.store_uri());
    if (!c.reward_model_path.empty())
        cp.scoring =
            control::make_task_queue(c.queue, scoring_run_id(run_id), control::Millis(c.lease_timeout_ms));
    return cp;
}

// ---- env -------------------------------------------------------------------------------------
namespace {
// What the prompt source of a config depends on: a changed key means another source.
std::string prompt_source_key(const RunConfig& c) {
    const auto& t = c.task;
    const auto& d = c.data.dataset;
    nlohmann::json k = {t.kind,
                        t.digits,
                        t.length,
                        t.max_value,
                        t.partial_credit,
                        c.seed,
                        c.steps,
                        c.prompts_per_step,
                        c.eval.prompts,
                        c.use_data,
                        c.tokenizer_path,
                        d.path,
                        d.eval_path,
                        d.eval_fraction,
                        d.seed,
                        d.shuffle,
                        d.epochs,
                        d.format.prompt_field,
                        d.format.messages_field,
                        d.format.answer_field,
                        d.format.id_field,
                        c.data.chat_template,
                        c.data.system_prompt,
                        c.data.template_vars,
                        c.data.max_prompt_tokens};
    return k.dump();
}

}  // namespace

namespace detail {
const PromptSource& prompt_source(const RunConfig& c) {
    static thread_local std::unique_ptr<PromptSource> source;
    static thread_local std::string key;
    std::string k = prompt_source_key(c);
    if (!source || k != key) {
        source = make_prompt_source(c);
        key = std::move(k);
    }
    return *source;
}
}  // namespace detail

namespace {
TaskPayload payload_of(const RunConfig& c, const Prompt& prompt, int64_t step, int prompt_idx,
                       int sample_idx) {
    TaskPayload p;
    p.step = step;
    p.prompt_idx = prompt_idx;
    p.sample_idx = sample_idx;
    const uint64_t prompt_seed =
        mix_seed(mix_seed(c.seed, static_cast<uint64_t>(step)), static_cast<uint64_t>(prompt_idx));
    p.seed = mix_seed(prompt_seed, 1000003ULL + static_cast<uint64_t>(sample_idx));
    p.problem = prompt.problem;
    p.prompt_tokens = prompt.tokens;
    return p;
}
}  // namespace

TaskPayload make_task_payload(const RunConfig& c, int64_t step, int prompt_idx, int sample_idx) {
    return payload_of(c, prompt_source(c).train(step, prompt_idx), step, prompt_idx, sample_idx);
}

void put_step_tasks(const RunConfig& c, control::TaskQueue& tasks, int64_t step) {
    const PromptSource& source = prompt_source(c);
    for (int p = 0; p < c.prompts_per_step; ++p) {
        const Prompt prompt = source.train(step, p);
        for (int g = 0; g < c.group_size; ++g) {
            tasks.put({task_id(step, p, g), 0, to_json(payload_of(c, prompt, step, p, g)), ""});
        }
    }
}

// ---- rollout ---------------------------------------------------------------------------------
struct RolloutWorker::Impl {
    RunConfig cfg;
    ControlPlane& cp;
    std::string name, cache_dir;
    RolloutModel owned;
    model::MoeModel& model;
    std::unique_ptr<RolloutEngine> engine;
    std::unique_ptr<Rewarder> rewarder;
    int64_t version = -1;
    RolloutStats stats;
    uint64_t next_id = 0;
    struct InFlight {
        control::Lease lease;
        TaskPayload payload;
    };
    std::map<uint64_t, InFlight> in_flight;
    PolicyLoader loader{model};
    std::unique_ptr<detail::PolicyReceiver> receiver;  // policies by broadcast from another machine
    const std::atomic<bool>* stop = nullptr;           // work()'s termination notice

    ~Impl() {
        if (!engine->healthy()) owned.abandon_buffer();
    }

    Impl(const RunConfig& c, ControlPlane& control, std::string n, std::string cache, const RoleProcesses* p)
        : cfg(c),
          cp(control),
          name(std::move(n)),
          cache_dir(std::move(cache)),
          owned(c, p),
          model(*owned.model) {
        SamplingParams sp = c.sampling;
        engine = std::make_unique<RolloutEngine>(model, sp, rollout_engine_options(c, p));
        std::vector<std::unique_ptr<Rewarder>> parts;
        std::vector<double> weights;
        parts.push_back(make_prompt_rewarder(c));
        weights.push_back(c.verifier_weight);
        rewarder = make_mixed_rewarder(std::move(parts), std::move(weights));
    }

    int64_t sync() {
        auto latest = cp.registry->latest();
        const bool broken = receiver && receiver->incomplete();
        if (!broken && (!latest || latest->first <= version)) return version;
        if (latest && detail::is_broadcast_uri(latest->second) &&
            !InProcessPolicies::has(detail::broadcast_uri_id(latest->second)))
            return sync_by_broadcast(*latest);
        const auto t0 = Clock::now();
        // Every rank of the engine loads at once (rank 0 here, the others through follow()).
        const int64_t bytes = load_latest(
            cp, loader, *latest,
            [&](const std::string& uri) {
                return engine->refresh_weights(uri, [&] { return loader.load(cp, uri, cache_dir); });
            },
            [&] { return engine->healthy(); });
        version = latest->first;
        ++stats.syncs;
        stats.last_sync_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        stats.sync_seconds += stats.last_sync_seconds;
        stats.sync_bytes += bytes;
        const std::string path = policy_path(latest->second);
        if (path == "cuda-ipc" && stats.sync_path != path)
            log_line(moerl::detail::concat("rollout worker ", name, ": policy v", version, " by CUDA IPC, ",
                                           bytes, " bytes in ", stats.last_sync_seconds, " s"));
        stats.sync_path = path;
        return version;
    }

    // The trainer on another machine broadcasts each version to the workers that joined. A worker
    // that is not a member yet asked to join and generates on with the version it has; one whose
    // receive failed part way holds parts of two versions and generates nothing until a whole
    // version arrived (the trainer sends it again as soon as the worker asks).
    int64_t sync_by_broadcast(std::pair<int64_t, std::string> latest) {
        if (!receiver)
            receiver = std::make_unique<detail::PolicyReceiver>(
                name, model.named_parameters(), static_cast<int>(model.first_local_expert()),
                cfg.sync_timeout_s,
                [this](const std::string& text) { log_line("rollout worker " + name + ": " + text); });
        const auto t0 = Clock::now();
        auto deadline = t0 + std::chrono::milliseconds(static_cast<int64_t>(cfg.sync_timeout_s * 1000));
        for (;;) {
            std::optional<int64_t> bytes;
            try {
                if (detail::is_broadcast_uri(latest.second))
                    bytes = receiver->receive(latest.second, latest.first);
            } catch (const moerl::Error& e) {
                if (!receiver->incomplete()) throw;
                log_line("rollout worker " + name + ": " + e.message());
                deadline =
                    Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(cfg.sync_timeout_s * 1000));
            }
            if (bytes) {
                engine->refresh_weights(latest.second, {});
                version = latest.first;
                ++stats.syncs;
                stats.last_sync_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
                stats.sync_seconds += stats.last_sync_seconds;
                stats.sync_bytes += *bytes;
                if (stats.sync_path != "broadcast")
                    log_line(moerl::detail::concat("rollout worker ", name, ": policy v", version,
                                                   " by broadcast, ", *bytes, " bytes in ",
                                                   stats.last_sync_seconds, " s"));
                stats.sync_path = "broadcast";
                return version;
            }
            if (!receiver->incomplete()) return version;
            MOERL_CHECK(!(stop && stop->load()), "rollout worker ", name,
                        ": stopped while its weights hold parts of two policy versions");
            MOERL_CHECK(Clock::now() < deadline, "rollout worker ", name,
                        ": no whole policy version arrived within ", cfg.sync_timeout_s,
                        " s (sync.timeout_s) after a broadcast failed part way");
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            if (auto newest = cp.registry->latest()) latest = *newest;
        }
    }

    void admit(const control::Lease& lease) {
        InFlight f{lease, task_payload_from_json(lease.task.payload)};
        // The env puts step s once version s - max_staleness is published, so a task can arrive
        // just after this worker's last sync(): load that version first, or the bound is broken
        // by one.
        const int64_t needed = f.payload.step - cfg.max_staleness;
        try {
            for (int i = 0; version < needed && i < 40; ++i) {
                if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
                sync();
            }
        } catch (const std::exception&) {
            // Not in flight yet, so release() would not give it back, and the heartbeat would keep
            // its lease alive for good.
            cp.tasks->release(lease, lease.task.partial);
            ++stats.released;
            throw;
        }
        GenRequest r;
        r.id = next_id++;
        r.prompt = f.payload.prompt_tokens;
        r.seed = f.payload.seed;
        r.max_new_tokens = cfg.max_new_tokens();
        if (!lease.task.partial.empty()) r.prefix = trajectory_from_json(lease.task.partial);
        in_flight.emplace(r.id, std::move(f));
        engine->add(std::move(r));
    }

    void complete(std::vector<GenResult>& done) {
        if (done.empty()) return;
        std::vector<Scored> batch;
        for (auto& d : done) {
            const InFlight& f = in_flight.at(d.id);
            batch.push_back(
                {f.payload.problem, f.payload.prompt_tokens, d.trajectory.tokens, d.trajectory.terminated});
        }
        const auto t0 = Clock::now();
        std::vector<bool> correct;
        std::vector<double> rewards = rewarder->score_and_check(batch, correct);
        stats.reward_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
        for (size_t i = 0; i < done.size(); ++i) {
            InFlight f = std::move(in_flight.at(done[i].id));
            in_flight.erase(done[i].id);
            ExperienceRecord e;
            e.task_id = f.lease.task.id;
            e.attempt = f.lease.task.attempt;
            e.task = std::move(f.payload);
            e.trajectory = std::move(done[i].trajectory);
            e.reward = rewards[i];
            e.correct = correct[i];
            control::Experience x{e.task_id, e.attempt, e.oldest_version(), to_json(e)};
            if (cp.scoring) {  // the reward model scores it next; a task id put twice is ignored
                cp.scoring->put({e.task_id, 0, x.payload, ""});
                ++stats.pushed;
            } else if (cp.experience->push(x)) {
                ++stats.pushed;
            } else {
                ++stats.duplicates;
            }
            cp.tasks->ack(f.lease);
        }
    }

    size_t release() {
        std::vector<GenResult> partial;
        try {
            partial = engine->drain();
        } catch (const std::exception&) {
            if (engine->healthy()) throw;
        }
        if (!engine->healthy()) {  // a rank of the engine is gone with its sequences
            const size_t n = in_flight.size();
            abandon();
            return n;
        }
        size_t n = 0;
        for (auto& r : partial) {
            auto it = in_flight.find(r.id);
            if (it == in_flight.end()) continue;
            cp.tasks->release(it->second.lease, to_json(r.trajectory));
            in_flight.erase(it);
            ++n;
        }
        stats.released += static_cast<int64_t>(n);
        return n;
    }

    // The engine failed (a rank of it died): every task it held goes back to the queue as it was
    // leased, for another worker; what this attempt generated is lost with the rank.
    void abandon() {
        for (auto& [id, f] : in_flight) {
            try {
                cp.tasks->release(f.lease, f.lease.task.partial);
                ++stats.released;
            } catch (const std::exception&) {  // the lease times out instead
            }
        }
        in_flight.clear();
    }

    size_t work(control::Millis wait, const std::atomic<bool>* stop_flag, int max_steps) {
        stop = stop_flag;
        const int64_t pushed_before = stats.pushed;
        int steps = 0;
        auto t0 = Clock::now();
        const int64_t tok0 = engine->tokens_generated();
        const int64_t prompt0 = engine->prompt_tokens(), shared0 = engine->prompt_tokens_shared();
        const DecodeTraffic decode0 = engine->decode_traffic();
        for (;;) {
            if (stop && stop->load()) {
                release();
                break;
            }
            std::vector<GenResult> done;
            try {
                sync();
                // Fill free batch slots with new leases (continuous batching), a group's worth at a
                // time on the CUDA engine: the queue hands out a group's samples one after another,
                // and samples that join in one prefill share their prompt's cache blocks.
                const int unit = engine->uses_generator() ? std::min(cfg.group_size, engine->capacity()) : 1;
                for (bool more = true; more;) {
                    const int room =
                        engine->capacity() - static_cast<int>(engine->num_active() + engine->num_waiting());
                    if (room <= 0 || (room < unit && !engine->idle())) break;
                    for (int i = 0; i < std::min(room, unit) && more; ++i) {
                        auto lease = cp.tasks->lease(name, engine->idle() ? wait : control::Millis(0));
                        if (lease) {
                            admit(*lease);
                        } else {
                            more = false;
                        }
                    }
                }
                if (engine->idle()) break;
                MOERL_CHECK(version >= 0, "rollout worker ", name,
                            ": no policy published in the registry yet");
                done = engine->step(version);
            } catch (const std::exception&) {
                if (!engine->healthy()) abandon();
                throw;
            }
            complete(done);
            if (++steps % 16 == 0) cp.tasks->heartbeat(name);
            if (max_steps > 0 && steps >= max_steps) break;
        }
        stats.tokens += engine->tokens_generated() - tok0;
        stats.prompt_tokens += engine->prompt_tokens() - prompt0;
        stats.prompt_tokens_shared += engine->prompt_tokens_shared() - shared0;
        stats.decode += engine->decode_traffic() - decode0;
        stats.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
        return static_cast<size_t>(stats.pushed - pushed_before);
    }
};

RolloutWorker::RolloutWorker(const RunConfig& config, ControlPlane& control, std::string name,
                             std::string cache_dir, const RoleProcesses* processes)
    : impl_(std::make_unique<Impl>(config, control, std::move(name), std::move(cache_dir), processes)) {}

void follow_rollout_engine(const RunConfig& config, ControlPlane& control, const std::string& cache_dir,
                           const RoleProcesses& processes) {
    RolloutModel m(config, &processes);
    RolloutEngine engine(*m.model, config.sampling, rollout_engine_options(config, &processes));
    PolicyLoader loader(*m.model);
    engine.follow([&](const std::string& uri) { return loader.load(control, uri, cache_dir); });
}
RolloutWorker::~RolloutWorker() = default;
int64_t RolloutWorker::sync_policy() { return impl_->sync(); }
size_t RolloutWorker::work(control::Millis wait, const std::atomic<bool>* stop, int max_engine_steps) {
    return impl_->work(wait, stop, max_engine_steps);
}
size_t RolloutWorker::release_all() { return impl_->release(); }
const RolloutStats& RolloutWorker::stats() const { return impl_->stats; }

int64_t RolloutWorker::release_memory() { return impl_->engine->release_memory(); }
int64_t RolloutWorker::kept_memory_bytes() const { return impl_->engine->kept_memory_bytes(); }
int64_t RolloutWorker::policy_version() const { return impl_->version; }
bool RolloutWorker::healthy() const { return impl_->engine->healthy(); }

// ---- eval ------------------------------------------------------------------------------------
struct Evaluator::Impl {
    RunConfig cfg;
    ControlPlane& cp;
    std::string cache_dir;
    std::unique_ptr<PromptSource> source;
    std::unique_ptr<Rewarder> rewarder;
    model::MoeModel model;
    PolicyLoader loader{model};
    int64_t loaded = -1;

    Impl(const RunConfig& c, ControlPlane& control, std::string cache)
        : cfg(c),
          cp(control),
          cache_dir(std::move(cache)),
          source(make_prompt_source(c)),
          rewarder(make_prompt_rewarder(c)),
          model(c.model, rollout_model_options(c)) {}

    EvalResult run() {
        const auto t0 = Clock::now();
        auto latest = cp.registry->latest();
        MOERL_CHECK(latest.has_value(), "eval: no policy published in the registry yet");
        if (latest->first != loaded)
            load_latest(cp, loader, *latest,
                        [&](const std::string& uri) { return loader.load(cp, uri, cache_dir); });
        loaded = latest->first;
        SamplingParams greedy = cfg.sampling;
        greedy.temperature = 1.0;
        greedy.top_p = 1.0;
        greedy.top_k = 1;
        RolloutEngineOptions eval_options = rollout_engine_options(cfg);
        eval_options.record_routing = false;
        eval_options.fp8_weights = false;
        RolloutEngine engine(model, greedy, eval_options);
        const int64_t n = source->eval_size();
        std::vector<Prompt> prompts;
        for (int64_t i = 0; i < n; ++i) {
            prompts.push_back(source->eval(i));
            engine.add({static_cast<uint64_t>(i), prompts.back().tokens, {}, 0, cfg.max_new_tokens()});
        }
        std::vector<GenResult> done = engine.run_to_completion(loaded);
        std::vector<Scored> batch;
        for (auto& d : done) {
            const Prompt& p = prompts.at(d.id);
            batch.push_back({p.problem, p.tokens, d.trajectory.tokens, d.trajectory.terminated});
        }
        std::vector<bool> correct;
        const std::vector<double> rewards = rewarder->score_and_check(batch, correct);
        EvalResult r;
        r.version = loaded;
        r.prompts = static_cast<int64_t>(batch.size());
        for (size_t i = 0; i < batch.size(); ++i) {
            r.reward += rewards[i];
            r.pass_at_1 += correct[i] ? 1 : 0;
            if (done[i].id == 0) r.sample = decode_response(cfg, batch[i].response_tokens);
        }
        if (r.prompts > 0) {
            r.reward /= static_cast<double>(r.prompts);
            r.pass_at_1 /= static_cast<double>(r.prompts);
        }
        r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        return r;
    }
};

Evaluator::Evaluator(const RunConfig& config, ControlPlane& control, std::string cache_dir)
    : impl_(std::make_unique<Impl>(config, control, std::move(cache_dir))) {}
Evaluator::~Evaluator() = default;
EvalResult Evaluator::run() { return impl_->run(); }

}  // namespace moerl::rl

namespace moerl::rl {

RolloutBench bench_rollout(const RunConfig& c, int num_sequences, int max_batch) {
    model::MoeModel m(c.model, rollout_model_options(c));
    m.init_random(c.seed);
    RolloutEngineOptions options = rollout_engine_options(c);
    options.max_batch = max_batch;
    RolloutEngine engine(m, c.sampling, options);
    for (int i = 0; i < num_sequences; ++i) {
        TaskPayload p = make_task_payload(c, 0, i, 0);
        engine.add({static_cast<uint64_t>(i), p.prompt_tokens, {}, p.seed, c.max_new_tokens()});
    }
    auto t0 = Clock::now();
    auto results = engine.run_to_completion(0);
    RolloutBench b;
    b.max_batch = max_batch;
    b.sequences = static_cast<int64_t>(results.size());
    b.tokens = engine.tokens_generated();
    b.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return b;
}

}  // namespace moerl::rl
