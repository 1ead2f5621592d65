// The fabric transport: one libfabric FI_EP_RDM endpoint per rank, RMA writes into the peers'
// registered regions, and signals carried by remote CQ data (never a flag written after the data: EFA
// does not order them). A progress thread per rank reads the completion queue: remote CQ data becomes
// signal counters, local completions retire in-flight writes for quiet().
//
// Two registrations a rank: the region (region_bytes of user data, in host or device memory: see
// RegionMemory) and a host page of scratch: [0,8) source of pure signals, [64,72) where peers' pure
// signals land, [128,192) the buffer that receives posted for FI_RX_CQ_DATA point at (no data ever
// arrives there). The signals never touch the region, so a device region needs no host copy.
#include "fabric/fabric_transport.hpp"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "builtin.hpp"
#include "fabric/fi_check.hpp"
#include "fabric/record.hpp"
#include "fabric/signal_code.hpp"
#include "moerl/core/error.hpp"

#if MOERL_HAVE_CUDA
#include "moerl/core/cuda_check.hpp"
#endif

namespace moerl::ep {

namespace {

using fabric::Fid;
using fabric::Info;

constexpr size_t kScratchBytes = 4096;
constexpr size_t kScratchSrcOffset = 0;
constexpr size_t kScratchDstOffset = 64;
constexpr size_t kScratchRecvOffset = 128;
constexpr size_t kSignalBytes = 8;  // a pure signal writes these bytes: some providers reject 0-length RMA
constexpr size_t kRecvBytes = 64;
constexpr size_t kMaxPostedRecvs = 256;
constexpr int kCqBatch = 32;
constexpr int kEnableAttempts = 8;  // endpoints tried when the provider finds its name taken

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One idle round (counted, saturating): spin briefly, then yield, then sleep longer the longer nothing
// happens. The machine may have fewer cores than busy threads, and an idle rank should not burn one.
void backoff(int& idle_rounds) {
    if (idle_rounds < (1 << 20)) ++idle_rounds;
    if (idle_rounds < 64) return;
    if (idle_rounds < 1024) {
        std::this_thread::yield();
        return;
    }
    // About 100 ms of 20 us sleeps, then about 1 s of 200 us ones, then 1 ms.
    const int sleep_us = idle_rounds < 6144 ? 20 : idle_rounds < 11144 ? 200 : 1000;
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
}

class Mapping {
  public:
    Mapping() = default;
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() { reset(); }
    void map(size_t bytes) {
        reset();
        // MAP_POPULATE: FI_MR_ALLOCATED providers need the pages backed before registration.
        void* p =
            mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        MOERL_CHECK(p != MAP_FAILED, "fabric transport: mmap of ", bytes,
                    " bytes failed: ", std::strerror(errno));
        // A child forked later must not copy-on-write pages that the NIC may be writing.
        madvise(p, bytes, MADV_DONTFORK);
        base_ = static_cast<std::byte*>(p);
        bytes_ = bytes;
    }
    void reset() noexcept {
        if (base_ != nullptr) munmap(base_, bytes_);
        base_ = nullptr;
    }
    std::byte* get() const { return base_; }

  private:
    std::byte* base_ = nullptr;
    size_t bytes_ = 0;
};

// A region in device memory (RegionMemory::kCuda), freed on the device it came from.
class DeviceMemory {
  public:
    DeviceMemory() = default;
    DeviceMemory(const DeviceMemory&) = delete;
    DeviceMemory& operator=(const DeviceMemory&) = delete;
    ~DeviceMemory() { reset(); }
#if MOERL_HAVE_CUDA
    void allocate(int device, size_t bytes) {
        reset();
        int previous = 0;
        MOERL_CUDA_CHECK(cudaGetDevice(&previous));
        MOERL_CUDA_CHECK(cudaSetDevice(device));
        void* p = nullptr;
        const cudaError_t rc = cudaMalloc(&p, bytes);
        cudaSetDevice(previous);
        MOERL_CUDA_CHECK(rc);
        base_ = static_cast<std::byte*>(p);
        device_ = device;
    }
    void reset() noexcept {
        if (base_ == nullptr) return;
        int previous = 0;
        cudaGetDevice(&previous);
        cudaSetDevice(device_);
        cudaFree(base_);
        cudaSetDevice(previous);
        base_ = nullptr;
    }
#else
    [[noreturn]] void allocate(int, size_t) {
        MOERL_FAIL(
            "fabric transport: region_memory = cuda, but this build has no CUDA (MOERL_WITH_CUDA=OFF)");
    }
    void reset() noexcept {}
#endif
    std::byte* get() const { return base_; }

