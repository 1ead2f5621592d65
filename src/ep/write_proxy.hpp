// Internal: the proxy thread that drives a transport for producers that cannot call it, GPU kernels
// above all (EP between nodes: a kernel packs tokens into a device region, and the NIC must be told
// to move them; only the CPU can post to libfabric). Producers queue commands on their own ring
// (write_queue.hpp); the proxy runs them in order on the transport and mirrors its signal counters
// back into the queue memory, where a kernel can poll them.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "moerl/ep/transport.hpp"
#include "write_queue.hpp"

namespace moerl::ep::proxy {

// Where the queue block lives. kHost: this process's memory (host producers). kCudaMapped: pinned
// host memory mapped into the current CUDA device's address space (kernels produce through
// device_view(); the proxy polls the same bytes). Needs a CUDA build.
enum class QueueMemory { kHost, kCudaMapped };

struct ProxyOptions {
    int num_rings = 1;   // producers (e.g. one a GPU block that sends), >= 1
    int capacity = 256;  // commands a ring holds before its producer waits, >= 1
    QueueMemory memory = QueueMemory::kHost;
};

class WriteProxy {
  public:
    // Starts the proxy thread on `transport`, which must outlive it and which nothing else calls
    // write/signal/quiet on while it runs (signals() and wait() are fine).
    WriteProxy(Transport& transport, const ProxyOptions& options);
    ~WriteProxy();  // stops the thread (commands still queued are not run)
    WriteProxy(const WriteProxy&) = delete;
    WriteProxy& operator=(const WriteProxy&) = delete;

    const QueueView& host_view() const { return host_; }
    // The same block as the GPU addresses it (kCudaMapped); equal to host_view() for kHost.
    const QueueView& device_view() const { return device_; }
    int num_rings() const { return options_.num_rings; }
    int capacity() const { return options_.capacity; }
    Transport& transport() const { return transport_; }

    // Throws the error the proxy stopped on, if any, naming the ring and command.
    void check() const;
    // True once the thread no longer runs commands (an error, or stop()).
    bool failed() const { return load_acquire(host_.header->failed.value) != 0; }
    // Blocks until `ring` has run `count` quiet commands; false at the deadline, Error when the
    // proxy failed (its message) or was stopped.
    bool wait_quiets(int ring, uint64_t count, Clock::time_point deadline) const;
    // Commands run so far, over all rings.
    uint64_t commands_run() const { return commands_run_.load(std::memory_order_relaxed); }
    // Stops the thread; idempotent. Producers waiting afterwards see a failed proxy.
    void stop();

  private:
    void run();
    void execute(int ring, const Command& c);
    void mirror_signals();
    void fail(const std::string& what);

    Transport& transport_;
    const ProxyOptions options_;
    void* block_ = nullptr;  // the queue block (host address)
    int cuda_device_ = -1;   // kCudaMapped: the CUDA device current at construction
    size_t block_bytes_ = 0;
    QueueView host_, device_;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> commands_run_{0};
    mutable std::mutex error_mu_;
    std::string error_;  // GUARDED_BY(error_mu_)
    std::thread thread_;
};

}  // namespace moerl::ep::proxy
