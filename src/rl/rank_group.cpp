#include "rank_group.hpp"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "gloo_group.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/process.hpp"

#if MOERL_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

#include "moerl/core/log.hpp"

namespace moerl::rl::detail {

namespace {

class ThreadRanks final : public RankGroup {
  public:
    explicit ThreadRanks(int world_size) : slots_(world_size), barrier_(world_size) {}

    void sum(int local, at::Tensor& t) override {
        if (slots_.size() == 1) return;
        slots_[local] = t;
        barrier_.arrive_and_wait();
        at::Tensor total = slots_[0].clone();
        for (size_t q = 1; q < slots_.size(); ++q) total.add_(slots_[q]);
        barrier_.arrive_and_wait();  // every rank has read the slots
        t = total;
    }
    void barrier(int) override {
        if (slots_.size() > 1) barrier_.arrive_and_wait();
    }
    void broadcast(std::string&) override {}
    std::vector<std::string> gather(const std::string& mine) override { return {mine}; }
    void send_call(std::string) override {}
    std::string receive_call() override { MOERL_FAIL("threads of one process take no calls from rank 0"); }

  private:
    std::vector<at::Tensor> slots_;
    std::barrier<> barrier_;
};

std::vector<uint8_t> to_bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    return {b, b + n};
}

// What every process-group flavour shares: each rank leaves its host and pid in the store when it
// joins, so that a failed collective can say which rank on this machine is gone.
class ProcessRanksBase : public RankGroup {
  protected:
    ProcessRanksBase(const RoleProcesses& p, const std::string& role)
        : rank_(p.rank), world_(p.world_size), timeout_s_(p.timeout_s), store_(p.store), role_(role) {
        MOERL_CHECK(store_, role_, " processes: no rendezvous store");
        const std::string me = host_name() + " " + std::to_string(::getpid());
        store_->set(whereabouts_key(rank_), to_bytes(me.data(), me.size()));
    }

  public:
    void send_call(std::string bytes) override {
        const int64_t n = calls_++;
        store_->set(call_key(n), std::vector<uint8_t>{1});
        broadcast(bytes);
        // Every rank waited for key n - 1 before joining the previous call's broadcast.
        if (n > 0) store_->deleteKey(call_key(n - 1));
    }
    std::string receive_call() override {
        const std::string key = call_key(calls_++);
        for (;;) {
            try {
                store_->wait({key}, std::chrono::seconds(30));
                break;
            } catch (const std::exception& e) {
                bool store_answers = false;
                try {
                    store_->check({key});
                    store_answers = true;
                } catch (const std::exception&) {
                }
                MOERL_CHECK(
                    store_answers, role_, " rank ", rank_, " of ", world_,
                    ": the rendezvous store went away while waiting for rank 0's next call: ", e.what());
            }
        }
        std::string bytes;
        broadcast(bytes);
        return bytes;
    }

  protected:
    const char* broadcast_phase() const {
        return rank_ == 0 ? "sending rank 0's call to the other ranks" : "receiving rank 0's call";
    }

    template <class Fn>
    void guarded(const char* what, Fn fn) {
        try {
            fn();
        } catch (const std::exception& e) {
            MOERL_FAIL(role_, " rank ", rank_, " of ", world_, ": ", what, " failed: ", missing_ranks(), " (",
                       e.what(), ")");
        }
    }

    int rank_, world_;
    double timeout_s_;
    c10::intrusive_ptr<c10d::Store> store_;
    const std::string role_;

    std::string prefixed(const std::string& what) const { return role_ + "-" + what; }

  private:
    int64_t calls_ = 0;
    std::string call_key(int64_t n) const { return prefixed("call/" + std::to_string(n)); }
    std::string whereabouts_key(int rank) const { return prefixed("rank/" + std::to_string(rank)); }
    static std::string host_name() {
        char name[256] = {};
        ::gethostname(name, sizeof(name) - 1);
        return name;
    }

