// The write proxy (write_proxy.hpp) and the host side of its queues (write_queue.hpp).
#include "write_proxy.hpp"

#include <cstdlib>
#include <cstring>
#include <new>

#include "moerl/core/error.hpp"

#if MOERL_HAVE_CUDA
#include "moerl/core/cuda_check.hpp"
#endif

namespace moerl::ep::proxy {

namespace {

constexpr size_t kAlign = 64;

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

const char* kind_name(uint32_t kind) {
    switch (kind) {
        case kWrite:
            return "write";
        case kSignal:
            return "signal";
        case kQuiet:
            return "quiet";
    }
    return "unknown command";
}

// Spin, then yield, then sleep: a proxy with nothing to do should not hold a core.
void idle(int& rounds) {
    if (rounds < (1 << 20)) ++rounds;
    if (rounds < 256) return;
    if (rounds < 4096) {
        std::this_thread::yield();
        return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rounds < 20000 ? 20 : 200));
}

}  // namespace

size_t QueueView::bytes_for(uint32_t num_rings, uint32_t capacity, uint32_t num_signals) {
    return round_up(sizeof(QueueHeader)) + 3 * num_rings * sizeof(Counter) +
           round_up(num_signals * sizeof(uint64_t)) +
           static_cast<size_t>(num_rings) * capacity * sizeof(Command);
}

QueueView QueueView::at(void* base, uint32_t num_rings, uint32_t capacity, uint32_t num_signals) {
    auto* p = static_cast<std::byte*>(base);
    QueueView v;
    v.header = reinterpret_cast<QueueHeader*>(p);
    p += round_up(sizeof(QueueHeader));
    v.tail = reinterpret_cast<Counter*>(p);
    p += num_rings * sizeof(Counter);
    v.head = reinterpret_cast<Counter*>(p);
    p += num_rings * sizeof(Counter);
    v.quiets_done = reinterpret_cast<Counter*>(p);
    p += num_rings * sizeof(Counter);
    v.signals = reinterpret_cast<uint64_t*>(p);
    p += round_up(num_signals * sizeof(uint64_t));
    v.slots = reinterpret_cast<Command*>(p);
    (void)capacity;
    return v;
}

WriteProxy::WriteProxy(Transport& transport, const ProxyOptions& options)
    : transport_(transport), options_(options) {
    MOERL_CHECK(options.num_rings >= 1 && options.num_rings <= 4096,
                "write proxy: num_rings = ", options.num_rings, ", expected 1..4096");
    MOERL_CHECK(options.capacity >= 1 && options.capacity <= (1 << 20),
                "write proxy: capacity = ", options.capacity, ", expected 1..1048576");
    const auto rings = static_cast<uint32_t>(options.num_rings);
    const auto capacity = static_cast<uint32_t>(options.capacity);
    const auto num_signals = static_cast<uint32_t>(transport.world_size() * kNumChannels);
    block_bytes_ = QueueView::bytes_for(rings, capacity, num_signals);
    if (options.memory == QueueMemory::kCudaMapped) {
#if MOERL_HAVE_CUDA
        MOERL_CUDA_CHECK(cudaGetDevice(&cuda_device_));
        MOERL_CUDA_CHECK(cudaHostAlloc(&block_, block_bytes_, cudaHostAllocMapped | cudaHostAllocPortable));
        void* device_base = nullptr;
        const cudaError_t rc = cudaHostGetDevicePointer(&device_base, block_, 0);
        if (rc != cudaSuccess) cudaFreeHost(block_);
        MOERL_CUDA_CHECK(rc);
        device_ = QueueView::at(device_base, rings, capacity, num_signals);
#else
        MOERL_FAIL("write proxy: queue memory cuda-mapped needs a CUDA build (MOERL_WITH_CUDA=ON)");
#endif
    } else {
        block_ = ::operator new (block_bytes_, std::align_val_t{kAlign});
    }
    std::memset(block_, 0, block_bytes_);
    host_ = QueueView::at(block_, rings, capacity, num_signals);
    if (options.memory == QueueMemory::kHost) device_ = host_;
    *host_.header = QueueHeader{};
    host_.header->num_rings = rings;
    host_.header->capacity = capacity;
    host_.header->num_signals = num_signals;
    thread_ = std::thread([this] { run(); });
}

