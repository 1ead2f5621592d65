#include "policy_broadcast.hpp"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>

#include "gloo_group.hpp"
#include "moerl/core/error.hpp"

#if MOERL_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace moerl::rl::detail {

namespace {
using Clock = std::chrono::steady_clock;
constexpr const char* kUriPrefix = "broadcast://";

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string text_of(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }
std::chrono::milliseconds millis(double s) {
    return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

std::string gen_key(const char* what, int64_t gen) { return std::string(what) + "/" + std::to_string(gen); }

// The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory: Gloo and NCCL then
// move every dtype alike (Gloo has no bf16 in older LibTorch builds).
at::Tensor byte_view(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

// One generation's group, broadcasting from rank 0 (the trainer).
class Channel {
  public:
    virtual ~Channel() = default;
    virtual void broadcast(const at::Tensor& t) = 0;  // contiguous
};

#ifdef MOERL_HAVE_GLOO
// Host memory over TCP; CUDA tensors through a host copy.
class GlooChannel final : public Channel {
  public:
    GlooChannel(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, const std::string& addr,
                double timeout_s)
        : group_(make_gloo_group(store, rank, world, addr, timeout_s)) {}
    void broadcast(const at::Tensor& t) override {
        at::Tensor host = t.is_cpu() ? byte_view(t) : byte_view(t).to(at::kCPU);
        std::vector<at::Tensor> v{host};
        c10d::BroadcastOptions o;
        o.rootRank = 0;
        group_->broadcast(v, o)->wait();
        if (!t.is_cpu()) byte_view(t).copy_(host);
    }

  private:
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};
#endif

#if MOERL_HAVE_NCCL
// CUDA memory on both sides, one GPU a process. The communicator is non-blocking, so a member that
// dies is an error after timeout_s instead of a hang; closing it aborts what is in flight, which
// makes the other members' broadcasts fail at once.
class NcclChannel final : public Channel {
  public:
    NcclChannel(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int device,
                double timeout_s)
        : timeout_s_(timeout_s) {
        ncclUniqueId id{};
        if (rank == 0) {
            check(ncclGetUniqueId(&id), "ncclGetUniqueId");
            store->set("nccl-id", to_vector(id));
        } else {
            const std::vector<uint8_t> b = store->get("nccl-id");
            MOERL_CHECK(b.size() == sizeof id, "policy broadcast: a malformed NCCL id in the store");
            std::memcpy(&id, b.data(), sizeof id);
        }
        MOERL_CHECK(cudaSetDevice(device) == cudaSuccess, "policy broadcast: cannot use CUDA device ",
                    device);
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        check(ncclCommInitRankConfig(&comm_, world, id, rank, &config), "ncclCommInitRankConfig");
        finish("forming the NCCL group", false);
    }
    ~NcclChannel() override {
        if (comm_ != nullptr) ncclCommAbort(comm_);
    }
    void broadcast(const at::Tensor& t) override {
        MOERL_CHECK(t.is_cuda(), "policy broadcast: NCCL moves CUDA tensors; got one on ", t.device().str());
        at::Tensor b = byte_view(t);
        // The legacy default stream: LibTorch's default stream, where the weights were written.
        check(ncclBroadcast(b.data_ptr(), b.data_ptr(), static_cast<size_t>(b.numel()), ncclUint8, 0, comm_,
                            nullptr),
              "ncclBroadcast");
        finish("an NCCL broadcast", true);
    }

  private:
    static std::vector<uint8_t> to_vector(const ncclUniqueId& id) {
        const auto* p = reinterpret_cast<const uint8_t*>(&id);
        return {p, p + sizeof id};
    }
    void check(ncclResult_t rc, const char* what) {
        if (rc == ncclSuccess || rc == ncclInProgress) return;
        const char* last = comm_ != nullptr ? ncclGetLastError(comm_) : nullptr;
        const std::string said = last != nullptr && *last ? std::string(" (") + last + ")" : std::string();
        if (comm_ != nullptr) ncclCommAbort(comm_);
        comm_ = nullptr;
        MOERL_FAIL("policy broadcast: ", what, " failed: ", ncclGetErrorString(rc), said);
    }
    // Waits for the communicator (and, with `stream`, the default stream) up to timeout_s.
    void finish(const char* what, bool stream) {
        const auto deadline = Clock::now() + millis(timeout_s_);
        for (int spins = 0;; ++spins) {
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(comm_, &async);
            if (async != ncclSuccess && async != ncclInProgress) check(async, what);
            if (async == ncclSuccess) {
                if (!stream) return;
                const cudaError_t q = cudaStreamQuery(nullptr);
                if (q == cudaSuccess) return;
                MOERL_CHECK(q == cudaErrorNotReady, "policy broadcast: ", what,
                            " failed on the GPU: ", cudaGetErrorString(q));
            }
            if (Clock::now() > deadline) {
                ncclCommAbort(comm_);
                comm_ = nullptr;
                MOERL_FAIL("policy broadcast: ", what, " did not finish within ", timeout_s_, " s");
            }
            if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

    ncclComm_t comm_ = nullptr;
    double timeout_s_;
};
#endif

std::unique_ptr<Channel> make_channel(const std::string& backend,
                                      const c10::intrusive_ptr<c10d::Store>& store, int64_t gen, int rank,
                                      int world, const std::string& addr, int device, double timeout_s) {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(gen_key("group", gen), store);
#if MOERL_HAVE_NCCL
    if (backend == "nccl") return std::make_unique<NcclChannel>(prefixed, rank, world, device, timeout_s);
#endif
#ifdef MOERL_HAVE_GLOO
    if (backend == "gloo") return std::make_unique<GlooChannel>(prefixed, rank, world, addr, timeout_s);
#endif
    (void)addr, (void)device, (void)timeout_s, (void)rank, (void)world;
    MOERL_FAIL("policy broadcast: the trainer sends over ", backend, ", which this build lacks");
}

// What the trainer sends: dense weights of its first rank, expert stacks of every rank.
struct SentTensor {
    std::string name;
    int first_expert = -1;  // -1: dense
    at::Tensor tensor;      // contiguous
};
std::vector<SentTensor> sent_tensors(const std::vector<BroadcastSource>& sources) {
    MOERL_CHECK(!sources.empty(), "policy broadcast: no trainer weights to send");
    std::vector<SentTensor> out;
    for (size_t r = 0; r < sources.size(); ++r)
        for (const model::NamedParameter& w : sources[r].weights) {
            if (!w.expert && r > 0) continue;
            out.push_back({w.name, w.expert ? sources[r].first_expert : -1, w.tensor.detach().contiguous()});
        }
    return out;
}
std::string header_of(const std::vector<SentTensor>& tensors) {
    nlohmann::json h = nlohmann::json::array();
    for (const SentTensor& t : tensors)
        h.push_back({{"name", t.name},
                     {"first_expert", t.first_expert},
                     {"shape", t.tensor.sizes().vec()},
                     {"dtype", c10::toString(t.tensor.scalar_type())}});
    return h.dump();
}

std::pair<std::string, int> host_port(const std::string& uri) {
    MOERL_CHECK(is_broadcast_uri(uri), "policy broadcast: '", uri, "' is not a broadcast:// URI");
    const std::string rest = uri.substr(std::string(kUriPrefix).size());
    const std::string where = rest.substr(0, rest.find('/'));
    const auto colon = where.rfind(':');
    MOERL_CHECK(colon != std::string::npos && colon > 0, "policy broadcast: '", uri, "' names no HOST:PORT");
    const int port = std::atoi(where.c_str() + colon + 1);
    MOERL_CHECK(port > 0 && port < 65536, "policy broadcast: '", uri, "': bad port");
    return {where.substr(0, colon), port};
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
    return std::find(v.begin(), v.end(), x) != v.end();
}
std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s.empty() ? "none" : s;
}
}  // namespace

std::string policy_broadcast_unavailable() {
#if defined(MOERL_HAVE_GLOO) || MOERL_HAVE_NCCL
    return "";
#else
    return "this build has neither c10d's Gloo (its LibTorch ships no Gloo headers) nor NCCL";
#endif
}

bool is_broadcast_uri(const std::string& uri) { return uri.rfind(kUriPrefix, 0) == 0; }
std::string broadcast_uri_id(const std::string& uri) {
    const std::string rest = uri.substr(std::string(kUriPrefix).size());
    const auto slash = rest.find('/');
    return slash == std::string::npos ? std::string() : rest.substr(slash + 1);
}

// ---- trainer ---------------------------------------------------------------------------------
struct PolicyBroadcaster::Impl {
    BroadcastOptions o;
    c10::intrusive_ptr<c10d::TCPStore> store;
    int64_t gen = 0;  // the newest generation announced
    std::unique_ptr<Channel> group;
    std::vector<std::string> roster;   // the members of `group`
    std::vector<std::string> members;  // who the next send goes to
    int64_t joins_seen = 0;
    std::string backend;

    void say(const std::string& s) const {
        if (o.log) o.log(s);
    }

    std::vector<std::string> take_joiners() {
        std::vector<std::string> names;
        const int64_t n = store->add("join/count", 0);
        for (; joins_seen < n; ++joins_seen) {
            const std::string key = gen_key("join", joins_seen + 1);
            const std::string name = text_of(store->get(key));
            store->deleteKey(key);
            if (!contains(names, name)) names.push_back(name);
        }
        return names;
    }

    void announce(int64_t version, const std::vector<std::string>& candidates) {
        nlohmann::json a = {
            {"gen", gen}, {"version", version}, {"backend", backend}, {"candidates", candidates}};
        store->set("announce", bytes_of(a.dump()));
    }

    // Announces a new generation of `candidates`, waits for them to be ready, forms the group of
    // those that are. `announced` (once) after the announcement.
    void form(int64_t version, const std::vector<std::string>& candidates, std::function<void()>& announced) {
        group.reset();
        roster.clear();
        if (gen > 1) store->deleteKey(gen_key("roster", gen - 1));
        ++gen;
        announce(version, candidates);
        if (announced) std::exchange(announced, {})();
        std::vector<std::string> ready, waiting = candidates;
        const auto deadline = Clock::now() + millis(o.join_timeout_s);
        while (!waiting.empty()) {
            for (auto it = waiting.begin(); it != waiting.end();) {
                const std::string key = gen_key("ready", gen) + "/" + *it;
                if (store->check({key})) {
                    store->deleteKey(key);
                    ready.push_back(*it);
                    it = waiting.erase(it);
                } else {
                    ++it;
                }
            }
            if (waiting.empty() || Clock::now() > deadline) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        // In the candidates' order, so that a retry ranks them alike.
        std::vector<std::string> formed;
        for (const auto& c : candidates)
            if (contains(ready, c)) formed.push_back(c);
        store->set(gen_key("roster", gen), bytes_of(nlohmann::json(formed).dump()));
        if (!waiting.empty())
            say(::moerl::detail::concat("policy broadcast: generation ", gen, " leaves out ", join(waiting),
                                        " (not ready within sync.join_timeout_s ", o.join_timeout_s, " s)"));
        if (!formed.empty())
            group = make_channel(backend, store, gen, 0, static_cast<int>(formed.size()) + 1, o.address,
                                 device, o.timeout_s);
        roster = std::move(formed);
    }

    int device = 0;

    // Sends the version to `candidates` (a new generation unless they are the group), retrying
    // twice with a new one after a failure. Returns who received it.
    std::vector<std::string> attempt(int64_t version, const std::vector<SentTensor>& tensors,
                                     std::vector<std::string> candidates, std::function<void()> announced) {
        for (int attempt = 1; attempt <= 3; ++attempt) {
            try {
                if (group && roster == candidates) {
                    announce(version, candidates);
                    if (announced) std::exchange(announced, {})();
                    const std::vector<std::string> absent = wait_arrivals(version);
                    if (!absent.empty()) {
                        say(::moerl::detail::concat("policy broadcast: ", join(absent), " of generation ",
                                                    gen, " did not come for v", version,
                                                    " within sync.join_timeout_s ", o.join_timeout_s,
                                                    " s; forming a new generation without"));
                        for (const auto& name : absent)
                            candidates.erase(std::find(candidates.begin(), candidates.end(), name));
                        group.reset();
                    }
                }
                if (!group || roster != candidates) form(version, candidates, announced);
                if (group)
                    for (const SentTensor& t : tensors) group->broadcast(t.tensor);
                return roster;
            } catch (const std::exception& e) {
                // Closing our side makes the other members' receives fail now, not after a timeout.
                group.reset();
                if (!roster.empty()) candidates = roster;
                roster.clear();
                say("policy broadcast: sending v" + std::to_string(version) + " to generation " +
                    std::to_string(gen) + " failed (" + e.what() + ")" +
                    (attempt < 3 ? "; forming a new one" : "; the workers get it when they ask again"));
            }
        }
        return {};
    }

    // The members of the group say they are there for `version` before anyone enters the broadcast
    // (a killed worker would otherwise be seen only when the broadcast times out); then the trainer
    // says "send" if every one came, else "reform" (the ones there take part in a new generation).
    // Returns those that did not come within join_timeout_s.
    std::vector<std::string> wait_arrivals(int64_t version) {
        const std::string base = gen_key("arrived", gen) + "/" + std::to_string(version) + "/";
        std::vector<std::string> waiting = roster;
        const auto deadline = Clock::now() + millis(o.join_timeout_s);
        while (!waiting.empty()) {
            for (auto it = waiting.begin(); it != waiting.end();) {
                if (store->check({base + *it})) {
                    store->deleteKey(base + *it);
                    it = waiting.erase(it);
                } else {
                    ++it;
                }
            }
            if (waiting.empty() || Clock::now() > deadline) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        const std::string go = gen_key("go", gen) + "/";
        store->set(go + std::to_string(version), bytes_of(waiting.empty() ? "send" : "reform"));
        if (store->check({go + std::to_string(version - 2)}))
            store->deleteKey(go + std::to_string(version - 2));
        return waiting;
    }

    void set_backend(const std::vector<SentTensor>& tensors) {
        const bool cuda = tensors.front().tensor.is_cuda();
        device = cuda ? tensors.front().tensor.device().index() : 0;
#if MOERL_HAVE_NCCL
        if (cuda) {
            backend = "nccl";
            return;
        }
#endif
#ifdef MOERL_HAVE_GLOO
        backend = "gloo";
#else
        MOERL_FAIL("policy broadcast: ", policy_broadcast_unavailable(),
                   cuda ? "" : " (NCCL needs the trainer's weights on a GPU)");
#endif
    }

    void put_header(int64_t version, const std::vector<SentTensor>& tensors) {
        store->set(gen_key("header", version), bytes_of(header_of(tensors)));
        if (store->check({gen_key("header", version - 2)})) store->deleteKey(gen_key("header", version - 2));
    }
};

PolicyBroadcaster::PolicyBroadcaster(BroadcastOptions options) : impl_(std::make_unique<Impl>()) {
    impl_->o = std::move(options);
    MOERL_CHECK(!impl_->o.address.empty(), "policy broadcast: no address to advertise (sync.address)");
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(impl_->o.port);
    so.isServer = true;
    so.waitWorkers = false;
    so.timeout = millis(impl_->o.timeout_s);
    try {
        impl_->store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    } catch (const std::exception& e) {
        MOERL_FAIL("policy broadcast: cannot listen on port ", impl_->o.port, " (sync.port): ", e.what());
    }
    impl_->store->set("join/count", bytes_of("0"));
}
PolicyBroadcaster::~PolicyBroadcaster() = default;

std::string PolicyBroadcaster::uri(const std::string& id) const {
    return kUriPrefix + impl_->o.address + ":" + std::to_string(port()) + "/" + id;
}
int PolicyBroadcaster::port() const { return impl_->store->getPort(); }
int64_t PolicyBroadcaster::generation() const { return impl_->gen; }

std::vector<std::string> PolicyBroadcaster::send(int64_t version, const std::vector<BroadcastSource>& sources,
                                                 const std::function<void()>& announced) {
    Impl& m = *impl_;
    const std::vector<SentTensor> tensors = sent_tensors(sources);
    m.set_backend(tensors);
    m.put_header(version, tensors);
    for (const auto& name : m.take_joiners())
        if (!contains(m.members, name)) m.members.push_back(name);
    m.members = m.attempt(version, tensors, m.members, announced);
    return m.members;
}

bool PolicyBroadcaster::has_joiners() { return impl_->store->add("join/count", 0) > impl_->joins_seen; }

std::vector<std::string> PolicyBroadcaster::serve_joiners(int64_t version,
                                                          const std::vector<BroadcastSource>& sources) {
    Impl& m = *impl_;
    std::vector<std::string> joiners;
    for (const auto& name : m.take_joiners())  // a member of the group asks only after it left it
        if (!contains(m.roster, name) || !m.group) joiners.push_back(name);
    if (joiners.empty()) return {};
    const std::vector<SentTensor> tensors = sent_tensors(sources);
    m.set_backend(tensors);
    m.put_header(version, tensors);
    // The joiners alone: the members have this version and leave their group at the next send.
    const std::vector<std::string> got = m.attempt(version, tensors, joiners, {});
    for (const auto& name : got)
        if (!contains(m.members, name)) m.members.push_back(name);
    return got;
}

// ---- rollout worker --------------------------------------------------------------------------
struct PolicyReceiver::Impl {
    std::string name;
    std::vector<model::NamedParameter> target;
    int first_expert = 0;
    double timeout_s = 120;
    std::function<void(const std::string&)> log;

    at::Device device{at::kCPU};  // the target's
    std::string where;            // host:port of the trainer's store
    std::string host;
    c10::intrusive_ptr<c10d::TCPStore> store;
    int64_t gen = -1, failed_gen = -1, joined_for = -2;
    std::unique_ptr<Channel> group;
    bool incomplete = false;
    bool said_unreachable = false;

    // The copies of one header into the target.
    struct Item {
        std::vector<int64_t> shape;
        at::ScalarType dtype = at::kFloat;
        at::Tensor direct;  // where the bytes land when they land in the target itself
        at::Tensor dst;     // else: rows src_row.. of the received tensor are copied here
        int64_t src_row = 0;
        int64_t bytes = 0;  // written into the target
    };
    std::string plan_header;
    std::vector<Item> plan;

    void say(const std::string& s) const {
        if (log) log(s);
    }

    void reset_trainer() {
        group.reset();
        store.reset();
        gen = -1, failed_gen = -1, joined_for = -2;
    }

    bool connect(const std::string& h, int port) {
        c10d::TCPStoreOptions so;
        so.port = static_cast<uint16_t>(port);
        so.isServer = false;
        so.timeout = millis(std::min(5.0, timeout_s));
        try {
            store = c10::make_intrusive<c10d::TCPStore>(h, so);
            store->setTimeout(millis(timeout_s));
            said_unreachable = false;
            return true;
        } catch (const std::exception& e) {
            store.reset();
            if (!said_unreachable)
                say("policy broadcast: the trainer's store at " + where + " is not reachable (" + e.what() +
                    "); trying again at the next sync");
            said_unreachable = true;
            return false;
        }
    }

    void ask_to_join(int64_t for_gen) {
        if (joined_for == for_gen) return;
        const int64_t n = store->add("join/count", 1);
        store->set(gen_key("join", n), bytes_of(name));
        joined_for = for_gen;
    }

    void make_plan(const std::string& header) {
        if (header == plan_header) return;
        plan.clear();
        plan_header.clear();
        struct Place {
            at::Tensor tensor;
            bool expert;
            std::vector<int> covered;  // per row (experts) or [0] (dense)
        };
        std::map<std::string, Place> places;
        for (const auto& w : target) {
            at::Tensor t = w.tensor.detach();
            places[w.name] = {t, w.expert,
                              std::vector<int>(w.expert ? static_cast<size_t>(t.size(0)) : 1, 0)};
        }
        const nlohmann::json h = nlohmann::json::parse(header);
        for (const auto& e : h) {
            Item it;
            const std::string wname = e.at("name").get<std::string>();
            it.shape = e.at("shape").get<std::vector<int64_t>>();
            const std::string dt = e.at("dtype").get<std::string>();
            it.dtype = dt == "BFloat16" ? at::kBFloat16
                       : dt == "Half"   ? at::kHalf
                       : dt == "Float"  ? at::kFloat
                                        : at::kDouble;
            MOERL_CHECK(dt == "BFloat16" || dt == "Half" || dt == "Float" || dt == "Double",
                        "policy broadcast: the trainer's weight ", wname, " is ", dt,
                        "; expected a float type");
            const int64_t first = e.at("first_expert").get<int64_t>();
            auto p = places.find(wname);
            MOERL_CHECK(p != places.end(), "policy broadcast: the trainer's weight ", wname,
                        " is not in this rollout model");
            Place& place = p->second;
            const at::Tensor& t = place.tensor;
            const bool direct_ok = t.is_contiguous() && t.scalar_type() == it.dtype;
            if (first < 0) {
                MOERL_CHECK(!place.expert, "policy broadcast: ", wname,
                            " is a dense weight in the trainer, an expert stack in the rollout model");
                MOERL_CHECK(t.sizes().vec() == it.shape, "policy broadcast: weight ", wname, " is ",
                            c10::IntArrayRef(it.shape), " in the trainer but ", t.sizes(),
                            " in the rollout model");
                place.covered[0] += 1;
                it.bytes = t.numel() * static_cast<int64_t>(t.element_size());
                if (direct_ok) {
                    it.direct = t;
                } else {
                    it.dst = t;
                }
                plan.push_back(std::move(it));
                continue;
            }
            MOERL_CHECK(place.expert, "policy broadcast: ", wname,
                        " is an expert stack in the trainer, a dense weight in the rollout model");
            MOERL_CHECK(!it.shape.empty() && t.sizes().slice(1).vec() ==
                                                 std::vector<int64_t>(it.shape.begin() + 1, it.shape.end()),
                        "policy broadcast: the experts of ", wname, " are ",
                        c10::IntArrayRef(it.shape).slice(1), " in the trainer but ", t.sizes().slice(1),
                        " in the rollout model");
            const int64_t rows = it.shape[0], mine = t.size(0);
            const int64_t lo = std::max<int64_t>(first, first_expert);
            const int64_t hi = std::min<int64_t>(first + rows, first_expert + mine);
            for (int64_t r = lo; r < hi; ++r) place.covered[static_cast<size_t>(r - first_expert)] += 1;
            if (hi > lo) {
                at::Tensor rows_here = t.narrow(0, lo - first_expert, hi - lo);
                it.bytes = rows_here.numel() * static_cast<int64_t>(rows_here.element_size());
                if (direct_ok && lo == first && hi == first + rows) {
                    it.direct = rows_here;
                } else {
                    it.dst = rows_here;
                    it.src_row = lo - first;
                }
            }
            plan.push_back(std::move(it));
        }
        for (const auto& [wname, place] : places)
            for (size_t r = 0; r < place.covered.size(); ++r) {
                MOERL_CHECK(place.covered[r] == 1, "policy broadcast: ", wname,
                            place.expert ? " expert " + std::to_string(first_expert + static_cast<int64_t>(r))
                                         : std::string(),
                            place.covered[r] == 0 ? " is not among the trainer's weights"
                                                  : " comes from more than one trainer rank");
            }
        plan_header = header;
    }

    std::optional<int64_t> receive(const std::string& uri, int64_t version) {
        const auto [h, port] = host_port(uri);
        const std::string w = h + ":" + std::to_string(port);
        if (w != where) {  // another trainer (a restarted one listens elsewhere)
            reset_trainer();
            where = w;
            host = h;
        }
        if (!store && !connect(h, port)) return std::nullopt;
        nlohmann::json a;
        try {
            a = nlohmann::json::parse(text_of(store->get("announce")));
        } catch (const std::exception& e) {
            say(std::string("policy broadcast: lost the trainer's store (") + e.what() + ")");
            reset_trainer();
            return std::nullopt;
        }
        if (a.at("version").get<int64_t>() != version) return std::nullopt;  // not (yet) announced
        // The weights must fit before this worker joins anyone: a misfit is left out of the group
        // (the trainer waits only join_timeout_s for it) instead of failing the others' broadcast.
        make_plan(text_of(store->get(gen_key("header", version))));
        const int64_t g = a.at("gen").get<int64_t>();
        if (g != gen) {
            group.reset();
            gen = -1;
            const auto candidates = a.at("candidates").get<std::vector<std::string>>();
            if (g <= failed_gen || !contains(candidates, name)) {
                ask_to_join(g);
                return std::nullopt;
            }
            store->set(gen_key("ready", g) + "/" + name, bytes_of("1"));
            const auto roster = nlohmann::json::parse(text_of(store->get(gen_key("roster", g))))
                                    .get<std::vector<std::string>>();
            const auto me = std::find(roster.begin(), roster.end(), name);
            if (me == roster.end()) {
                ask_to_join(g);
                return std::nullopt;
            }
            try {
                group = make_channel(a.at("backend").get<std::string>(), store, g,
                                     static_cast<int>(me - roster.begin()) + 1,
                                     static_cast<int>(roster.size()) + 1, host,
                                     device.is_cuda() ? device.index() : 0, timeout_s);
            } catch (const std::exception& e) {
                failed_gen = g;
                ask_to_join(g);
                say(std::string("policy broadcast: joining generation ") + std::to_string(g) + " failed (" +
                    e.what() + "); asked to join again");
                return std::nullopt;
            }
            gen = g;
        } else {
            // A member of the group: say it is here, and go on once the trainer says every member is.
            const std::string v = std::to_string(version);
            store->set(gen_key("arrived", g) + "/" + v + "/" + name, bytes_of("1"));
            if (text_of(store->get(gen_key("go", g) + "/" + v)) != "send") {
                group.reset();  // another member is missing: the trainer forms a new generation now
                gen = -1;
                return std::nullopt;
            }
        }
        int64_t bytes = 0;
        try {
            c10::NoGradGuard no_grad;
            for (const Item& it : plan) {
                if (it.direct.defined()) {
                    group->broadcast(it.direct);
                } else {
                    const at::Device dev = it.dst.defined() ? it.dst.device() : device;
                    at::Tensor got = at::empty(it.shape, at::TensorOptions().dtype(it.dtype).device(dev));
                    group->broadcast(got);
                    if (it.dst.defined()) it.dst.copy_(got.narrow(0, it.src_row, it.dst.size(0)));
                }
                bytes += it.bytes;
            }
        } catch (const std::exception& e) {
            group.reset();
            failed_gen = gen;
            gen = -1;
            incomplete = true;
            ask_to_join(failed_gen);
            MOERL_FAIL("policy broadcast: receiving v", version, " failed part way (", e.what(),
                       "); asked the trainer to send it again");
        }
        incomplete = false;
        return bytes;
    }
};

PolicyReceiver::PolicyReceiver(std::string name, std::vector<model::NamedParameter> target, int first_expert,
                               double timeout_s, std::function<void(const std::string&)> log)
    : impl_(std::make_unique<Impl>()) {
    impl_->name = std::move(name);
    impl_->target = std::move(target);
    impl_->first_expert = first_expert;
    impl_->timeout_s = timeout_s;
    impl_->log = std::move(log);
    if (!impl_->target.empty()) impl_->device = impl_->target.front().tensor.device();
}
PolicyReceiver::~PolicyReceiver() = default;
std::optional<int64_t> PolicyReceiver::receive(const std::string& uri, int64_t version) {
    return impl_->receive(uri, version);
}
bool PolicyReceiver::incomplete() const { return impl_->incomplete; }

}  // namespace moerl::rl::detail