  private:
    std::byte* base_ = nullptr;
    int device_ = 0;
};

enum class OpKind : uint32_t { kWrite = 0x57524954, kRecv = 0x52454356 };

// Per-operation context: libfabric hands `fi` back in the completion; FI_CONTEXT/FI_CONTEXT2 providers
// use it as scratch until then, so it must stay put (the pool never moves it).
struct OpContext {
    fi_context2 fi;  // first member: the context pointer is the OpContext pointer
    OpKind kind = OpKind::kWrite;
    int peer = 0;
    int channel = 0;
    uint32_t seq = 0;
};

// Where writes to a peer land: its region or its scratch.
struct RemoteMemory {
    uint64_t base = 0;  // the peer's address when FI_MR_VIRT_ADDR, else 0
    uint64_t key = 0;
    bool key_mapped = false;  // FI_MR_RAW: key came from fi_mr_map_raw and must be unmapped
};

struct Peer {
    fi_addr_t addr = FI_ADDR_UNSPEC;
    RemoteMemory region;
    RemoteMemory scratch;
};

struct SendLane {
    uint64_t next_seq = 0;
    std::array<uint32_t, fabric::kSeqWindow> chunks_in_flight{};  // per sequence slot
};

class FabricTransport final : public Transport {
  public:
    explicit FabricTransport(const TransportOptions& options)
        : rank_(options.rank),
          world_size_(options.world_size),
          region_bytes_(options.region_bytes),
          provider_(options.fabric_provider),
          memory_(options.region_memory),
          device_(options.device),
          job_id_(options.job_id),
          timeout_(
              std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options.timeout_s))),
          store_(options.store) {
        MOERL_CHECK(world_size_ >= 1 && world_size_ <= fabric::kMaxRanks,
                    "fabric transport: world_size = ", world_size_, ", expected 1..", fabric::kMaxRanks);
        MOERL_CHECK(rank_ >= 0 && rank_ < world_size_, "fabric transport: rank = ", rank_, ", expected 0..",
                    world_size_ - 1);
        MOERL_CHECK(options.timeout_s > 0, "fabric transport: timeout_s = ", options.timeout_s,
                    ", expected > 0");
        MOERL_CHECK(world_size_ == 1 || store_ != nullptr, "fabric transport: world_size = ", world_size_,
                    " needs a bootstrap store, got none");

        const size_t num_lanes = static_cast<size_t>(world_size_) * kNumChannels;
        send_lanes_.resize(num_lanes);
        recv_lanes_.resize(num_lanes);
        signals_ = std::make_unique<std::atomic<uint64_t>[]>(num_lanes);
        for (size_t i = 0; i < num_lanes; ++i) signals_[i].store(0, std::memory_order_relaxed);
        writes_in_flight_per_peer_.assign(world_size_, 0);
        peers_.resize(world_size_);

        try {
            info_ = fabric::select_info(provider_, options.fabric_domain, memory_);
            mr_mode_ = static_cast<uint64_t>(info_->domain_attr->mr_mode);
            rx_cq_data_ = (info_->mode & FI_RX_CQ_DATA) != 0;
            MOERL_CHECK(options.fabric_chunk_bytes >= kSignalBytes, name(),
                        ": fabric_chunk_bytes = ", options.fabric_chunk_bytes,
                        ", expected >= ", kSignalBytes);
            chunk_bytes_ = std::min<size_t>(options.fabric_chunk_bytes, info_->ep_attr->max_msg_size);
            MOERL_CHECK(chunk_bytes_ >= kSignalBytes, name(),
                        ": provider max_msg_size = ", info_->ep_attr->max_msg_size, " is too small");
            open_endpoint();
            register_memory();
            post_initial_receives();
            progress_ = std::thread([this] { progress_loop(); });
            connect_peers();
        } catch (...) {
            release();
            throw;
        }
    }

    ~FabricTransport() override {
        if (destroyed_) return;
        try {
            destroy();
        } catch (const std::exception& e) {
            std::fprintf(stderr, "moerl: %s rank %d: destroy in destructor failed: %s\n", name().c_str(),
                         rank_, e.what());
        } catch (...) {
            std::fprintf(stderr, "moerl: %s rank %d: destroy in destructor failed\n", name().c_str(), rank_);
        }
    }

    std::string name() const override { return "fabric/" + provider_; }
    int rank() const override { return rank_; }
    int world_size() const override { return world_size_; }
    std::byte* region() override { return base_; }
    size_t region_bytes() const override { return region_bytes_; }
    RegionMemory region_memory() const override { return memory_; }

    void copy_into_region(size_t offset, const void* src, size_t bytes) override {
        check_range(offset, bytes, "copy_into_region");
        copy(base_ + offset, src, bytes, kIntoRegion);
    }
    void copy_from_region(size_t offset, void* dst, size_t bytes) override {
        check_range(offset, bytes, "copy_from_region");
        copy(dst, base_ + offset, bytes, kFromRegion);
    }

    void write(int peer, size_t src_offset, size_t dst_offset, size_t bytes, int channel) override {
        check_peer_channel(peer, channel, "write");
        check_range(src_offset, bytes, "write: source");
        check_range(dst_offset, bytes, "write: destination");
        post_message(peer, channel, src_offset, dst_offset, bytes);
    }

