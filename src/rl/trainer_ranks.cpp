#include "trainer_ranks.hpp"

#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <barrier>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "moerl/core/error.hpp"

#ifdef MOERL_HAVE_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace moerl::rl::detail {

namespace {

class ThreadRanks final : public TrainerRanks {
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

  private:
    std::vector<at::Tensor> slots_;
    std::barrier<> barrier_;
};

#ifdef MOERL_HAVE_GLOO
bool is_loopback(const std::string& addr) {
    return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

class ProcessRanks final : public TrainerRanks {
  public:
    explicit ProcessRanks(const TrainerProcesses& p)
        : rank_(p.rank), world_(p.world_size), timeout_s_(p.timeout_s) {
        MOERL_CHECK(p.store, "trainer processes: no rendezvous store");
        auto options = c10d::ProcessGroupGloo::Options::create(
            std::chrono::milliseconds(static_cast<int64_t>(p.timeout_s * 1000)));
        const char* master = std::getenv("MASTER_ADDR");
        const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
        try {
            if (ifname && *ifname) {
                options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
            } else if (!master || is_loopback(master)) {
                options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
            } else {
                options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
            }
            store_ = p.store;
            store_->set(whereabouts_key(rank_), to_bytes(host_name() + " " + std::to_string(::getpid())));
            auto store = c10::make_intrusive<c10d::PrefixStore>("trainer-gloo", p.store);
            group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank_, world_, options);
        } catch (const std::exception& e) {
            MOERL_FAIL("trainer rank ", rank_, " of ", world_,
                       ": cannot join the trainer's processes: ", e.what());
        }
    }

    void sum(int, at::Tensor& t) override {
        // Gloo reduces host memory: a device tensor goes through a host copy.
        std::vector<at::Tensor> v{t.is_cpu() ? t.contiguous() : t.to(at::kCPU)};
        run("summing gradients", [&] { return group_->allreduce(v); });
        if (!t.is_cpu()) {
            t.copy_(v[0]);
        } else if (v[0].data_ptr() != t.data_ptr()) {
            t = v[0];
        }
    }
    void barrier(int) override {
        run("a barrier", [&] { return group_->barrier(); });
    }
    void broadcast(std::string& bytes) override {
        std::vector<at::Tensor> size{at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong)};
        const char* what =
            rank_ == 0 ? "sending rank 0's call to the other ranks" : "receiving rank 0's call";
        run(what, [&] { return group_->broadcast(size); });
        const int64_t n = size[0].item<int64_t>();
        std::vector<at::Tensor> data{at::empty({std::max<int64_t>(n, 1)}, at::kByte)};
        if (rank_ == 0) std::memcpy(data[0].data_ptr(), bytes.data(), bytes.size());
        run(what, [&] { return group_->broadcast(data); });
        if (rank_ != 0) bytes.assign(static_cast<const char*>(data[0].data_ptr()), static_cast<size_t>(n));
    }

  private:
    template <class Start>
    void run(const char* what, Start start) {
        try {
            start()->wait();
        } catch (const std::exception& e) {
            MOERL_FAIL("trainer rank ", rank_, " of ", world_, ": ", what, " failed: ", missing_ranks(), " (",
                       e.what(), ")");
        }
    }

    static std::string whereabouts_key(int rank) { return "trainer-rank/" + std::to_string(rank); }
    static std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }
    static std::string host_name() {
        char name[256] = {};
        ::gethostname(name, sizeof(name) - 1);
        return name;
    }

    // A process that exited and was not reaped yet (a zombie) counts as gone.
    static bool alive(pid_t pid) {
        if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
        std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
        std::string line;
        if (!std::getline(stat, line)) return true;
        const size_t paren = line.rfind(')');
        return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
    }

    // Which ranks are gone, as far as this machine can tell: every rank left its host and pid in
    // the store when it joined.
    std::string missing_ranks() const {
        std::string gone;
        try {
            const std::string here = host_name();
            for (int q = 0; q < world_; ++q) {
                if (q == rank_ || !store_->check({whereabouts_key(q)})) continue;
                const std::vector<uint8_t> v = store_->get(whereabouts_key(q));
                const std::string text(v.begin(), v.end());
                const size_t space = text.rfind(' ');
                if (space == std::string::npos || text.substr(0, space) != here) continue;
                const pid_t pid = static_cast<pid_t>(std::atol(text.c_str() + space + 1));
                if (!alive(pid))
                    gone += (gone.empty() ? "" : ", ") +
                            ("rank " + std::to_string(q) + " (pid " + std::to_string(pid) + ") has exited");
            }
        } catch (const std::exception&) {
            return "the rendezvous store does not answer either: rank 0 or the launcher is gone";
        }
        if (!gone.empty()) return gone;
        std::ostringstream os;
        os << "a rank on another machine died, or did not answer within " << timeout_s_ << " s";
        return os.str();
    }

    int rank_, world_;
    double timeout_s_;
    c10::intrusive_ptr<c10d::Store> store_;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};
#endif

}  // namespace

std::unique_ptr<TrainerRanks> make_thread_ranks(int world_size) {
    return std::make_unique<ThreadRanks>(world_size);
}

std::unique_ptr<TrainerRanks> make_process_ranks(const TrainerProcesses& p) {
#ifdef MOERL_HAVE_GLOO
    return std::make_unique<ProcessRanks>(p);
#else
    MOERL_FAIL("the trainer over ", p.world_size,
               " processes needs LibTorch with c10d's Gloo, which this build lacks");
#endif
}

}  // namespace moerl::rl::detail