  protected:
    // The ranks of this machine whose process has exited ("rank 1 (pid N) has exited"), looked
    // for `looks` times 50 ms apart; empty when none.
    std::string exited_ranks(int looks) const {
        std::string gone;
        try {
            const std::string here = host_name();
            std::vector<std::pair<int, pid_t>> local;
            for (int q = 0; q < world_; ++q) {
                if (q == rank_ || !store_->check({whereabouts_key(q)})) continue;
                const std::vector<uint8_t> v = store_->get(whereabouts_key(q));
                const std::string text(v.begin(), v.end());
                const size_t space = text.rfind(' ');
                if (space == std::string::npos || text.substr(0, space) != here) continue;
                local.emplace_back(q, static_cast<pid_t>(std::atol(text.c_str() + space + 1)));
            }
            for (int look = 0; look < looks && gone.empty(); ++look) {
                if (look > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
                for (const auto& [q, pid] : local)
                    if (!process_alive(pid))
                        gone += (gone.empty() ? "" : ", ") + ("rank " + std::to_string(q) + " (pid " +
                                                              std::to_string(pid) + ") has exited");
            }
        } catch (const std::exception&) {
            return "the rendezvous store does not answer either: rank 0 or the launcher is gone";
        }
        return gone;
    }

    std::string missing_ranks() const {
        // A killed rank closes its sockets a moment before it leaves the process table.
        const std::string gone = exited_ranks(5);
        if (!gone.empty()) return gone;
        std::ostringstream os;
        os << "a rank on another machine died, or did not answer within " << timeout_s_ << " s";
        return os.str();
    }
};

// Through the rendezvous store itself: every rank posts its part, every rank reads all parts and
// adds them in rank order. Where LibTorch lacks Gloo's headers (PyTorch's wheels); the bytes go
// through the store's server, so it is for small groups and small models.
class StoreRanks final : public ProcessRanksBase {
  public:
    StoreRanks(const RoleProcesses& p, const std::string& role) : ProcessRanksBase(p, role) {}

    void sum(int, at::Tensor& t) override {
        const int64_t n = ops_++;
        const at::Tensor mine = t.to(at::kCPU).contiguous();
        at::Tensor total;
        guarded("summing gradients", [&] {
            put(key("sum", n, rank_), mine.data_ptr(), mine.nbytes());
            for (int q = 0; q < world_; ++q) {
                at::Tensor part = mine;
                if (q != rank_) {
                    const std::vector<uint8_t> v = take(key("sum", n, q));
                    MOERL_CHECK(v.size() == mine.nbytes(), "rank ", q, " sent ", v.size(),
                                " bytes, expected ", mine.nbytes());
                    part = at::empty_like(mine);
                    std::memcpy(part.data_ptr(), v.data(), v.size());
                }
                total = q == 0 ? part.clone() : total.add_(part);
            }
        });
        done(n);
        if (t.is_cpu()) {
            t = total;
        } else {
            t.copy_(total);
        }
    }
    void barrier(int) override {
        const int64_t n = ops_++;
        guarded("a barrier", [&] {
            const std::string k = key("barrier", n, 0);
            if (store_->add(k, 1) == world_) store_->set(k + "/all", std::vector<uint8_t>{1});
            read(k + "/all");
        });
        done(n);
    }
    void broadcast(std::string& bytes) override {
        const int64_t n = ops_++;
        guarded(broadcast_phase(), [&] {
            if (rank_ == 0) {
                put(key("call", n, 0), bytes.data(), bytes.size());
            } else {
                const std::vector<uint8_t> v = take(key("call", n, 0));
                bytes.assign(v.begin(), v.end());
            }
        });
        done(n);
    }
    std::vector<std::string> gather(const std::string& mine) override {
        const int64_t n = ops_++;
        std::vector<std::string> all;
        guarded("gathering on rank 0", [&] {
            if (rank_ != 0) {
                put(key("gather", n, rank_), mine.data(), mine.size());
                read(key("gather", n, 0));  // rank 0 has read every part
                return;
            }
            all.push_back(mine);
            for (int q = 1; q < world_; ++q) {
                const std::vector<uint8_t> v = take(key("gather", n, q));
                all.emplace_back(v.begin(), v.end());
            }
            put(key("gather", n, 0), nullptr, 0);
        });
        done(n);
        return all;
    }

