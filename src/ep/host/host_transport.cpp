// The host transport: ranks are processes (or threads) on one machine; each rank's region is a
// POSIX shared-memory segment mapped by every peer. Signals are atomic counters in the receiver's
// segment, bumped with release order after the data is copied.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "builtin.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/process.hpp"

namespace moerl::ep {

namespace {

constexpr size_t kPage = 4096;

// Segment layout: [signal counters: kNumChannels x W uint64][pad to page][region]
size_t counters_bytes(int world_size) {
    size_t n = static_cast<size_t>(kNumChannels) * world_size * sizeof(uint64_t);
    return (n + kPage - 1) / kPage * kPage;
}

// Unique on the machine (process id and a random tag): peers learn the name through the store, so
// concurrent groups with the same job id never collide.
std::string segment_name(int rank) {
    std::random_device rd;
    return "/moerl-ep-" + std::to_string(getpid()) + "-" + std::to_string(rank) + "-" + std::to_string(rd());
}

class Mapping {
  public:
    Mapping() = default;
    Mapping(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
    Mapping(Mapping&& o) noexcept : base_(std::exchange(o.base_, nullptr)), bytes_(o.bytes_) {}
    Mapping& operator=(Mapping&& o) noexcept {
        reset();
        base_ = std::exchange(o.base_, nullptr);
        bytes_ = o.bytes_;
        return *this;
    }
    ~Mapping() { reset(); }
    void reset() {
        if (base_ != nullptr) munmap(base_, bytes_);
        base_ = nullptr;
    }
    std::byte* get() const { return static_cast<std::byte*>(base_); }

  private:
    void* base_ = nullptr;
    size_t bytes_ = 0;
};

Mapping map_segment(const std::string& name, size_t bytes, bool create) {
    int fd = -1;
    if (create) {
        shm_unlink(name.c_str());  // a stale segment from a crashed run of the same job
        fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        MOERL_CHECK(fd >= 0, "host transport: shm_open(", name, ") failed: ", std::strerror(errno));
        if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
            int err = errno;
            close(fd);
            shm_unlink(name.c_str());
            MOERL_FAIL("host transport: cannot size shared memory ", name, " to ", bytes,
                       " bytes: ", std::strerror(err), " (is /dev/shm large enough?)");
        }
    } else {
        fd = shm_open(name.c_str(), O_RDWR, 0600);
        MOERL_CHECK(fd >= 0, "host transport: cannot open peer segment ", name, ": ", std::strerror(errno));
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    MOERL_CHECK(p != MAP_FAILED, "host transport: mmap of ", name, " (", bytes,
                " bytes) failed: ", std::strerror(err));
    return Mapping(p, bytes);
}

class HostTransport final : public Transport {
  public:
    explicit HostTransport(const TransportOptions& o)
        : rank_(o.rank), world_size_(o.world_size), region_bytes_(o.region_bytes), store_(o.store) {
        MOERL_CHECK(world_size_ == 1 || store_ != nullptr, "host transport: a bootstrap store is needed for ",
                    world_size_, " ranks");
        MOERL_CHECK(o.region_memory == RegionMemory::kHost,
                    "host transport: region_memory = ", region_memory_name(o.region_memory),
                    ": shared host memory only (the fabric transport registers device memory)");
        const size_t seg_bytes = counters_bytes(world_size_) + region_bytes_;
        prefix_ = o.job_id + "/host";
        const auto timeout = std::chrono::milliseconds(static_cast<long>(o.timeout_s * 1000));
        const std::string name = segment_name(rank_);
        maps_.resize(world_size_);
        maps_[rank_] = map_segment(name, seg_bytes, true);
        std::memset(maps_[rank_].get(), 0, counters_bytes(world_size_));
        if (world_size_ > 1) {
            try {
                // "segment pid pid-namespace" of every rank.
                const std::string me = name + " " + std::to_string(::getpid()) + " " + pid_namespace();
                std::vector<uint8_t> mine(me.begin(), me.end());
                auto peers = all_gather(*store_, prefix_ + "/segment", rank_, world_size_, mine, timeout);
                peer_pid_.assign(world_size_, 0);
                for (int r = 0; r < world_size_; ++r) {
                    if (r == rank_) continue;
                    // Split by hand: no iostreams here. Inside Python after torch they bound to the
                    // wheel's libstdc++ copies and crashed (the Python module's GPU smoke test).
                    const std::string line(peers[r].begin(), peers[r].end());
                    const size_t a = line.find(' '), b = a == std::string::npos ? a : line.find(' ', a + 1);
                    const std::string segment = line.substr(0, a);
                    const pid_t pid =
                        a == std::string::npos ? 0 : static_cast<pid_t>(std::atol(line.c_str() + a + 1));
                    const std::string ns = b == std::string::npos ? std::string() : line.substr(b + 1);
                    maps_[r] = map_segment(segment, seg_bytes, false);
                    // Threads of this process share its pid; pids of other namespaces mean nothing here.
                    if (pid != ::getpid() && !ns.empty() && ns == pid_namespace()) peer_pid_[r] = pid;
                }
                // Every peer has mapped every segment: the names can go, so nothing leaks on a crash.
                all_gather(*store_, prefix_ + "/mapped", rank_, world_size_, {1}, timeout);
            } catch (...) {
                shm_unlink(name.c_str());  // a peer that never came must not leave the segment in memory
                throw;
            }
        }
        shm_unlink(name.c_str());
        timeout_ = timeout;
    }