    void signal(int peer, int channel) override {
        check_peer_channel(peer, channel, "signal");
        post_message(peer, channel, 0, 0, 0);
    }

    void quiet() override {
        MOERL_CHECK(!destroyed_, name(), " rank ", rank_, ": quiet() after destroy()");
        const auto deadline = Clock::now() + timeout_;
        for (int idle = 0; writes_in_flight_.load(std::memory_order_acquire) > 0;) {
            check_failed();
            if (Clock::now() > deadline) {
                std::lock_guard lock(mu_);
                const auto it =
                    std::max_element(writes_in_flight_per_peer_.begin(), writes_in_flight_per_peer_.end());
                throw TimeoutError(
                    detail::concat(name(), " rank ", rank_, ": timed out in quiet waiting for rank ",
                                   it - writes_in_flight_per_peer_.begin(), " (", *it,
                                   " writes to it still in flight)"),
                    __FILE__, __LINE__);
            }
            backoff(idle);
        }
        check_failed();
    }

    uint64_t signals(int channel, int src) override {
        check_peer_channel(src, channel, "signals");
        return signals_[lane_idx(src, channel)].load(std::memory_order_acquire);
    }

    void wait(int channel, int src, uint64_t target, Clock::time_point deadline, const char* phase) override {
        check_peer_channel(src, channel, "wait");
        const std::atomic<uint64_t>& counter = signals_[lane_idx(src, channel)];
        for (int idle = 0; counter.load(std::memory_order_acquire) < target;) {
            check_failed();
            if (Clock::now() > deadline) {
                throw TimeoutError(
                    detail::concat(name(), " rank ", rank_, ": timed out in ",
                                   phase != nullptr ? phase : "wait", " waiting for rank ", src, " (channel ",
                                   channel, ", have ", counter.load(), " of ", target, " signals)"),
                    __FILE__, __LINE__);
            }
            backoff(idle);
        }
    }

    void destroy() override {
        if (destroyed_) return;
        std::exception_ptr first_error;
        try {
            quiet();
        } catch (...) {
            first_error = std::current_exception();
        }
        destroyed_ = true;
        // Every rank arrives here only after its own quiet(): once all have, nobody writes any more.
        // Joined even after a failed quiet so that the peers are not left waiting for this rank.
        if (world_size_ > 1) {
            try {
                gather("destroy", "closed", {1});
            } catch (...) {
                if (!first_error) first_error = std::current_exception();
            }
        }
        release();
        if (first_error) std::rethrow_exception(first_error);
    }

  private:
    enum CopyKind { kIntoRegion, kFromRegion, kWithinRegion };

    void check_range(size_t offset, size_t bytes, const char* what) const {
        MOERL_CHECK(offset <= region_bytes_ && bytes <= region_bytes_ - offset, name(), " ", what, " [",
                    offset, ", +", bytes, ") is outside the region of ", region_bytes_, " bytes");
    }

    // Copies where one side (or both, kWithinRegion) is the region, in whatever memory it is.
    void copy(void* dst, const void* src, size_t bytes, CopyKind kind) {
        if (bytes == 0) return;
#if MOERL_HAVE_CUDA
        if (memory_ == RegionMemory::kCuda) {
            const cudaMemcpyKind cuda_kind = kind == kIntoRegion   ? cudaMemcpyHostToDevice
                                             : kind == kFromRegion ? cudaMemcpyDeviceToHost
                                                                   : cudaMemcpyDeviceToDevice;
            // Done when this returns: a device-to-device cudaMemcpy alone may still be running, and the
            // signal that follows a self write must not overtake it.
            MOERL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cuda_kind, nullptr));
            MOERL_CUDA_CHECK(cudaStreamSynchronize(nullptr));
            return;
        }
