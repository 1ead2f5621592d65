// The transport table: how bytes reach a peer's symmetric region and how the peer learns they arrived.
//
// Every rank registers one region of the same size; offsets mean the same thing on every rank.
// A write copies bytes from the local region into a peer's region and, once all of them have
// landed, adds one to the peer's signal counter for (channel, source rank). Signals are carried by
// completions (libfabric remote CQ data) or issued after the data is visible (shared memory): never
// a flag that could overtake the data.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moerl/ep/config.hpp"
#include "moerl/ep/store.hpp"

namespace moerl::ep {

constexpr int kNumChannels = 16;  // signal channels per source rank

using Clock = std::chrono::steady_clock;

// Where a transport's region lives.
//  kHost: this process's memory; the CPU reads and writes it (host engine, host and fabric transports).
//  kCuda: device memory of TransportOptions::device. The fabric transport registers it with the NIC
//    (libfabric FI_HMEM, GPU-direct RDMA on EFA and verbs), so bytes go from GPU to GPU without a
//    host copy; kernels fill and read it, and the CPU reaches it only through copy_into_region and
//    copy_from_region.
//  kHostAsDevice: host memory that the fabric transport registers and moves exactly as it does
//    device memory (FI_HMEM capability, its own registration apart from the signal scratch,
//    reached only through the copy calls): the device-memory path, run where no provider here
//    can reach a GPU.
enum class RegionMemory { kHost, kCuda, kHostAsDevice };

const char* region_memory_name(RegionMemory memory);

class Transport {
  public:
    virtual ~Transport() = default;

    // Name as given to the registry ("host", "fabric/tcp", ...).
    virtual std::string name() const = 0;
    virtual int rank() const = 0;
    virtual int world_size() const = 0;
    // Local symmetric region, region_bytes() long, writable by peers.
    virtual std::byte* region() = 0;
    virtual size_t region_bytes() const = 0;
    virtual RegionMemory region_memory() const { return RegionMemory::kHost; }
    // Copies between this process's memory and the local region at `offset`, whatever memory the
    // region is in (the only way the CPU reaches a device region). Synchronous. The range must lie
    // inside the region.
    virtual void copy_into_region(size_t offset, const void* src, size_t bytes);
    virtual void copy_from_region(size_t offset, void* dst, size_t bytes);
    // Optional: a pointer through which this process can store into peer's region directly
    // (shared memory). nullptr when the transport cannot (the caller then uses write()).
    virtual std::byte* peer_region(int /*peer*/) { return nullptr; }
    // Copies region()[src_offset, +bytes) into peer's region at dst_offset, then signals
    // (channel, rank()) on the peer. bytes may be 0 (a pure signal). Asynchronous; see quiet().
    virtual void write(int peer, size_t src_offset, size_t dst_offset, size_t bytes, int channel) = 0;
    // Signals (channel, rank()) on peer without data, after earlier writes to it through
    // peer_region() are visible.
    virtual void signal(int peer, int channel) = 0;
    // Blocks until every write issued so far has left the local region (it may be reused).
    virtual void quiet() = 0;
    // Number of signals received so far from src on channel (monotonic).
    virtual uint64_t signals(int channel, int src) = 0;
    // Blocks until signals(channel, src) >= target; throws moerl::TimeoutError naming the phase
    // and the peer at the deadline.
    virtual void wait(int channel, int src, uint64_t target, Clock::time_point deadline, const char* phase);
    // Collective teardown: after it no peer writes into this rank's region.
    virtual void destroy() {}
};

struct TransportOptions {
    int rank = 0;
    int world_size = 1;
    size_t region_bytes = 0;
    std::string job_id = "moerl";
    std::string fabric_provider = "tcp";
    std::string fabric_domain;                         // Config::fabric_domain
    size_t fabric_chunk_bytes = size_t{8} << 20;       // Config::fabric_chunk_bytes
    RegionMemory region_memory = RegionMemory::kHost;  // fabric only; the host transport refuses others
    int device = 0;                                    // the CUDA device of a kCuda region
    double timeout_s = 60.0;
    Store* store = nullptr;  // bootstrap; required when world_size > 1
};

using TransportFactory = std::function<std::unique_ptr<Transport>(const TransportOptions&)>;

// Registry of the transports compiled in. "host" is always there; "fabric" with MOERL_WITH_FABRIC.
void register_transport(const std::string& name, TransportFactory factory);
std::vector<std::string> available_transports();
bool has_transport(const std::string& name);
// Throws naming the transport and listing the available ones when it is unknown.
std::unique_ptr<Transport> make_transport(const std::string& name, const TransportOptions& options);

}  // namespace moerl::ep