  private:
    std::string key(const char* what, int64_t n, int rank) const {
        return prefixed(std::string("store/") + what + "/" + std::to_string(n) + "/" + std::to_string(rank));
    }
    // Waits for key k in slices, failing at once when a rank of this machine has exited.
    std::vector<uint8_t> read(const std::string& k) {
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
        while (!store_->check({k})) {
            const std::string gone = exited_ranks(1);
            MOERL_CHECK(gone.empty(), gone);
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            if (left.count() <= 0) {
                store_->wait({k}, std::chrono::milliseconds(1));  // throws, naming the key
                break;
            }
            try {
                store_->wait({k}, std::min(left, std::chrono::milliseconds(500)));
            } catch (const std::exception&) {  // a slice without it
            }
        }
        return store_->get(k);
    }
    // The store's server refuses values over 8 MiB (c10d's libuv backend), and a gradient sum at a
    // real model's size is gigabytes: a value goes as numbered parts of at most 4 MiB, then the key
    // itself with their count, so a reader that sees the key finds every part.
    static constexpr size_t kPartBytes = size_t{4} << 20;
    void put(const std::string& k, const void* data, size_t size) {
        const uint64_t parts = (size + kPartBytes - 1) / kPartBytes;
        for (uint64_t i = 0; i < parts; ++i) {
            const size_t offset = i * kPartBytes;
            store_->set(k + "/" + std::to_string(i), to_bytes(static_cast<const char*>(data) + offset,
                                                              std::min(kPartBytes, size - offset)));
        }
        store_->set(k, to_bytes(&parts, sizeof parts));
    }
    uint64_t parts_of(const std::vector<uint8_t>& count, const std::string& k) const {
        uint64_t parts = 0;
        MOERL_CHECK(count.size() == sizeof parts, "the rendezvous store's key ", k, " holds ", count.size(),
                    " bytes, expected a part count");
        std::memcpy(&parts, count.data(), sizeof parts);
        return parts;
    }
    // Waits for a value put() wrote and reads it whole.
    std::vector<uint8_t> take(const std::string& k) {
        const uint64_t parts = parts_of(read(k), k);
        std::vector<uint8_t> out;
        for (uint64_t i = 0; i < parts; ++i) {
            const std::vector<uint8_t> v = store_->get(k + "/" + std::to_string(i));
            out.insert(out.end(), v.begin(), v.end());
        }
        return out;
    }
    void erase(const std::string& k) {
        if (!store_->check({k})) return;
        const uint64_t parts = parts_of(store_->get(k), k);
        for (uint64_t i = 0; i < parts; ++i) store_->deleteKey(k + "/" + std::to_string(i));
        store_->deleteKey(k);
    }
    // Every rank counts the operations it finished; rank 0 removes an operation's keys once every
    // rank has counted it (a rank may still be reading a broadcast when rank 0 has moved on).
    void done(int64_t n) {
        store_->add(finished_key(n), 1);
        if (rank_ != 0) return;
        pending_.push_back(n);
        while (!pending_.empty() && store_->add(finished_key(pending_.front()), 0) == world_) {
            const int64_t p = pending_.front();
            pending_.erase(pending_.begin());
            for (int q = 0; q < world_; ++q) {
                erase(key("sum", p, q));
                erase(key("gather", p, q));
            }
            erase(key("call", p, 0));
            store_->deleteKey(key("barrier", p, 0));
            store_->deleteKey(key("barrier", p, 0) + "/all");
            store_->deleteKey(finished_key(p));
        }
    }
    std::string finished_key(int64_t n) const { return prefixed("store/finished/" + std::to_string(n)); }
    std::vector<int64_t> pending_;  // rank 0: operations whose keys are still in the store
    int64_t ops_ = 0;
};

#ifdef MOERL_HAVE_GLOO
// c10d's Gloo process group: ring all-reduce over TCP between the ranks.
class GlooRanks final : public ProcessRanksBase {
  public:
    GlooRanks(const RoleProcesses& p, const std::string& role) : ProcessRanksBase(p, role) {
        guarded("joining the other processes", [&] {
            auto store = c10::make_intrusive<c10d::PrefixStore>(prefixed("gloo"), p.store);
            group_ = make_gloo_group(store, rank_, world_, p.master_addr, p.timeout_s);
        });
    }