WriteProxy::~WriteProxy() {
    stop();
    if (options_.memory == QueueMemory::kCudaMapped) {
#if MOERL_HAVE_CUDA
        cudaFreeHost(block_);
#endif
    } else {
        ::operator delete (block_, std::align_val_t{kAlign});
    }
}

void WriteProxy::stop() {
    stop_.store(true, std::memory_order_release);
    if (thread_.joinable()) thread_.join();
    // Whoever waits on the queues from now on must not wait for a proxy that is gone.
    if (!failed()) store_release(host_.header->failed.value, kStopped);
}

void WriteProxy::check() const {
    if (load_acquire(host_.header->failed.value) != kFailed) return;
    std::lock_guard lock(error_mu_);
    MOERL_FAIL(error_);
}

bool WriteProxy::wait_quiets(int ring, uint64_t count, Clock::time_point deadline) const {
    for (int rounds = 0; load_acquire(host_.quiets_done[ring].value) < count;) {
        const uint64_t state = load_acquire(host_.header->failed.value);
        if (state == kFailed) check();
        MOERL_CHECK(state != kStopped, "write queue ", ring, ": the write proxy was stopped");
        if (Clock::now() > deadline) return false;
        idle(rounds);
    }
    return true;
}

void WriteProxy::fail(const std::string& what) {
    {
        std::lock_guard lock(error_mu_);
        if (error_.empty()) error_ = what;
    }
    store_release(host_.header->failed.value, kFailed);
}

void WriteProxy::run() {
    const int rings = options_.num_rings;
    const uint64_t capacity = static_cast<uint64_t>(options_.capacity);
    std::vector<uint64_t> head(rings, 0), quiets(rings, 0);
#if MOERL_HAVE_CUDA
    // The transport's copies of device memory (a self write, a provider's staging) run on this thread:
    // on the device of the queues' owner, not on device 0.
    if (cuda_device_ >= 0) cudaSetDevice(cuda_device_);
#endif
    int ring = 0;
    uint64_t pos = 0;
    try {
        for (int rounds = 0; !stop_.load(std::memory_order_acquire);) {
            bool ran = false;
            for (ring = 0; ring < rings; ++ring) {
                const uint64_t tail = load_acquire(host_.tail[ring].value);
                for (; head[ring] < tail; ++head[ring]) {
                    pos = head[ring];
                    const Command c = host_.slots[static_cast<size_t>(ring) * capacity + pos % capacity];
                    execute(ring, c);
                    if (c.kind == kQuiet) store_release(host_.quiets_done[ring].value, ++quiets[ring]);
                    // The slot is free once its command has been handed to the transport.
                    store_release(host_.head[ring].value, head[ring] + 1);
                    commands_run_.fetch_add(1, std::memory_order_relaxed);
                    ran = true;
                }
            }
            mirror_signals();
            if (ran)
                rounds = 0;
            else
                idle(rounds);
        }
    } catch (const std::exception& e) {
        fail(detail::concat("write proxy of rank ", transport_.rank(), " (", transport_.name(),
                            ") stopped at command ", pos, " of ring ", ring, ": ", e.what()));
    }
}

