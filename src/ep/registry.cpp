#include <map>
#include <mutex>

#include "builtin.hpp"
#include "moerl/core/error.hpp"

namespace moerl::ep {

namespace {

struct Registry {
    std::mutex mu;
    std::map<std::string, TransportFactory> transports;  // GUARDED_BY(mu)
    std::map<std::string, EngineFactory> engines;        // GUARDED_BY(mu)

    Registry() {
        transports["host"] = make_host_transport;
#ifdef MOERL_HAVE_FABRIC
        transports["fabric"] = make_fabric_transport;
#endif
#ifdef MOERL_HAVE_CUDA
        engines["cuda"] = make_cuda_engine;
        engines["nccl"] = make_nccl_engine;
#ifdef MOERL_HAVE_FABRIC
        engines["cuda-fabric"] = make_fabric_gpu_engine;
#endif
#endif
    }
};

// A transport's name behind this prefix: the same transport driven through a write proxy.
const std::string kProxied = "proxy+";

Registry& registry() {
    static Registry r;
    return r;
}

}  // namespace

void register_transport(const std::string& name, TransportFactory factory) {
    std::lock_guard lock(registry().mu);
    registry().transports[name] = std::move(factory);
}

void register_engine(const std::string& transport, EngineFactory factory) {
    std::lock_guard lock(registry().mu);
    registry().engines[transport] = std::move(factory);
}

std::vector<std::string> available_transports() {
    std::lock_guard lock(registry().mu);
    std::vector<std::string> out;
    for (auto& [name, f] : registry().transports) out.push_back(name);
    for (auto& [name, f] : registry().transports) out.push_back(kProxied + name);
    for (auto& [name, f] : registry().engines) out.push_back(name);
    return out;
}

bool has_transport(const std::string& name) {
    if (name.rfind(kProxied, 0) == 0) {
        std::lock_guard lock(registry().mu);
        return registry().transports.count(name.substr(kProxied.size())) > 0;
    }
    std::lock_guard lock(registry().mu);
    return registry().transports.count(name) || registry().engines.count(name);
}

std::unique_ptr<Transport> make_transport(const std::string& name, const TransportOptions& options) {
    if (name.rfind(kProxied, 0) == 0) return make_proxied_transport(name.substr(kProxied.size()), options);
    TransportFactory factory;
    {
        std::lock_guard lock(registry().mu);
        auto it = registry().transports.find(name);
        if (it != registry().transports.end()) factory = it->second;
    }
    if (!factory) {
        std::string known;
        for (auto& n : available_transports()) known += (known.empty() ? "" : ", ") + n;
        MOERL_FAIL("unknown EP transport '", name, "'; this build has: ", known);
    }
    return factory(options);
}

std::unique_ptr<Engine> make_engine(const Config& config, Store* store) {
    EngineFactory factory;
    {
        std::lock_guard lock(registry().mu);
        auto it = registry().engines.find(config.transport);
        if (it != registry().engines.end()) factory = it->second;
    }
    if (factory) return factory(config, store);
    return make_host_engine(config, store);
}

}  // namespace moerl::ep