    void sum(int, at::Tensor& t) override {
        // Gloo reduces host memory: a device tensor goes through a host copy.
        std::vector<at::Tensor> v{t.is_cpu() ? t.contiguous() : t.to(at::kCPU)};
        guarded("summing gradients", [&] { group_->allreduce(v)->wait(); });
        if (!t.is_cpu()) {
            t.copy_(v[0]);
        } else if (v[0].data_ptr() != t.data_ptr()) {
            t = v[0];
        }
    }
    void barrier(int) override {
        guarded("a barrier", [&] { group_->barrier()->wait(); });
    }
    void broadcast(std::string& bytes) override {
        std::vector<at::Tensor> size{at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong)};
        guarded(broadcast_phase(), [&] { group_->broadcast(size)->wait(); });
        const int64_t n = size[0].item<int64_t>();
        std::vector<at::Tensor> data{at::empty({std::max<int64_t>(n, 1)}, at::kByte)};
        if (rank_ == 0) std::memcpy(data[0].data_ptr(), bytes.data(), bytes.size());
        guarded(broadcast_phase(), [&] { group_->broadcast(data)->wait(); });
        if (rank_ != 0) bytes.assign(static_cast<const char*>(data[0].data_ptr()), static_cast<size_t>(n));
    }
    std::vector<std::string> gather(const std::string& mine) override {
        std::vector<std::string> all;
        guarded("gathering on rank 0", [&] {
            if (rank_ != 0) {
                std::vector<at::Tensor> size{at::full({1}, static_cast<int64_t>(mine.size()), at::kLong)};
                group_->send(size, 0, 1)->wait();
                std::vector<at::Tensor> data{
                    at::empty({std::max<int64_t>(1, size[0].item<int64_t>())}, at::kByte)};
                std::memcpy(data[0].data_ptr(), mine.data(), mine.size());
                group_->send(data, 0, 2)->wait();
                return;
            }
            all.push_back(mine);
            for (int q = 1; q < world_; ++q) {
                std::vector<at::Tensor> size{at::empty({1}, at::kLong)};
                group_->recv(size, q, 1)->wait();
                const int64_t n = size[0].item<int64_t>();
                std::vector<at::Tensor> data{at::empty({std::max<int64_t>(1, n)}, at::kByte)};
                group_->recv(data, q, 2)->wait();
                all.emplace_back(static_cast<const char*>(data[0].data_ptr()), static_cast<size_t>(n));
            }
        });
        return all;
    }

  private:
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};
#endif

#if MOERL_HAVE_NCCL
// Sums of CUDA tensors through NCCL, on the GPU and without host copies (one GPU a rank); the rest
// (host tensors, barriers, broadcasts, gathers, calls) through `inner`. NCCL refuses two ranks on
// one GPU, so where ranks share one (tests, a small machine) the sums stay with `inner`, said once.
// The communicator is non-blocking: a rank that dies mid-sum is reported after timeout_s, naming
// it, instead of hanging every other rank.
class NcclSums final : public ProcessRanksBase {
  public:
    NcclSums(const RoleProcesses& p, const std::string& role, std::unique_ptr<RankGroup> inner, bool required)
        : ProcessRanksBase(p, role), inner_(std::move(inner)), required_(required) {}
    ~NcclSums() override {
        if (comm_ != nullptr) ncclCommDestroy(comm_);
    }