void WriteProxy::execute(int ring, const Command& c) {
    const int world = transport_.world_size();
    MOERL_CHECK(c.peer < static_cast<uint32_t>(world) && c.channel < static_cast<uint32_t>(kNumChannels),
                kind_name(c.kind), " names rank ", c.peer, " channel ", c.channel, " (world_size ", world,
                ", ", kNumChannels, " channels) on ring ", ring);
    switch (c.kind) {
        case kWrite:
            transport_.write(static_cast<int>(c.peer), c.src_offset, c.dst_offset, c.bytes,
                             static_cast<int>(c.channel));
            return;
        case kSignal:
            transport_.signal(static_cast<int>(c.peer), static_cast<int>(c.channel));
            return;
        case kQuiet:
            transport_.quiet();
            return;
    }
    MOERL_FAIL("command kind ", c.kind, " is none of write, signal, quiet");
}

void WriteProxy::mirror_signals() {
    const int world = transport_.world_size();
    for (int src = 0; src < world; ++src)
        for (int channel = 0; channel < kNumChannels; ++channel) {
            uint64_t& mirror = host_.signals[static_cast<size_t>(src) * kNumChannels + channel];
            const uint64_t now = transport_.signals(channel, src);
            if (now != mirror) store_release(mirror, now);  // only the proxy writes it
        }
}

HostProducer::HostProducer(const WriteProxy& proxy, int ring)
    : proxy_(proxy), q_(proxy.host_view()), ring_(ring), world_size_(proxy.transport().world_size()) {
    MOERL_CHECK(ring >= 0 && ring < proxy.num_rings(), "write queue: ring ", ring, " of ", proxy.num_rings());
    next_ = load_acquire(q_.tail[ring].value);
    quiets_ = load_acquire(q_.quiets_done[ring].value);
}

void HostProducer::check_proxy() const {
    const uint64_t state = load_acquire(q_.header->failed.value);
    if (state == kFailed) proxy_.check();
    MOERL_CHECK(state != kStopped, "write queue ", ring_, ": the write proxy was stopped");
}

void HostProducer::push(const Command& c) {
    const uint64_t capacity = q_.header->capacity;
    for (int rounds = 0; next_ - load_acquire(q_.head[ring_].value) >= capacity;) {
        check_proxy();
        idle(rounds);  // a full ring drains as fast as the transport takes commands
    }
    check_proxy();
    q_.slots[static_cast<size_t>(ring_) * capacity + next_ % capacity] = c;
    store_release(q_.tail[ring_].value, ++next_);
}

void HostProducer::write(int peer, size_t src_offset, size_t dst_offset, size_t bytes, int channel) {
    push(Command{kWrite, static_cast<uint32_t>(peer), static_cast<uint32_t>(channel), 0, src_offset,
                 dst_offset, bytes});
}

void HostProducer::signal(int peer, int channel) {
    push(Command{kSignal, static_cast<uint32_t>(peer), static_cast<uint32_t>(channel)});
}

void HostProducer::quiet(Clock::time_point deadline) {
    push(Command{kQuiet});
    ++quiets_;
    if (!proxy_.wait_quiets(ring_, quiets_, deadline))
        throw TimeoutError(detail::concat("write queue ", ring_, ": timed out in quiet (the proxy ran ",
                                          proxy_.commands_run(), " commands)"),
                           __FILE__, __LINE__);
}

uint64_t HostProducer::signals(int channel, int src) const {
    MOERL_CHECK(src >= 0 && src < world_size_ && channel >= 0 && channel < kNumChannels,
                "write queue: signals of rank ", src, " channel ", channel, " (world_size ", world_size_,
                ")");
    return load_acquire(q_.signals[static_cast<size_t>(src) * kNumChannels + channel]);
}

void HostProducer::wait(int channel, int src, uint64_t target, Clock::time_point deadline,
                        const char* phase) const {
    for (int rounds = 0; signals(channel, src) < target;) {
        check_proxy();
        if (Clock::now() > deadline)
            throw TimeoutError(detail::concat("write queue ", ring_, ": timed out in ", phase,
                                              " waiting for rank ", src, " (channel ", channel, ", have ",
                                              signals(channel, src), " of ", target, " signals)"),
                               __FILE__, __LINE__);
        idle(rounds);
    }
}

}  // namespace moerl::ep::proxy
