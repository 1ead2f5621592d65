// Internal: the engine behind a Buffer. The host engine runs dispatch/combine on the CPU over any
// byte-moving Transport (host shared memory, libfabric); the cuda engine runs kernels over CUDA IPC;
// the nccl engine uses grouped ncclSend/ncclRecv. Buffer validates arguments before calling in.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "moerl/ep/buffer.hpp"

namespace moerl::ep {

class Engine {
  public:
    virtual ~Engine() = default;
    virtual std::string name() const = 0;
    virtual bool on_device() const = 0;
    virtual Handle dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                            const DispatchOutput& out, const Handle* reuse) = 0;
    virtual void combine(View<const void> y, const Handle& handle, View<void> out) = 0;
    virtual LowLatencyHandle low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                                  const LowLatencyOutput& out) = 0;
    virtual void low_latency_combine(View<const void> y, View<const int64_t> topk_idx,
                                     View<const float> topk_weights, const LowLatencyHandle& handle,
                                     View<void> out) = 0;
    virtual void destroy() = 0;
};

using EngineFactory = std::function<std::unique_ptr<Engine>(const Config&, Store*)>;

// Engines for transports that are not plain byte movers (cuda, nccl) register here; a name not
// registered as an engine is looked up as a Transport and run by the host engine.
void register_engine(const std::string& transport, EngineFactory factory);
std::unique_ptr<Engine> make_engine(const Config& config, Store* store);

std::unique_ptr<Engine> make_host_engine(const Config& config, Store* store);

}  // namespace moerl::ep