    ~HostTransport() override {
        try {
            destroy();
        } catch (...) {
        }
    }

    std::string name() const override { return "host"; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_size_; }
    std::byte* region() override { return region_of(rank_); }
    size_t region_bytes() const override { return region_bytes_; }
    std::byte* peer_region(int peer) override { return region_of(peer); }

    void write(int peer, size_t src_offset, size_t dst_offset, size_t bytes, int channel) override {
        check_range(src_offset, bytes, "source");
        check_range(dst_offset, bytes, "destination");
        if (bytes > 0) std::memcpy(region_of(peer) + dst_offset, region_of(rank_) + src_offset, bytes);
        signal(peer, channel);
    }

    void signal(int peer, int channel) override {
        std::atomic_ref<uint64_t>(counter(peer, channel, rank_)).fetch_add(1, std::memory_order_release);
    }

    void quiet() override {}

    uint64_t signals(int channel, int src) override {
        return std::atomic_ref<uint64_t>(counter(rank_, channel, src)).load(std::memory_order_acquire);
    }

    // The default wait, and every 50 ms a look at whether src is still alive.
    void wait(int channel, int src, uint64_t target, Clock::time_point deadline, const char* phase) override {
        const pid_t pid = src >= 0 && src < static_cast<int>(peer_pid_.size()) ? peer_pid_[src] : 0;
        int spins = 0;
        auto next_look = Clock::now() + std::chrono::milliseconds(50);
        while (signals(channel, src) < target) {
            if (++spins < 1024) continue;
            const auto now = Clock::now();
            if (pid > 0 && now > next_look) {
                next_look = now + std::chrono::milliseconds(50);
                if (!process_alive(pid) && signals(channel, src) < target)
                    throw TimeoutError(
                        detail::concat("rank ", rank_, ": gave up in ", phase, " waiting for rank ", src,
                                       " (host, channel ", channel, ", have ", signals(channel, src), " of ",
                                       target, " signals): rank ", src, " (pid ", pid, ") has exited"),
                        __FILE__, __LINE__);
            }
            if (now > deadline) {
                throw TimeoutError(
                    detail::concat("rank ", rank_, ": timed out in ", phase, " waiting for rank ", src,
                                   " (host, channel ", channel, ", have ", signals(channel, src), " of ",
                                   target, " signals)"),
                    __FILE__, __LINE__);
            }
            std::this_thread::yield();
        }
    }

    void destroy() override {
        if (destroyed_) return;
        destroyed_ = true;
        if (world_size_ > 1 && store_ != nullptr)
            all_gather(*store_, prefix_ + "/destroy", rank_, world_size_, {1}, timeout_);
        maps_.clear();
    }

  private:
    std::byte* region_of(int r) { return maps_[r].get() + counters_bytes(world_size_); }
    uint64_t& counter(int owner, int channel, int src) {
        return reinterpret_cast<uint64_t*>(maps_[owner].get())[channel * world_size_ + src];
    }
    void check_range(size_t offset, size_t bytes, const char* what) const {
        MOERL_CHECK(offset + bytes <= region_bytes_, "host transport: ", what, " range [", offset, ", ",
                    offset + bytes, ") exceeds the region (", region_bytes_, " bytes)");
    }

    int rank_;
    int world_size_;
    size_t region_bytes_;
    Store* store_;
    std::string prefix_;
    std::chrono::milliseconds timeout_{60000};
    std::vector<Mapping> maps_;
    std::vector<pid_t> peer_pid_;  // 0: not checked (this process, another PID namespace)
    bool destroyed_ = false;
};

}  // namespace

std::unique_ptr<Transport> make_host_transport(const TransportOptions& options) {
    return std::make_unique<HostTransport>(options);
}

}  // namespace moerl::ep
