// The cuda-fabric engine ("cuda-fabric/efa", "cuda-fabric/tcp"): EP between nodes with the tokens in
// GPU memory. A packed engine (packed_engine.hpp) whose packing memory is the region of a fabric
// transport in device memory (libfabric FI_HMEM: on EFA the NIC reads and writes the GPU's memory
// directly), and whose exchanges are writes that a kernel queues on a write proxy: the packing
// kernels fill the send slots, the post kernel (kernels/proxy_post.hpp) queues one write per peer
// right behind them on the stream, and the proxy thread hands each to libfabric, which signals the
// peer when the bytes have landed. Only the CPU can post to the NIC; the kernel saves the host the
// synchronisation it would otherwise need to learn that the rows are packed.
//
// The host waits (never a kernel: a stand-in provider such as tcp copies GPU memory with CUDA calls
// that a spinning kernel could block):
//   before exchange e: every peer has finished reading this rank's exchange e-1 (channel kReady);
//   after posting it:  every peer's exchange e has landed here (kData), and this rank's writes have
//                      left its send slots (the quiet the post kernel queued).
// A call's last synchronisation tells the peers that its exchanges were read: a ready signal per
// exchange, queued by the host on a ring of its own.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>

#include "builtin.hpp"
#include "kernels/proxy_post.hpp"
#include "moerl/core/error.hpp"
#include "packed_engine.hpp"
#include "write_proxy.hpp"

namespace moerl::ep {

#ifdef MOERL_HAVE_FABRIC

namespace {

using namespace cuda;

constexpr int kDataChannel = 0;   // an exchange's bytes have landed (one signal per peer and exchange)
constexpr int kReadyChannel = 1;  // the receiver has read an exchange (one per peer and exchange)
constexpr int kKernelRing = 0;    // produced by the post kernel
constexpr int kHostRing = 1;      // produced by the host (ready signals)

class FabricGpuEngine final : public PackedEngine {
  public:
    FabricGpuEngine(const Config& config, Store* store) : PackedEngine(config, store, "cuda-fabric") {
        const int W = c_.world_size;
        MOERL_CHECK(W <= kMaxRanks, "the cuda-fabric EP engine supports at most ", kMaxRanks,
                    " ranks, world_size = ", W);
        send_offset_ = 0;
        recv_offset_ = slot_bytes() * W;
        summary_offset_ = 2 * slot_bytes() * W;
        TransportOptions o;
        o.rank = c_.rank;
        o.world_size = W;
        o.region_bytes = summary_offset_ + align256(summary_bytes());
        o.job_id = c_.job_id + "/cuda-fabric";
        o.fabric_provider = c_.fabric_provider;
        o.fabric_domain = c_.fabric_domain;
        o.fabric_chunk_bytes = c_.fabric_chunk_bytes;
        o.region_memory = RegionMemory::kCuda;
        o.device = device_;
        o.timeout_s = c_.timeout_s;
        o.store = store_;
        try {
            transport_ = make_transport("fabric", o);
        } catch (const TimeoutError&) {
            throw;
        } catch (const Error& e) {
            // The provider, or this libfabric, cannot register GPU memory (no FI_HMEM, or built
            // without CUDA): stage through host memory the GPU maps, so that the kernels pack into and
            // unpack from it directly across PCIe. Every rank of a job meets the same libfabric.
            o.region_memory = RegionMemory::kHost;
            o.job_id += "/staged";
            transport_ = make_transport("fabric", o);
            staged_why_ = e.message();
            static std::once_flag said;
            std::call_once(said, [&] {
                std::fprintf(stderr, "moerl: cuda-fabric/%s stages through pinned host memory: %s\n",
                             c_.fabric_provider.c_str(), staged_why_.c_str());
            });
        }
        if (staged()) {
            host_region_ = transport_->region();
            MOERL_CUDA_CHECK(cudaHostRegister(host_region_, transport_->region_bytes(),
                                              cudaHostRegisterMapped | cudaHostRegisterPortable));
            void* device_base = nullptr;
            MOERL_CUDA_CHECK(cudaHostGetDevicePointer(&device_base, host_region_, 0));
            base_ = static_cast<uint8_t*>(device_base);
        } else {
            base_ = reinterpret_cast<uint8_t*>(transport_->region());
        }
        // Room for one exchange (W writes and a quiet) on the kernel's ring, and for the ready
        // signals of a call's exchanges on the host's.
        proxy_ = std::make_unique<proxy::WriteProxy>(
            *transport_,
            proxy::ProxyOptions{
                .num_rings = 2, .capacity = 4 * W + 8, .memory = proxy::QueueMemory::kCudaMapped});
        host_ = std::make_unique<proxy::HostProducer>(*proxy_, kHostRing);
        set_packing_memory(base_ + send_offset_, base_ + recv_offset_,
                           reinterpret_cast<int*>(base_ + summary_offset_));
    }

    ~FabricGpuEngine() override {
        try {
            destroy();
        } catch (...) {
        }
    }

    std::string name() const override {
        return "cuda-fabric/" + c_.fabric_provider + (staged() ? " (staged through host memory)" : "");
    }

