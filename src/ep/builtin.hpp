// Internal: the transports and engines compiled into this build, wired explicitly (no static
// registration, which static libraries would drop).
#pragma once

#include <memory>
#include <string>

#include "engine.hpp"
#include "moerl/ep/transport.hpp"

namespace moerl::ep {

std::unique_ptr<Transport> make_host_transport(const TransportOptions& options);
// "proxy+NAME": NAME's transport driven through a write proxy (proxied_transport.cpp).
std::unique_ptr<Transport> make_proxied_transport(const std::string& inner, const TransportOptions& options);
#ifdef MOERL_HAVE_FABRIC
std::unique_ptr<Transport> make_fabric_transport(const TransportOptions& options);
#endif
#ifdef MOERL_HAVE_CUDA
std::unique_ptr<Engine> make_cuda_engine(const Config& config, Store* store);
std::unique_ptr<Engine> make_nccl_engine(const Config& config, Store* store);
// "cuda-fabric/PROVIDER": packed rows in GPU memory over libfabric, written through a write proxy.
std::unique_ptr<Engine> make_fabric_gpu_engine(const Config& config, Store* store);
#endif

}  // namespace moerl::ep
