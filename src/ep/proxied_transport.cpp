// The "proxy+NAME" transports: NAME's transport with every write, signal and quiet queued through a
// write proxy (write_proxy.hpp) instead of called directly, and every wait polling the signal
// counters the proxy mirrors back. This is the path a GPU kernel takes to reach the NIC between
// nodes, run by the host engine over host memory: the engine's real dispatch and combine traffic
// (slot writes, ready signals, quiets, in their order) goes through the queue protocol the kernels
// use, on any transport this build has (proxy+host, proxy+fabric/tcp, proxy+fabric/shm).
//
// Direct stores into a peer's region (peer_region) are withheld, as a kernel between nodes has none:
// every byte crosses as a queued write.
#include <memory>
#include <string>

#include "builtin.hpp"
#include "moerl/core/error.hpp"
#include "write_proxy.hpp"

namespace moerl::ep {

namespace {

class ProxiedTransport final : public Transport {
  public:
    explicit ProxiedTransport(std::unique_ptr<Transport> inner)
        : inner_(std::move(inner)),
          proxy_(std::make_unique<proxy::WriteProxy>(*inner_, proxy::ProxyOptions{})),
          producer_(std::make_unique<proxy::HostProducer>(*proxy_, 0)) {}

    ~ProxiedTransport() override {
        try {
            destroy();
        } catch (...) {
        }
    }

    std::string name() const override { return "proxy+" + inner_->name(); }
    int rank() const override { return inner_->rank(); }
    int world_size() const override { return inner_->world_size(); }
    std::byte* region() override { return inner_->region(); }
    size_t region_bytes() const override { return inner_->region_bytes(); }
    RegionMemory region_memory() const override { return inner_->region_memory(); }
    void copy_into_region(size_t offset, const void* src, size_t bytes) override {
        inner_->copy_into_region(offset, src, bytes);
    }
    void copy_from_region(size_t offset, void* dst, size_t bytes) override {
        inner_->copy_from_region(offset, dst, bytes);
    }

    void write(int peer, size_t src_offset, size_t dst_offset, size_t bytes, int channel) override {
        live().write(peer, src_offset, dst_offset, bytes, channel);
    }
    void signal(int peer, int channel) override { live().signal(peer, channel); }
    void quiet() override {
        const auto timeout = std::chrono::milliseconds(static_cast<long>(timeout_s_ * 1000));
        live().quiet(Clock::now() + timeout);
    }
    uint64_t signals(int channel, int src) override { return live().signals(channel, src); }
    void wait(int channel, int src, uint64_t target, Clock::time_point deadline, const char* phase) override {
        live().wait(channel, src, target, deadline, phase);
    }

    // What is queued runs, the proxy stops, then the inner transport tears down with its peers.
    void destroy() override {
        if (!inner_) return;
        if (producer_ && !proxy_->failed()) {
            // The engine's last ready signals may still be queued: they run before the teardown.
            try {
                quiet();
            } catch (const std::exception&) {
            }
        }
        producer_.reset();
        if (proxy_) proxy_->stop();
        proxy_.reset();
        inner_->destroy();
        inner_.reset();
    }

    void set_timeout(double timeout_s) { timeout_s_ = timeout_s; }

  private:
    proxy::HostProducer& live() {
        MOERL_CHECK(producer_ != nullptr, "transport proxy+: used after destroy()");
        return *producer_;
    }

    std::unique_ptr<Transport> inner_;
    std::unique_ptr<proxy::WriteProxy> proxy_;
    std::unique_ptr<proxy::HostProducer> producer_;
    double timeout_s_ = 60.0;
};

}  // namespace

std::unique_ptr<Transport> make_proxied_transport(const std::string& inner, const TransportOptions& options) {
    MOERL_CHECK(inner.rfind("proxy+", 0) != 0, "transport 'proxy+", inner, "': one proxy is enough");
    auto t = std::make_unique<ProxiedTransport>(make_transport(inner, options));
    t->set_timeout(options.timeout_s);
    return t;
}

}  // namespace moerl::ep