    void sum(int local, at::Tensor& t) override {
        if (!t.is_cuda() || world_ == 1) return inner_->sum(local, t);
        MOERL_CHECK(broken_.empty(), role_, " rank ", rank_, ": the NCCL communicator was aborted after ",
                    broken_);
        if (!opened_) open(t.device().index());
        if (comm_ == nullptr) return inner_->sum(local, t);
        const ncclDataType_t type = t.scalar_type() == at::kFloat    ? ncclFloat32
                                    : t.scalar_type() == at::kDouble ? ncclFloat64
                                                                     : ncclNumTypes;
        MOERL_CHECK(type != ncclNumTypes, role_, " rank ", rank_, ": NCCL sums take fp32 or fp64, got ",
                    c10::toString(t.scalar_type()));
        at::Tensor dense = t.contiguous();
        // The legacy default stream: LibTorch's default stream, where the gradients were computed.
        check(ncclAllReduce(dense.data_ptr(), dense.data_ptr(), static_cast<size_t>(dense.numel()), type,
                            ncclSum, comm_, nullptr),
              "ncclAllReduce");
        finish("summing gradients over NCCL");
        if (dense.data_ptr() != t.data_ptr()) t.copy_(dense);
    }
    void barrier(int local) override { inner_->barrier(local); }
    void broadcast(std::string& bytes) override { inner_->broadcast(bytes); }
    std::vector<std::string> gather(const std::string& mine) override { return inner_->gather(mine); }
    void send_call(std::string bytes) override { inner_->send_call(std::move(bytes)); }
    std::string receive_call() override { return inner_->receive_call(); }

  private:
    // A failed NCCL call aborts the communicator (a later sum fails at once rather than falling back
    // to the host path or waiting on a broken one) and throws naming the call.
    void check(ncclResult_t rc, const char* what) {
        if (rc == ncclSuccess || rc == ncclInProgress) return;
        const char* last = ncclGetLastError(comm_);
        const std::string said = last != nullptr && *last ? std::string(" (") + last + ")" : std::string();
        abort_communicator(moerl::detail::concat(what, " failed: ", ncclGetErrorString(rc), said));
        MOERL_FAIL(role_, " rank ", rank_, " of ", world_, ": ", broken_);
    }
    void abort_communicator(const std::string& why) {
        if (comm_ != nullptr) ncclCommAbort(comm_);
        comm_ = nullptr;
        broken_ = why;
    }

