#include "moerl/control/run_store.hpp"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "moerl/core/error.hpp"

namespace moerl::control {

std::vector<std::string> published_checkpoints(CheckpointStore& store, const std::string& prefix) {
    std::set<std::string> names;
    for (const auto& key : store.list(prefix)) {
        const auto slash = key.find('/');
        if (slash != std::string::npos && key.substr(slash + 1) == "manifest.json")
            names.insert(key.substr(0, slash));
    }
    return {names.begin(), names.end()};
}

void prune_checkpoints(CheckpointStore& store, const std::string& prefix, size_t keep) {
    const auto names = published_checkpoints(store, prefix);
    for (size_t i = 0; i + keep < names.size(); ++i) {
        store.remove(names[i] + "/manifest.json");
        for (const auto& key : store.list(names[i] + "/")) store.remove(key);
    }
}

std::string policy_checkpoint_name(int64_t version) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "policy-v%08lld", static_cast<long long>(version));
    return buf;
}

StorePolicyRegistry::StorePolicyRegistry(std::unique_ptr<Registry> inner, CheckpointStore& store, int keep)
    : inner_(std::move(inner)), store_(store), keep_(static_cast<size_t>(keep)) {
    MOERL_CHECK(keep >= 2, "policy versions kept in the store: ", keep,
                "; expected >= 2 (a worker may still be loading the previous one)");
}

void StorePolicyRegistry::publish(int64_t version, const std::string& checkpoint_uri) {
    if (checkpoint_uri.rfind("file://", 0) != 0) {
        inner_->publish(version, checkpoint_uri);
        return;
    }
    const std::string name = policy_checkpoint_name(version);
    publish_checkpoint(store_, checkpoint_uri.substr(7), name, version, version);
    inner_->publish(version, "store:" + name);
    prune_checkpoints(store_, "policy-v", keep_);
}

std::optional<std::pair<int64_t, std::string>> StorePolicyRegistry::latest() { return inner_->latest(); }

void write_run_done(CheckpointStore& store, const std::string& json, const std::string& tmp_dir) {
    namespace fs = std::filesystem;
    const auto path = fs::path(tmp_dir) / ("run_done." + std::to_string(::getpid()) + ".json");
    fs::create_directories(tmp_dir);
    {
        std::ofstream out(path);
        out << json << "\n";
        MOERL_CHECK(out.good(), "cannot write ", path.string());
    }
    store.put_file(kRunDoneKey, path.string());
    fs::remove(path);
}

bool run_done(CheckpointStore& store) { return store.exists(kRunDoneKey); }

}  // namespace moerl::control