    // Safe to call again after it threw (a peer gone during the collective teardown).
    void destroy() override {
        if (!transport_) return;
        cudaSetDevice(device_);
        cudaDeviceSynchronize();
        if (host_ && !proxy_->failed()) {
            try {  // the last ready signals run before the teardown
                host_->quiet(Clock::now() + timeout_ms());
            } catch (const std::exception&) {
            }
        }
        host_.reset();
        if (proxy_) proxy_->stop();
        proxy_.reset();
        std::unique_ptr<Transport> transport = std::move(transport_);
        std::exception_ptr failed;
        try {
            transport->destroy();  // no peer writes into the region after it
        } catch (...) {
            failed = std::current_exception();
        }
        if (host_region_ != nullptr) cudaHostUnregister(host_region_);
        host_region_ = nullptr;
        transport.reset();
        if (failed) std::rethrow_exception(failed);
    }

  private:
    bool staged() const { return !staged_why_.empty(); }

    void check_live(const char* what) const override {
        MOERL_CHECK(transport_ != nullptr, what, ": EP buffer used after destroy()");
    }

    bool in_region(const void* p) const {
        const auto* b = static_cast<const uint8_t*>(p);
        return b >= base_ && b < base_ + transport_->region_bytes();
    }

    size_t region_offset(const void* p, const char* what) const {
        MOERL_CHECK(in_region(p), "cuda-fabric: ", what, " is outside the registered region");
        return static_cast<size_t>(static_cast<const uint8_t*>(p) - base_);
    }

    // Runs f; an error of the proxy or the transport (a peer gone, a failed write) gains the call's
    // step, which a timeout names already.
    template <typename F>
    void in_phase(const char* phase, F&& f) {
        try {
            f();
        } catch (const TimeoutError&) {
            throw;
        } catch (const Error& e) {
            MOERL_FAIL("rank ", c_.rank, ": ", phase, " (cuda-fabric): ", e.what());
        }
    }

    void exchange(const std::vector<Messages>& messages, cudaStream_t stream, const char* phase) override {
        in_phase(phase, [&] { post_and_wait(messages, stream, phase); });
    }

    void post_and_wait(const std::vector<Messages>& messages, cudaStream_t stream, const char* phase) {
        const int W = c_.world_size;
        const auto deadline = Clock::now() + timeout_ms();
        ++exchanges_;
        PostWritesArgs a{};
        a.queue = proxy_->device_view();
        a.ring = kKernelRing;
        a.channel = kDataChannel;
        a.world = W;
        for (int r = 0; r < W; ++r) {
            const Messages& m = messages[r];
            const void* send = m.send;
            if (!in_region(send)) {
                // Rows the caller holds (combine's y): into r's send slot first, in stream order.
                MOERL_CHECK(m.send_bytes <= slot_bytes(), "cuda-fabric: ", m.send_bytes, " bytes for rank ",
                            r, " exceed its send slot of ", slot_bytes());
                uint8_t* slot = base_ + send_offset_ + r * slot_bytes();
                if (m.send_bytes > 0)
                    MOERL_CUDA_CHECK(cudaMemcpyAsync(slot, m.send, m.send_bytes, cudaMemcpyDefault, stream));
                send = slot;
            }
            a.writes[r] = {region_offset(send, "a send buffer"),
                           region_offset(m.recv, "a receive slot") + c_.rank * m.recv_stride, m.send_bytes};
        }
        // Each peer must have read what this rank wrote into its slots in the previous exchange.
        try {
            for (int r = 0; r < W; ++r) host_->wait(kReadyChannel, r, exchanges_ - 1, deadline, phase);
        } catch (const TimeoutError& e) {
            throw TimeoutError(e.message() + " (the peer to free its receive slots)", __FILE__, __LINE__);
        }
        launch_post_writes(a, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        ++quiets_;
        for (int r = 0; r < W; ++r) host_->wait(kDataChannel, r, exchanges_, deadline, phase);
        // This rank's writes have left the send slots: the next packing kernel may refill them.
        if (!proxy_->wait_quiets(kKernelRing, quiets_, deadline))
            throw TimeoutError(
                detail::concat("rank ", c_.rank, ": timed out in ", phase, " after ", c_.timeout_s,
                               " s waiting for its writes to leave (cuda-fabric)"),
                __FILE__, __LINE__);
    }

    void check_progress(const char* phase) override {
        in_phase(phase, [&] { proxy_->check(); });
    }

    // The stream has run the receive kernels: tell every peer that the exchanges so far were read.
    void stream_finished(const char* phase) override {
        in_phase(phase, [&] {
            for (; released_ < exchanges_; ++released_)
                for (int r = 0; r < c_.world_size; ++r) host_->signal(r, kReadyChannel);
        });
    }

    std::unique_ptr<Transport> transport_;
    std::unique_ptr<proxy::WriteProxy> proxy_;
    std::unique_ptr<proxy::HostProducer> host_;
    uint8_t* base_ = nullptr;      // the region as the GPU addresses it
    std::string staged_why_;       // non-empty: the region is host memory, mapped for the GPU (why)
    void* host_region_ = nullptr;  // staged: the region's host address (registered with CUDA)
    size_t send_offset_ = 0, recv_offset_ = 0, summary_offset_ = 0;
    uint64_t exchanges_ = 0;  // exchanges run (each collective: every rank counts the same)
    uint64_t released_ = 0;   // exchanges whose ready signals are queued
    uint64_t quiets_ = 0;     // quiets the post kernel queued
};

}  // namespace

std::unique_ptr<Engine> make_fabric_gpu_engine(const Config& config, Store* store) {
    return std::make_unique<FabricGpuEngine>(config, store);
}

#else

std::unique_ptr<Engine> make_fabric_gpu_engine(const Config&, Store*) {
    MOERL_FAIL("the cuda-fabric EP transport needs a build with libfabric (MOERL_WITH_FABRIC=ON)");
}

#endif

}  // namespace moerl::ep