    // Waits for the communicator's pending work and the default stream, up to timeout_s.
    void finish(const char* what) {
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
        for (int spins = 0;; ++spins) {
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(comm_, &async);
            if (async != ncclSuccess && async != ncclInProgress) check(async, what);
            if (async == ncclSuccess) {
                const cudaError_t q = cudaStreamQuery(nullptr);
                if (q == cudaSuccess) return;
                MOERL_CHECK(q == cudaErrorNotReady, role_, " rank ", rank_, ": ", what,
                            " failed on the GPU: ", cudaGetErrorString(q));
            }
            if (std::chrono::steady_clock::now() > deadline) {
                abort_communicator(moerl::detail::concat(what, " did not finish within ", timeout_s_, " s"));
                MOERL_FAIL(role_, " rank ", rank_, " of ", world_, ": ", broken_, ": ", missing_ranks());
            }
            if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

    // Each rank's GPU (by UUID) through the store; NCCL only when no two ranks share one.
    void open(int device) {
        opened_ = true;
        cudaDeviceProp prop{};
        MOERL_CHECK(cudaGetDeviceProperties(&prop, device) == cudaSuccess, role_, " rank ", rank_,
                    ": cannot read the properties of CUDA device ", device);
        const std::string uuid(prop.uuid.bytes, sizeof(prop.uuid.bytes));
        store_->set(prefixed("nccl/gpu/" + std::to_string(rank_)), to_bytes(uuid.data(), uuid.size()));
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
        std::vector<std::string> gpus(world_);
        guarded("exchanging GPU ids for NCCL", [&] {
            for (int q = 0; q < world_; ++q) {
                const std::string key = prefixed("nccl/gpu/" + std::to_string(q));
                store_->wait({key}, timeout);
                const std::vector<uint8_t> v = store_->get(key);
                gpus[q].assign(v.begin(), v.end());
            }
        });
        for (int q = 0; q < world_; ++q)
            for (int r = q + 1; r < world_; ++r)
                if (gpus[q] == gpus[r]) {
                    MOERL_CHECK(!required_, role_, " processes: collectives 'nccl', but ranks ", q, " and ",
                                r, " share one GPU (NCCL needs a GPU a rank; use auto)");
                    if (rank_ == 0)
                        log_line(moerl::detail::concat(
                            role_, " processes: ranks ", q, " and ", r,
                            " share one GPU, so gradient sums go through the host, not NCCL"));
                    return;
                }
        ncclUniqueId id{};
        const std::string id_key = prefixed("nccl/id");
        if (rank_ == 0) {
            check(ncclGetUniqueId(&id), "ncclGetUniqueId");
            store_->set(id_key, to_bytes(&id, sizeof(id)));
        }
        guarded("receiving rank 0's NCCL id", [&] {
            store_->wait({id_key}, timeout);
            const std::vector<uint8_t> v = store_->get(id_key);
            MOERL_CHECK(v.size() == sizeof(id), "the NCCL id has ", v.size(), " bytes");
            std::memcpy(&id, v.data(), sizeof(id));
        });
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        check(ncclCommInitRankConfig(&comm_, world_, id, rank_, &config), "ncclCommInitRankConfig");
        finish("joining the NCCL communicator");
    }

    std::unique_ptr<RankGroup> inner_;
    const bool required_;
    bool opened_ = false;
    ncclComm_t comm_ = nullptr;
    std::string broken_;  // why the communicator was aborted; empty while it works
};
#endif

}  // namespace

std::unique_ptr<RankGroup> make_thread_group(int world_size) {
    return std::make_unique<ThreadRanks>(world_size);
}

std::unique_ptr<RankGroup> make_process_group(const RoleProcesses& p, const std::string& role) {
    MOERL_CHECK(p.collectives == "auto" || p.collectives == "gloo" || p.collectives == "store" ||
                    p.collectives == "nccl",
                role, " processes: collectives '", p.collectives, "'; expected auto, nccl, gloo or store");
    std::unique_ptr<RankGroup> host;
    if (p.collectives == "store") {
        host = std::make_unique<StoreRanks>(p, role);
    } else {
#ifdef MOERL_HAVE_GLOO
        host = std::make_unique<GlooRanks>(p, role);
#else
        MOERL_CHECK(p.collectives != "gloo", role,
                    " processes: collectives 'gloo', but this LibTorch has no Gloo headers");
        host = std::make_unique<StoreRanks>(p, role);
#endif
    }
#if MOERL_HAVE_NCCL
    if (p.collectives == "auto" || p.collectives == "nccl")
        return std::make_unique<NcclSums>(p, role, std::move(host), p.collectives == "nccl");
#else
    MOERL_CHECK(p.collectives != "nccl", role, " processes: collectives 'nccl', but this build has no NCCL");
#endif
    return host;
}

#ifdef MOERL_HAVE_GLOO
namespace {
bool is_loopback(const std::string& addr) {
    return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}
}  // namespace

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                           int rank, int world, const std::string& addr,
                                                           double timeout_s) {
    auto options = c10d::ProcessGroupGloo::Options::create(
        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifname && *ifname) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (is_loopback(addr)) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
}
#endif

}  // namespace moerl::rl::detail
