// What the roles share inside the rl layer (roles.cpp, trainer_role.cpp): how policy versions are
// named and found, the trainers of this process, and the prompt source of a config.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moerl/core/error.hpp"
#include "moerl/model/model.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/trainer.hpp"
#include "policy_broadcast.hpp"

namespace moerl::rl::detail {

// Policy versions live in the store as "policy-v{N}" checkpoints, as a plain directory
// ("file:///dir") when trainer and workers share a file system, in the trainer's memory
// ("mem://{id}") when they share this process (the embedded control plane), or as CUDA IPC
// handles on the trainer's GPU weights ("cuda-ipc:///dir/ipc-v{N}.json", cuda_ipc.hpp) when they
// are processes of one machine launched together.
constexpr const char* kStorePrefix = "store:";
constexpr const char* kMemoryPrefix = "mem://";
constexpr const char* kCudaIpcPrefix = "cuda-ipc://";

inline bool is_cuda_ipc(const std::string& uri) { return uri.rfind(kCudaIpcPrefix, 0) == 0; }

// "ckpt-{next_step, 8 digits}": a checkpoint's name in the store.
std::string checkpoint_name(int64_t next_step);
// Writes `text` to `path` whole: a reader sees the old file or the new one.
void write_text(const std::filesystem::path& path, const std::string& text);
// The prompt source of a config: one per thread, kept while the config's prompt keys stay the same.
const PromptSource& prompt_source(const RunConfig& c);

// The trainers of this process, by the run's checkpoint store (a trainer resumed on the same run
// takes its predecessor's place): rollout workers here copy their weights directly (mem://), and
// readers of their CUDA IPC exports ask them whether the weights changed during a copy, or for a
// version as files when CUDA IPC fails.
class InProcessPolicies {
  public:
    struct Entry {
        const PolicyTrainer* trainer = nullptr;
        // Writes policy `version` as files, publishing files from then on (why: CUDA IPC failed);
        // returns its file:// URI. Empty where the trainer publishes no CUDA IPC.
        std::function<std::string(int64_t version, const std::string& why)> files_instead;
    };
    static std::string add(const std::string& store_uri, Entry entry) {
        std::lock_guard lock(mutex());
        table()[store_uri] = std::move(entry);
        return store_uri;
    }
    static void remove(const std::string& id, const PolicyTrainer* trainer) {
        std::lock_guard lock(mutex());
        auto it = table().find(id);
        if (it != table().end() && it->second.trainer == trainer) table().erase(it);
    }
    // Copies the trainer's current weights into `dst`'s: each dense weight from the trainer's first
    // rank, each expert stack in one copy per trainer rank holding some of its experts (a few
    // copies a layer). Returns the bytes written.
    static int64_t copy(const std::string& id, const model::MoeModel& dst) {
        std::lock_guard lock(mutex());
        auto it = table().find(id);
        MOERL_CHECK(it != table().end(), "rollout: policy ", kMemoryPrefix, id,
                    " is not in this process (mem:// policies need the embedded control plane)");
        c10::NoGradGuard no_grad;
        struct Source {
            int first_expert;
            at::Tensor tensor;
        };
        std::map<std::string, std::vector<Source>> by_name;
        for (const TrainerRankWeights& rank : it->second.trainer->rank_weights())
            for (const model::NamedParameter& w : rank.weights)
                by_name[w.name].push_back({w.expert ? rank.first_expert : -1, w.tensor.detach()});
        const int64_t first = dst.first_local_expert();
        int64_t bytes = 0;
        std::set<std::string> placed;
        for (const model::NamedParameter& w : dst.named_parameters()) {
            const at::Tensor d = w.tensor.detach();
            auto src = by_name.find(w.name);
            MOERL_CHECK(src != by_name.end(), "rollout: the rollout model's weight ", w.name,
                        " is not among the trainer's");
            placed.insert(w.name);
            bytes += d.numel() * static_cast<int64_t>(d.element_size());
            if (!w.expert) {
                const at::Tensor& s = src->second.front().tensor;
                MOERL_CHECK(src->second.front().first_expert < 0, "rollout: ", w.name,
                            " is an expert stack in the trainer, a dense weight in the rollout model");
                MOERL_CHECK(d.sizes() == s.sizes(), "rollout: weight ", w.name, " is ", s.sizes(),
                            " in the trainer but ", d.sizes(), " in the rollout model");
                d.copy_(s);
                continue;
            }
            // Rows first .. first + L - 1 of the rollout's stack, each from the trainer rank holding it.
            std::vector<std::pair<int64_t, int64_t>> held;
            for (const Source& s : src->second) {
                MOERL_CHECK(s.first_expert >= 0, "rollout: ", w.name,
                            " is a dense weight in the trainer, an expert stack in the rollout model");
                MOERL_CHECK(s.tensor.sizes().slice(1) == d.sizes().slice(1), "rollout: the experts of ",
                            w.name, " are ", s.tensor.sizes().slice(1), " in the trainer but ",
                            d.sizes().slice(1), " in the rollout model");
                held.emplace_back(s.first_expert, s.tensor.size(0));
            }
            for (const detail::ExpertRows& r : detail::expert_rows(
                     first, d.size(0), held, std::string("rollout: ") + kMemoryPrefix + id, w.name))
                d.narrow(0, r.dst_row, r.rows)
                    .copy_(src->second[r.source].tensor.narrow(0, r.src_row, r.rows));
        }
        for (const auto& [name, sources] : by_name)
            MOERL_CHECK(placed.count(name) > 0, "rollout: the trainer's weight ", name,
                        " has no place in the rollout model");
        return bytes;
    }
    static bool has(const std::string& id) {
        std::lock_guard lock(mutex());
        return table().count(id) > 0;
    }
    // The trainer's PolicyTrainer::weight_writes(); nullopt when it is not in this process.
    static std::optional<int64_t> weight_writes(const std::string& id) {
        std::lock_guard lock(mutex());
        auto it = table().find(id);
        if (it == table().end()) return std::nullopt;
        return it->second.trainer->weight_writes();
    }
    // Entry::files_instead of the trainer `id`; nullopt when it is not here or publishes no CUDA IPC.
    static std::optional<std::string> files_instead(const std::string& id, int64_t version,
                                                    const std::string& why) {
        std::function<std::string(int64_t, const std::string&)> fn;
        {
            std::lock_guard lock(mutex());
            auto it = table().find(id);
            if (it == table().end() || !it->second.files_instead) return std::nullopt;
            fn = it->second.files_instead;
        }
        return fn(version, why);  // without the lock: it writes files through the trainer's ranks
    }

  private:
    static std::mutex& mutex() {
        static std::mutex m;
        return m;
    }
    static std::map<std::string, Entry>& table() {
        static std::map<std::string, Entry> t;  // GUARDED_BY(mutex())
        return t;
    }
};

}  // namespace moerl::rl::detail