#endif
        (void)kind;
        std::memmove(dst, src, bytes);
    }

    size_t lane_idx(int peer, int channel) const {
        return static_cast<size_t>(peer) * kNumChannels + channel;
    }

    void check_peer_channel(int peer, int channel, const char* what) const {
        MOERL_CHECK(peer >= 0 && peer < world_size_, name(), " ", what, ": rank ", peer,
                    " is out of range, world_size = ", world_size_);
        MOERL_CHECK(channel >= 0 && channel < kNumChannels, name(), " ", what, ": channel ", channel,
                    " is out of range, expected 0..", kNumChannels - 1);
    }

    void check_failed() {
        if (!failed_.load(std::memory_order_acquire)) return;
        std::lock_guard lock(error_mu_);
        std::rethrow_exception(error_);
    }

    void record_error(std::exception_ptr error) {
        std::lock_guard lock(error_mu_);
        if (!error_) error_ = std::move(error);
        failed_.store(true, std::memory_order_release);
    }

    // Publishes `mine` under job_id/fabric/<what> and collects every rank's value; a missing rank
    // becomes a TimeoutError that names this transport, the phase and (through all_gather) the rank.
    std::vector<std::vector<uint8_t>> gather(const char* phase, const char* what,
                                             const std::vector<uint8_t>& mine) {
        try {
            return all_gather(*store_, job_id_ + "/fabric/" + what, rank_, world_size_, mine,
                              std::chrono::duration_cast<std::chrono::milliseconds>(timeout_));
        } catch (const TimeoutError& e) {
            throw TimeoutError(
                detail::concat(name(), " rank ", rank_, ": timed out in ", phase, ": ", e.message()),
                __FILE__, __LINE__);
        }
    }

    void open_endpoint() {
        MOERL_FI_CHECK(fi_fabric(info_->fabric_attr, fabric_.out(), nullptr), "fi_fabric");
        MOERL_FI_CHECK(fi_domain(fabric_.get(), info_.get(), domain_.out(), nullptr), "fi_domain");

        fi_cq_attr cq_attr{};
        cq_attr.format = FI_CQ_FORMAT_DATA;
        cq_attr.wait_obj = FI_WAIT_NONE;  // the progress thread polls
        MOERL_FI_CHECK(fi_cq_open(domain_.get(), &cq_attr, cq_.out(), nullptr), "fi_cq_open");

        fi_av_attr av_attr{};
        av_attr.type =
            info_->domain_attr->av_type != FI_AV_UNSPEC ? info_->domain_attr->av_type : FI_AV_TABLE;
        av_attr.count = static_cast<size_t>(world_size_);
        MOERL_FI_CHECK(fi_av_open(domain_.get(), &av_attr, av_.out(), nullptr), "fi_av_open");

        // The shm provider names its region after the process id and an endpoint counter; a region
        // left behind by a killed process whose id was reused makes fi_enable fail busy. Another
        // endpoint gets the next counter value, so a fresh name.
        for (int attempt = 1;; ++attempt) {
            MOERL_FI_CHECK(fi_endpoint(domain_.get(), info_.get(), ep_.out(), nullptr), "fi_endpoint");
            MOERL_FI_CHECK(fi_ep_bind(ep_.get(), cq_.as_fid(), FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
            MOERL_FI_CHECK(fi_ep_bind(ep_.get(), av_.as_fid(), 0), "fi_ep_bind(av)");
            const int rc = fi_enable(ep_.get());
            if (rc == 0) break;
            if ((rc == -FI_EBUSY || rc == -EEXIST) && attempt < kEnableAttempts) {
                ep_.reset();
                continue;
            }
            MOERL_FI_CHECK(rc, "fi_enable");
        }
    }

    // The region (host or device memory, as options.region_memory says) and the host scratch, each
    // registered on its own: FI_MR_LOCAL providers get a descriptor for each.
    void register_memory() {
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        const size_t region_mapped_bytes = round_up(std::max<size_t>(region_bytes_, 1), page);
        if (memory_ == RegionMemory::kCuda) {
            device_memory_.allocate(device_, region_mapped_bytes);
            base_ = device_memory_.get();
        } else {
            region_mapping_.map(region_mapped_bytes);
            base_ = region_mapping_.get();
        }
        scratch_mapping_.map(round_up(kScratchBytes, page));
        scratch_ = scratch_mapping_.get();

        const fi_hmem_iface iface = memory_ == RegionMemory::kCuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
        // Keys (when the provider lets us choose) need only be unique within this rank's domain.
        mr_ = register_mr(base_, region_mapped_bytes, FI_WRITE | FI_REMOTE_WRITE, 2 * uint64_t(rank_), iface,
                          "the region");
        scratch_mr_ = register_mr(scratch_, round_up(kScratchBytes, page),
                                  FI_WRITE | FI_REMOTE_WRITE | (rx_cq_data_ ? FI_RECV : 0),
                                  2 * uint64_t(rank_) + 1, FI_HMEM_SYSTEM, "the signal scratch");
        const bool local = (mr_mode_ & FI_MR_LOCAL) != 0;
        region_desc_ = local ? fi_mr_desc(mr_.get()) : nullptr;
        scratch_desc_ = local ? fi_mr_desc(scratch_mr_.get()) : nullptr;
    }

    Fid<fid_mr> register_mr(std::byte* addr, size_t bytes, uint64_t access, uint64_t key, fi_hmem_iface iface,
                            const char* what) {
        if ((mr_mode_ & FI_MR_PROV_KEY) != 0) key = 0;
        const size_t key_size = info_->domain_attr->mr_key_size;
        MOERL_CHECK(key_size >= 8 || key < (uint64_t{1} << (8 * key_size)), name(),
                    ": mr_key_size = ", key_size, " bytes cannot hold key ", key);
        iovec iov{addr, bytes};
        fi_mr_attr attr{};
        attr.mr_iov = &iov;
        attr.iov_count = 1;
        attr.access = access;
        attr.requested_key = key;
        attr.iface = iface;
        if (iface == FI_HMEM_CUDA) attr.device.cuda = device_;
        Fid<fid_mr> mr;
        const int rc = fi_mr_regattr(domain_.get(), &attr, 0, mr.out());
        MOERL_CHECK(rc == 0, name(), " rank ", rank_, ": registering ", what, " (", bytes, " bytes of ",
                    iface == FI_HMEM_CUDA ? "CUDA device " + std::to_string(device_) : std::string("host"),
                    " memory) failed: ", fi_strerror(-rc), " (", rc, ")");
        if (mr_mode_ & FI_MR_ENDPOINT) {
            MOERL_FI_CHECK(fi_mr_bind(mr.get(), ep_.as_fid(), 0), "fi_mr_bind(ep)");
            MOERL_FI_CHECK(fi_mr_enable(mr.get()), "fi_mr_enable");
        }
        return mr;
    }

    void post_initial_receives() {
        if (!rx_cq_data_) return;
        // Each remote write with CQ data consumes one receive; the progress thread reposts it.
        size_t num_recvs = info_->rx_attr->size > 0 ? std::min(info_->rx_attr->size, kMaxPostedRecvs) : 64;
        for (size_t i = 0; i < num_recvs; ++i) {
            ops_.push_back(std::make_unique<OpContext>());
            ops_.back()->kind = OpKind::kRecv;
            post_recv_locked(ops_.back().get());
        }
    }

    // What a peer needs to write into `mr` at `addr`: base address, key, and the raw key (FI_MR_RAW).
    struct LocalKey {
        uint64_t base = 0;
        uint64_t key = 0;
        std::vector<uint8_t> raw_key;
    };
    LocalKey local_key(fid_mr* mr, const std::byte* addr) const {
        LocalKey k;
        k.base = reinterpret_cast<uint64_t>(addr);
        if (mr_mode_ & FI_MR_RAW) {
            size_t key_size = 0;
            const int size_rc = fi_mr_raw_attr(mr, &k.base, nullptr, &key_size, 0);
            MOERL_CHECK(size_rc == -FI_ETOOSMALL || size_rc == 0,
                        "libfabric: fi_mr_raw_attr (size query) failed: ", fi_strerror(-size_rc));
            k.raw_key.resize(key_size);
            MOERL_FI_CHECK(fi_mr_raw_attr(mr, &k.base, k.raw_key.data(), &key_size, 0), "fi_mr_raw_attr");
            k.raw_key.resize(key_size);
        } else {
            k.key = fi_mr_key(mr);
            MOERL_CHECK(k.key != FI_KEY_NOTAVAIL, name(), ": fi_mr_key returned FI_KEY_NOTAVAIL");
        }
        return k;
    }
    static void pack_key(fabric::Packer& packer, const LocalKey& k) {
        packer.put(k.base);
        packer.put(k.key);
        packer.put_bytes(k.raw_key);
    }
    RemoteMemory unpack_key(fabric::Unpacker& in) {
        RemoteMemory m;
        const auto base = in.get<uint64_t>();
        m.base = (mr_mode_ & FI_MR_VIRT_ADDR) ? base : 0;
        m.key = in.get<uint64_t>();
        auto raw_key = in.get_bytes();
        if (mr_mode_ & FI_MR_RAW) {
            MOERL_FI_CHECK(fi_mr_map_raw(domain_.get(), base, raw_key.data(), raw_key.size(), &m.key, 0),
                           "fi_mr_map_raw");
            m.key_mapped = true;
        }
        return m;
    }

    // Exchanges endpoint names and memory keys through the store, then fills the address vector.
    void connect_peers() {
        size_t name_len = 0;
        const int rc = fi_getname(ep_.as_fid(), nullptr, &name_len);
        MOERL_CHECK(rc == -FI_ETOOSMALL || rc == 0,
                    "libfabric: fi_getname (size query) failed: ", fi_strerror(-rc));
        std::vector<uint8_t> ep_name(name_len);
        MOERL_FI_CHECK(fi_getname(ep_.as_fid(), ep_name.data(), &name_len), "fi_getname");
        ep_name.resize(name_len);

        const LocalKey region_key = local_key(mr_.get(), base_);
        const LocalKey scratch_key = local_key(scratch_mr_.get(), scratch_);

        if (world_size_ == 1) return;  // writes to self never reach the provider

        fabric::Packer packer;
        packer.put(static_cast<uint64_t>(region_bytes_));
        packer.put_bytes(ep_name);
        pack_key(packer, region_key);
        pack_key(packer, scratch_key);
        const auto records = gather("bootstrap (exchanging endpoint addresses)", "addr", packer.bytes());

        std::lock_guard lock(mu_);
        for (int peer = 0; peer < world_size_; ++peer) {
            if (peer == rank_) continue;
            fabric::Unpacker in(records[peer], peer);
            const auto peer_region_bytes = in.get<uint64_t>();
            MOERL_CHECK(peer_region_bytes == region_bytes_, name(), ": rank ", peer, " registered ",
                        peer_region_bytes, " bytes, rank ", rank_, " ", region_bytes_,
                        " (regions must be symmetric)");
            const auto peer_name = in.get_bytes();
            Peer& p = peers_[peer];
            p.region = unpack_key(in);
            p.scratch = unpack_key(in);
            const int inserted = fi_av_insert(av_.get(), peer_name.data(), 1, &p.addr, 0, nullptr);
            MOERL_CHECK(inserted == 1, name(), ": fi_av_insert of rank ", peer,
                        "'s address failed: ", inserted < 0 ? fi_strerror(-inserted) : "not inserted");
        }
    }

    // Stops the progress thread and closes everything, endpoint first so that nothing lands in the
    // region while it is being unmapped. Never throws.
    void release() noexcept {
        stop_.store(true, std::memory_order_release);
        if (progress_.joinable()) progress_.join();
        ep_.reset();  // FI_MR_ENDPOINT: a bound MR cannot close before its endpoint
        for (Peer& p : peers_) {
            for (RemoteMemory* m : {&p.region, &p.scratch}) {
                if (m->key_mapped) fi_mr_unmap_key(domain_.get(), m->key);
                m->key_mapped = false;
            }
        }
        mr_.reset();
        scratch_mr_.reset();
        av_.reset();
        cq_.reset();
        domain_.reset();
        fabric_.reset();
        region_mapping_.reset();
        device_memory_.reset();
        scratch_mapping_.reset();
        base_ = nullptr;
        scratch_ = nullptr;
        info_.reset();
    }

    void post_message(int peer, int channel, size_t src_offset, size_t dst_offset, size_t bytes) {
        MOERL_CHECK(!destroyed_, name(), " rank ", rank_, ": write to rank ", peer, " after destroy()");
        check_failed();
        if (peer == rank_) {
            // The provider is not needed to copy within one process.
            copy(base_ + dst_offset, base_ + src_offset, bytes, kWithinRegion);
            signals_[lane_idx(rank_, channel)].fetch_add(1, std::memory_order_release);
            return;
        }
        const bool pure_signal = bytes == 0;
        const size_t num_chunks = pure_signal ? 1 : (bytes + chunk_bytes_ - 1) / chunk_bytes_;
        MOERL_CHECK(num_chunks <= fabric::kMaxChunks, name(), " write: ", bytes, " bytes need ", num_chunks,
                    " chunks of ", chunk_bytes_, " bytes, at most ", fabric::kMaxChunks,
                    " fit in the CQ data");
        const Peer& p = peers_[peer];
        const auto deadline = Clock::now() + timeout_;

        std::unique_lock lock(mu_);
        SendLane& lane = send_lanes_[lane_idx(peer, channel)];
        const auto seq = static_cast<uint32_t>(lane.next_seq % fabric::kSeqWindow);
        // The receiver tells messages apart by seq mod kSeqWindow: reuse a slot only once its previous
        // message has left (all chunks completed locally).
        while (lane.chunks_in_flight[seq] != 0) {
            if (poll_locked() == 0) {
                lock.unlock();
                std::this_thread::yield();
                lock.lock();
            }
            check_failed();
            if (Clock::now() > deadline)
                throw TimeoutError(
                    detail::concat(name(), " rank ", rank_, ": timed out in write waiting for rank ", peer,
                                   " (channel ", channel, ": ", fabric::kSeqWindow,
                                   " earlier messages still in flight)"),
                    __FILE__, __LINE__);
        }
        lane.chunks_in_flight[seq] = static_cast<uint32_t>(num_chunks);
        ++lane.next_seq;
        const uint64_t data = fabric::encode(
            {.src = rank_, .channel = channel, .seq = seq, .num_chunks = static_cast<uint32_t>(num_chunks)});

        for (size_t chunk_idx = 0; chunk_idx < num_chunks; ++chunk_idx) {
            const size_t chunk_offset = chunk_idx * chunk_bytes_;
            const size_t len = pure_signal ? kSignalBytes : std::min(chunk_bytes_, bytes - chunk_offset);
            const std::byte* src =
                pure_signal ? scratch_ + kScratchSrcOffset : base_ + src_offset + chunk_offset;
            void* desc = pure_signal ? scratch_desc_ : region_desc_;
            const RemoteMemory& remote = pure_signal ? p.scratch : p.region;
            const uint64_t remote_addr =
                remote.base + (pure_signal ? kScratchDstOffset : dst_offset + chunk_offset);

            OpContext* op = acquire_write_op_locked(peer, channel, seq);
            ++writes_in_flight_per_peer_[peer];
            writes_in_flight_.fetch_add(1, std::memory_order_acq_rel);
            // A message cut short can never complete at the peer: fail the transport, not only this call.
            const auto abandon = [&](const Error& error) {
                finish_write_locked(op);
                lane.chunks_in_flight[seq] -= static_cast<uint32_t>(num_chunks - chunk_idx - 1);
                record_error(std::make_exception_ptr(error));
            };
            while (true) {
                const ssize_t rc =
                    fi_writedata(ep_.get(), src, len, desc, data, p.addr, remote_addr, remote.key, &op->fi);
                if (rc == 0) break;
                if (rc != -FI_EAGAIN) {
                    Error error(
                        detail::concat(name(), " rank ", rank_, ": fi_writedata to rank ", peer,
                                       " failed: ", fi_strerror(static_cast<int>(-rc)), " (", rc, ")"),
                        __FILE__, __LINE__);
                    abandon(error);
                    throw error;
                }
                // Queues are full: completions free them, and this thread holds the lock.
                poll_locked();
                if (failed_.load(std::memory_order_acquire)) {
                    abandon(Error("fabric: write abandoned after an earlier error", __FILE__, __LINE__));
                    check_failed();
                }
                if (Clock::now() > deadline) {
                    TimeoutError error(
                        detail::concat(name(), " rank ", rank_, ": timed out in write waiting for rank ",
                                       peer, " (the provider kept answering FI_EAGAIN)"),
                        __FILE__, __LINE__);
                    abandon(error);
                    throw error;
                }
            }
        }
        kicked_.store(true, std::memory_order_release);
    }

    OpContext* acquire_write_op_locked(int peer, int channel, uint32_t seq) {
        OpContext* op;
        if (free_ops_.empty()) {
            ops_.push_back(std::make_unique<OpContext>());
            op = ops_.back().get();
        } else {
            op = free_ops_.back();
            free_ops_.pop_back();
        }
        op->kind = OpKind::kWrite;
        op->peer = peer;
        op->channel = channel;
        op->seq = seq;
        return op;
    }

    void finish_write_locked(OpContext* op) {
        --send_lanes_[lane_idx(op->peer, op->channel)].chunks_in_flight[op->seq];
        --writes_in_flight_per_peer_[op->peer];
        writes_in_flight_.fetch_sub(1, std::memory_order_acq_rel);
        free_ops_.push_back(op);
    }

    void post_recv_locked(OpContext* op) {
        const ssize_t rc = fi_recv(ep_.get(), scratch_ + kScratchRecvOffset, kRecvBytes, scratch_desc_,
                                   FI_ADDR_UNSPEC, &op->fi);
        if (rc == -FI_EAGAIN) {
            recvs_to_post_.push_back(op);  // retried after the next completions
            return;
        }
        MOERL_FI_CHECK(rc, "fi_recv");
    }

    // Reads one batch of completions; returns how many it handled, or -1 after an error. Errors are
    // recorded (the next call into the transport rethrows them), never thrown: an entry left
    // unhandled would leave quiet() waiting for a completion that was already read.
    int poll_locked() noexcept {
        fi_cq_data_entry entries[kCqBatch];
        const ssize_t n = fi_cq_read(cq_.get(), entries, kCqBatch);
        int num_handled = n > 0 ? static_cast<int>(n) : 0;
        try {
            if (n == -FI_EAVAIL) {
                handle_cq_error_locked();
                return 1;
            }
            if (n != -FI_EAGAIN) MOERL_FI_CHECK(n, "fi_cq_read");
        } catch (...) {
            record_error(std::current_exception());
            return -1;
        }
        for (ssize_t i = 0; i < n; ++i) {
            try {
                handle_completion_locked(entries[i]);
            } catch (...) {
                record_error(std::current_exception());
                num_handled = -1;
            }
        }
        try {
            if (!recvs_to_post_.empty()) {
                auto pending = std::move(recvs_to_post_);
                recvs_to_post_.clear();
                for (OpContext* op : pending) post_recv_locked(op);
            }
        } catch (...) {
            record_error(std::current_exception());
            num_handled = -1;
        }
        return num_handled;
    }

    void handle_completion_locked(const fi_cq_data_entry& entry) {
        auto* op = static_cast<OpContext*>(entry.op_context);
        // Our own write's context marks a local completion, whatever the flags say: the sockets
        // provider also sets FI_REMOTE_CQ_DATA on them.
        if (op != nullptr && op->kind == OpKind::kWrite) {
            finish_write_locked(op);
            return;
        }
        if (entry.flags & FI_REMOTE_CQ_DATA) {
            const fabric::SignalCode code = fabric::decode(entry.data);
            MOERL_CHECK(
                code.src >= 0 && code.src < world_size_ && code.src != rank_ && code.channel < kNumChannels,
                name(), " rank ", rank_, ": remote CQ data 0x", std::hex, entry.data,
                " names no valid (source, channel)");
            const size_t idx = lane_idx(code.src, code.channel);
            const uint32_t num_done = recv_lanes_[idx].on_chunk(code.seq, code.num_chunks);
            // Release: the data of the message is visible before its signal.
            if (num_done > 0) signals_[idx].fetch_add(num_done, std::memory_order_release);
        }
        // With FI_RX_CQ_DATA a remote write consumed one of our receives (otherwise op is null); a
        // receive completing for any other reason (nobody sends messages) is reposted as well.
        if (op != nullptr && op->kind == OpKind::kRecv) post_recv_locked(op);
    }

    void handle_cq_error_locked() {
        fi_cq_err_entry err{};
        const ssize_t rc = fi_cq_readerr(cq_.get(), &err, 0);
        if (rc == -FI_EAGAIN) return;
        MOERL_FI_CHECK(rc, "fi_cq_readerr");
        auto* op = static_cast<OpContext*>(err.op_context);
        if (op != nullptr && op->kind == OpKind::kRecv && err.err == FI_ECANCELED)
            return;  // endpoint closing
        char provider_text[256] = {0};
        const char* provider_detail =
            fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, provider_text, sizeof(provider_text));
        std::string what;
        if (op != nullptr && op->kind == OpKind::kWrite) {
            what = detail::concat("write to rank ", op->peer, " (channel ", op->channel, ")");
            finish_write_locked(op);  // so that quiet() reports the error instead of waiting for it
        } else if (op != nullptr) {
            what = "a posted receive";
        } else {
            what = "a remote write";
        }
        record_error(std::make_exception_ptr(
            Error(detail::concat(name(), " rank ", rank_, ": ", what, " failed: ", fi_strerror(err.err),
                                 " (provider: ", provider_detail != nullptr ? provider_detail : "?",
                                 ", prov_errno ", err.prov_errno, ")"),
                  __FILE__, __LINE__)));
    }

    void progress_loop() {
        for (int idle = 0; !stop_.load(std::memory_order_acquire);) {
            int num_handled = 0;
            {
                std::lock_guard lock(mu_);
                num_handled = poll_locked();
            }
            if (num_handled < 0) {
                // Recorded already; a persistent error must not spin this thread.
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            } else if (num_handled > 0 || kicked_.exchange(false, std::memory_order_acq_rel)) {
                idle = 0;
            } else {
                backoff(idle);
            }
        }
    }

    const int rank_;
    const int world_size_;
    const size_t region_bytes_;
    const std::string provider_;
    const RegionMemory memory_;
    const int device_;
    const std::string job_id_;
    const Clock::duration timeout_;
    Store* const store_;

    Info info_;
    uint64_t mr_mode_ = 0;
    bool rx_cq_data_ = false;
    // Largest single write (options.fabric_chunk_bytes, at most the provider's max_msg_size): larger
    // ones are split so that one message never exceeds the provider's limit or monopolises the endpoint.
    size_t chunk_bytes_ = 0;
    Fid<fid_fabric> fabric_;
    Fid<fid_domain> domain_;
    Fid<fid_cq> cq_;
    Fid<fid_av> av_;
    Fid<fid_ep> ep_;
    Fid<fid_mr> mr_;              // the region
    Fid<fid_mr> scratch_mr_;      // the signal scratch
    Mapping region_mapping_;      // the region in host memory (kHost, kHostAsDevice)
    DeviceMemory device_memory_;  // the region in device memory (kCuda)
    Mapping scratch_mapping_;
    std::byte* base_ = nullptr;  // the region
    std::byte* scratch_ = nullptr;
    void* region_desc_ = nullptr;  // fi_mr_desc when FI_MR_LOCAL, else null
    void* scratch_desc_ = nullptr;
    std::vector<Peer> peers_;

    // Guards every libfabric call on the domain's objects after construction (FI_THREAD_DOMAIN), and
    // the lanes, op pool and per-peer counts below. Completions are handled with it held.
    std::mutex mu_;
    std::vector<SendLane> send_lanes_;                // GUARDED_BY(mu_), [peer * kNumChannels + channel]
    std::vector<fabric::ReceiveLane> recv_lanes_;     // GUARDED_BY(mu_), [src * kNumChannels + channel]
    std::vector<int64_t> writes_in_flight_per_peer_;  // GUARDED_BY(mu_)
    std::vector<std::unique_ptr<OpContext>> ops_;     // GUARDED_BY(mu_), stable addresses
    std::vector<OpContext*> free_ops_;                // GUARDED_BY(mu_)
    std::vector<OpContext*> recvs_to_post_;           // GUARDED_BY(mu_), receives refused with FI_EAGAIN

    std::unique_ptr<std::atomic<uint64_t>[]> signals_;  // [src * kNumChannels + channel]
    std::atomic<int64_t> writes_in_flight_{0};
    std::atomic<bool> kicked_{false};  // a write was posted: the progress thread should not sleep
    std::atomic<bool> stop_{false};
    std::atomic<bool> failed_{false};
    std::mutex error_mu_;
    std::exception_ptr error_;  // GUARDED_BY(error_mu_), the first error seen
    bool destroyed_ = false;
    std::thread progress_;
};

}  // namespace

std::unique_ptr<Transport> make_fabric_transport(const TransportOptions& options) {
    return std::make_unique<FabricTransport>(options);
}

}  // namespace moerl::ep
