// CUDA IPC weight handoff (cuda_ipc.hpp). The CUDA runtime and driver API only where the build has
// the toolkit (MOERL_HAVE_CUDA_IPC); elsewhere the descriptions and plans still work (they are
// host logic) and exporting or copying says that the build lacks CUDA.
#include "cuda_ipc.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "moerl/core/error.hpp"
#include "moerl/core/process.hpp"

#if MOERL_HAVE_CUDA_IPC
#include <cuda.h>  // the driver's types only: its entry points come through the runtime
#include <cuda_runtime.h>

#include "moerl/core/cuda_check.hpp"
#endif

namespace moerl::rl::detail {

namespace {
using nlohmann::json;

std::string host_name() {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    return name;
}

const char* dtype_name(at::ScalarType t) {
    switch (t) {
        case at::kBFloat16:
            return "bf16";
        case at::kHalf:
            return "fp16";
        case at::kFloat:
            return "fp32";
        default:
            return nullptr;
    }
}

at::ScalarType dtype_of(const std::string& name, const std::string& what) {
    if (name == "bf16") return at::kBFloat16;
    if (name == "fp16") return at::kHalf;
    MOERL_CHECK(name == "fp32", what, ": dtype '", name, "'; expected bf16, fp16 or fp32");
    return at::kFloat;
}

// Whether `p` is this process: its allocations are used at their own addresses.
bool is_self(const IpcProcess& p) {
    return p.pid == ::getpid() && p.host == host_name() && p.pid_namespace == pid_namespace();
}

// "trainer rank 1" or "trainer ranks 0, 1": the ranks whose weights process `p` holds.
std::string ranks_of(const IpcProcess& p) {
    std::set<int> ranks;
    for (const IpcTensor& t : p.tensors) ranks.insert(t.rank);
    std::string out = ranks.size() == 1 ? "trainer rank " : "trainer ranks ";
    bool first = true;
    for (int r : ranks) out += (first ? "" : ", ") + std::to_string(r), first = false;
    return out;
}

std::string to_hex(const void* data, size_t n) {
    static const char* digits = "0123456789abcdef";
    std::string out;
    const auto* b = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) out += digits[b[i] >> 4], out += digits[b[i] & 15];
    return out;
}

#if MOERL_HAVE_CUDA_IPC
void from_hex(const std::string& hex, void* out, size_t n, const std::string& what) {
    MOERL_CHECK(hex.size() == 2 * n, what, ": a handle of ", hex.size() / 2, " bytes, expected ", n);
    auto digit = [&](char c) {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        MOERL_FAIL(what, ": the handle holds '", c, "', not a hex digit");
    };
    auto* b = static_cast<uint8_t*>(out);
    for (size_t i = 0; i < n; ++i)
        b[i] = static_cast<uint8_t>(digit(hex[2 * i]) * 16 + digit(hex[2 * i + 1]));
}

// A failed runtime call leaves its error behind for the next cudaGetLastError (LibTorch checks it
// after its kernel launches): take it, and say what failed.
std::string cuda_failure(cudaError_t e) {
    (void)cudaGetLastError();
    return moerl::detail::concat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// cuMemGetAddressRange (the allocation around a pointer), through the runtime: a program that
// links libcuda directly cannot start on a machine without the driver, as the CPU machines of the
// tests are.
using GetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* bytes, CUdeviceptr ptr);
GetAddressRange get_address_range() {
    static GetAddressRange fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        const cudaError_t e =
            cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &found);
#else
        const cudaError_t e = cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &found);
#endif
        MOERL_CHECK(e == cudaSuccess && found == cudaDriverEntryPointSuccess && p != nullptr,
                    "the CUDA driver's cuMemGetAddressRange is not to be found: ", cuda_failure(e));
        return reinterpret_cast<GetAddressRange>(p);
    }();
    return fn;
}

class DeviceGuard {
  public:
    explicit DeviceGuard(int device) {
        MOERL_CUDA_CHECK(cudaGetDevice(&previous_));
        if (previous_ != device) MOERL_CUDA_CHECK(cudaSetDevice(device));
    }
    ~DeviceGuard() { (void)cudaSetDevice(previous_); }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

  private:
    int previous_ = 0;
};

// The allocations of other processes this process has opened, by handle, with the readers holding
// each (a handle opens once per process).
class OpenHandles {
  public:
    static OpenHandles& get() {
        static auto* handles = new OpenHandles;  // never destroyed: the driver may be gone at exit
        return *handles;
    }
    char* acquire(const std::string& handle, const std::string& what) {
        std::lock_guard lock(mutex_);
        auto it = open_.find(handle);
        if (it == open_.end()) {
            cudaIpcMemHandle_t h;
            from_hex(handle, &h, sizeof(h), what);
            void* p = nullptr;
            const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
            MOERL_CHECK(e == cudaSuccess, what, ": cudaIpcOpenMemHandle failed: ", cuda_failure(e));
            it = open_.emplace(handle, Open{static_cast<char*>(p), 0}).first;
        }
        ++it->second.readers;
        return it->second.base;
    }
    char* base(const std::string& handle) {
        std::lock_guard lock(mutex_);
        return open_.at(handle).base;
    }
    void release(const std::string& handle) {
        std::lock_guard lock(mutex_);
        auto it = open_.find(handle);
        if (it == open_.end() || --it->second.readers > 0) return;
        if (cudaIpcCloseMemHandle(it->second.base) != cudaSuccess) (void)cudaGetLastError();
        open_.erase(it);
    }

  private:
    struct Open {
        char* base;
        int readers;
    };
    std::mutex mutex_;
    std::map<std::string, Open> open_;  // GUARDED_BY(mutex_)
};
#endif

}  // namespace

bool cuda_ipc_compiled() {
#if MOERL_HAVE_CUDA_IPC
    return true;
#else
    return false;
#endif
}

// ---- descriptions ----
namespace {
json process_json(const IpcProcess& p) {
    json allocations = json::array(), tensors = json::array();
    for (const IpcAllocation& a : p.allocations)
        allocations.push_back({{"handle", a.handle}, {"base", a.base}, {"bytes", a.bytes}});
    for (const IpcTensor& t : p.tensors)
        tensors.push_back({{"name", t.name},
                           {"rank", t.rank},
                           {"allocation", t.allocation},
                           {"offset", t.offset},
                           {"shape", t.shape},
                           {"dtype", t.dtype},
                           {"first_expert", t.first_expert}});
    return {{"host", p.host},
            {"pid", p.pid},
            {"pid_namespace", p.pid_namespace},
            {"device", p.device},
            {"allocations", allocations},
            {"tensors", tensors}};
}

IpcProcess process_from(const json& j) {
    IpcProcess p;
    p.host = j.at("host").get<std::string>();
    p.pid = j.at("pid").get<int64_t>();
    p.pid_namespace = j.at("pid_namespace").get<std::string>();
    p.device = j.at("device").get<int>();
    for (const json& a : j.at("allocations"))
        p.allocations.push_back(
            {a.at("handle").get<std::string>(), a.at("base").get<uint64_t>(), a.at("bytes").get<uint64_t>()});
    for (const json& t : j.at("tensors"))
        p.tensors.push_back({t.at("name").get<std::string>(), t.at("rank").get<int>(),
                             t.at("allocation").get<int>(), t.at("offset").get<uint64_t>(),
                             t.at("shape").get<std::vector<int64_t>>(), t.at("dtype").get<std::string>(),
                             t.at("first_expert").get<int>()});
    return p;
}
}  // namespace

std::string ipc_process_to_json(const IpcProcess& p) { return process_json(p).dump(); }

IpcProcess ipc_process_from_json(const std::string& text) {
    try {
        return process_from(json::parse(text));
    } catch (const json::exception& e) {
        MOERL_FAIL("a trainer process's CUDA IPC export does not parse: ", e.what());
    }
}

std::string ipc_policy_to_json(const IpcPolicy& p) {
    json processes = json::array();
    for (const IpcProcess& q : p.processes) processes.push_back(process_json(q));
    return json{
        {"version", p.version}, {"publisher", p.publisher}, {"writes", p.writes}, {"processes", processes}}
        .dump();
}

IpcPolicy ipc_policy_from_json(const std::string& text, const std::string& what) {
    try {
        const json j = json::parse(text);
        IpcPolicy p;
        p.version = j.at("version").get<int64_t>();
        p.publisher = j.at("publisher").get<std::string>();
        p.writes = j.at("writes").get<int64_t>();
        for (const json& q : j.at("processes")) p.processes.push_back(process_from(q));
        for (const IpcProcess& q : p.processes)
            for (const IpcTensor& t : q.tensors) {
                MOERL_CHECK(t.allocation >= 0 && t.allocation < static_cast<int>(q.allocations.size()), what,
                            ": ", t.name, " of trainer rank ", t.rank, " names allocation ", t.allocation,
                            " of ", q.allocations.size());
                dtype_of(t.dtype, what + ": " + t.name);
            }
        return p;
    } catch (const json::exception& e) {
        MOERL_FAIL(what, ": not a CUDA IPC policy: ", e.what());
    }
}

// ---- trainer side ----
IpcProcess IpcExporter::export_weights(const std::vector<IpcSource>& sources) {
    std::vector<const void*> pointers;
    int device = -1;
    for (const IpcSource& s : sources) {
        for (const model::NamedParameter& w : s.weights) {
            const at::Tensor& t = w.tensor;
            MOERL_CHECK(t.is_cuda(), "the trainer's weight ", w.name, " is on the ", t.device(),
                        ", not on a CUDA device");
            MOERL_CHECK(t.is_contiguous(), "the trainer's weight ", w.name, " is not contiguous");
            MOERL_CHECK(dtype_name(t.scalar_type()) != nullptr, "the trainer's weight ", w.name, " is ",
                        t.scalar_type(), "; CUDA IPC hands over bf16, fp16 and fp32 weights");
            if (device < 0) device = t.device().index();
            MOERL_CHECK(t.device().index() == device,
                        "the trainer's weights in one process are on CUDA devices ", device, " and ",
                        static_cast<int>(t.device().index()));
            pointers.push_back(t.data_ptr());
        }
    }
    MOERL_CHECK(!pointers.empty(), "the trainer has no weights to export");
#if !MOERL_HAVE_CUDA_IPC
    MOERL_FAIL("this build has no CUDA runtime (MOERL_WITH_CUDA off), so no CUDA IPC");
#else
    DeviceGuard guard(device);
    // The update's writes are finished before the version is announced: a reader's copies run in
    // another process, ordered after none of this one's streams.
    MOERL_CUDA_CHECK(cudaDeviceSynchronize());
    if (pointers == pointers_) return last_;
    IpcProcess out;
    out.host = host_name();
    out.pid = ::getpid();
    out.pid_namespace = pid_namespace();
    out.device = device;
    std::map<CUdeviceptr, int> by_base;
    for (const IpcSource& s : sources) {
        for (const model::NamedParameter& w : s.weights) {
            const auto ptr = reinterpret_cast<CUdeviceptr>(w.tensor.data_ptr());
            CUdeviceptr base = 0;
            size_t bytes = 0;
            const CUresult r = get_address_range()(&base, &bytes, ptr);
            MOERL_CHECK(r == CUDA_SUCCESS, "cuMemGetAddressRange on the trainer's weight ", w.name,
                        " failed: CUresult ", static_cast<int>(r));
            auto [it, fresh] = by_base.emplace(base, static_cast<int>(out.allocations.size()));
            if (fresh) {
                cudaIpcMemHandle_t h;
                const cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
                MOERL_CHECK(
                    e == cudaSuccess, "cudaIpcGetMemHandle on the allocation holding the trainer's weight ",
                    w.name, " failed: ", cuda_failure(e),
                    " (legacy CUDA IPC takes cudaMalloc memory only, not virtual-memory allocations such "
                    "as PyTorch's expandable segments)");
                out.allocations.push_back({to_hex(&h, sizeof(h)), static_cast<uint64_t>(base), bytes});
            }
            const auto sizes = w.tensor.sizes();
            out.tensors.push_back({w.name, s.rank, it->second, static_cast<uint64_t>(ptr - base),
                                   std::vector<int64_t>(sizes.begin(), sizes.end()),
                                   dtype_name(w.tensor.scalar_type()), w.expert ? s.first_expert : -1});
        }
    }
    pointers_ = std::move(pointers);
    last_ = out;
    return out;
#endif
}

// ---- rollout side ----
void check_ipc_processes(const IpcPolicy& policy) {
    const std::string here = host_name(), ns = pid_namespace();
    for (const IpcProcess& p : policy.processes) {
        MOERL_CHECK(p.host == here, "cuda-ipc policy v", policy.version, ": ", ranks_of(p), " run on host ",
                    p.host, ", this process on ", here, "; CUDA IPC needs one machine");
        MOERL_CHECK(p.pid_namespace == ns, "cuda-ipc policy v", policy.version, ": ", ranks_of(p),
                    " run in another PID namespace (", p.pid_namespace, ", here ", ns,
                    "); CUDA IPC needs one namespace");
        MOERL_CHECK(p.pid == ::getpid() || process_alive(static_cast<pid_t>(p.pid)), "cuda-ipc policy v",
                    policy.version, ": ", ranks_of(p), " (pid ", p.pid, ") has exited");
    }
}

std::vector<ExpertRows> expert_rows(int64_t first, int64_t L,
                                    const std::vector<std::pair<int64_t, int64_t>>& held,
                                    const std::string& what, const std::string& name) {
    std::vector<ExpertRows> out;
    std::vector<bool> have(static_cast<size_t>(L), false);
    for (size_t i = 0; i < held.size(); ++i) {
        const auto [src_first, count] = held[i];
        const int64_t lo = std::max(first, src_first), hi = std::min(first + L, src_first + count);
        if (lo >= hi) continue;  // experts of another rollout rank
        for (int64_t e = lo; e < hi; ++e) {
            MOERL_CHECK(!have[e - first], what, ": expert ", e, " of ", name,
                        " is exported by two trainer ranks");
            have[e - first] = true;
        }
        out.push_back({i, lo - src_first, lo - first, hi - lo});
    }
    for (int64_t e = 0; e < L; ++e)
        MOERL_CHECK(have[e], what, ": no trainer rank exported expert ", first + e, " of ", name);
    return out;
}

std::vector<IpcCopy> plan_ipc_copies(const IpcPolicy& policy, const model::MoeModel& model) {
    const std::string what = "cuda-ipc policy v" + std::to_string(policy.version);
    struct Source {
        size_t process;
        const IpcTensor* tensor;
    };
    std::map<std::string, std::vector<Source>> by_name;
    for (size_t p = 0; p < policy.processes.size(); ++p)
        for (const IpcTensor& t : policy.processes[p].tensors) by_name[t.name].push_back({p, &t});
    auto make = [&](const std::string& name, const Source& s, uint64_t offset, const at::Tensor& dst) {
        const at::ScalarType type = dtype_of(s.tensor->dtype, what + ": " + name);
        const uint64_t bytes = static_cast<uint64_t>(dst.numel()) * c10::elementSize(type);
        const IpcProcess& p = policy.processes[s.process];
        MOERL_CHECK(
            s.tensor->allocation >= 0 && s.tensor->allocation < static_cast<int>(p.allocations.size()), what,
            ": ", name, " of trainer rank ", s.tensor->rank, " names allocation ", s.tensor->allocation,
            " of ", p.allocations.size());
        const IpcAllocation& a = p.allocations[s.tensor->allocation];
        MOERL_CHECK(offset + bytes <= a.bytes, what, ": ", name, " of trainer rank ", s.tensor->rank,
                    " lies outside its allocation (", offset, " + ", bytes, " bytes of ", a.bytes, ")");
        return IpcCopy{name, s.process, s.tensor->allocation, offset, bytes, type, dst};
    };
    const int64_t first = model.first_local_expert();
    std::vector<IpcCopy> plan;
    std::set<std::string> placed;
    for (const model::NamedParameter& w : model.named_parameters()) {
        const at::Tensor dst = w.tensor.detach();
        auto it = by_name.find(w.name);
        MOERL_CHECK(it != by_name.end(), what, ": the trainer exported no weight ", w.name,
                    " (the rollout model's is ", dst.sizes(), ")");
        MOERL_CHECK(dst.is_contiguous(), what, ": the rollout model's weight ", w.name, " is not contiguous");
        placed.insert(w.name);
        if (!w.expert) {
            const Source* pick = &it->second.front();
            for (const Source& s : it->second)
                if (is_self(policy.processes[s.process])) {
                    pick = &s;
                    break;
                }
            const IpcTensor& t = *pick->tensor;
            MOERL_CHECK(t.first_expert < 0, what, ": ", w.name,
                        " is an expert stack in the trainer, a dense weight in the rollout model");
            MOERL_CHECK(at::IntArrayRef(t.shape) == dst.sizes(), what, ": weight ", w.name, " is ",
                        at::IntArrayRef(t.shape), " in the trainer but ", dst.sizes(),
                        " in the rollout model");
            plan.push_back(make(w.name, *pick, t.offset, dst));
            continue;
        }
        // An expert stack: the rollout's rows are experts first .. first + L - 1, each from the
        // trainer rank that holds it.
        std::vector<std::pair<int64_t, int64_t>> held;
        for (const Source& s : it->second) {
            const IpcTensor& t = *s.tensor;
            MOERL_CHECK(t.first_expert >= 0 && !t.shape.empty(), what, ": ", w.name,
                        " is a dense weight in the trainer, an expert stack in the rollout model");
            MOERL_CHECK(at::IntArrayRef(t.shape).slice(1) == dst.sizes().slice(1), what, ": the experts of ",
                        w.name, " are ", at::IntArrayRef(t.shape).slice(1), " in the trainer but ",
                        dst.sizes().slice(1), " in the rollout model");
            held.emplace_back(t.first_expert, t.shape[0]);
        }
        for (const ExpertRows& r : expert_rows(first, dst.size(0), held, what, w.name)) {
            const Source& s = it->second[r.source];
            const IpcTensor& t = *s.tensor;
            int64_t per_expert = 1;
            for (size_t d = 1; d < t.shape.size(); ++d) per_expert *= t.shape[d];
            const uint64_t row_bytes =
                static_cast<uint64_t>(per_expert) * c10::elementSize(dtype_of(t.dtype, what + ": " + w.name));
            plan.push_back(make(w.name, s, t.offset + static_cast<uint64_t>(r.src_row) * row_bytes,
                                dst.narrow(0, r.dst_row, r.rows)));
        }
    }
    for (const auto& [name, sources] : by_name)
        MOERL_CHECK(placed.count(name) > 0, what, ": the trainer's weight ", name,
                    " has no place in the rollout model");
    return plan;
}

IpcImporter::~IpcImporter() {
#if MOERL_HAVE_CUDA_IPC
    for (const std::string& h : held_) OpenHandles::get().release(h);
#endif
}

int64_t IpcImporter::copy(const IpcPolicy& policy) {
    check_ipc_processes(policy);
    const std::vector<IpcCopy> plan = plan_ipc_copies(policy, model_);
    const at::Device device = model_.options().device;
    MOERL_CHECK(device.is_cuda(), "cuda-ipc policy v", policy.version,
                ": the rollout model is on the CPU; CUDA IPC copies into GPU weights only");
#if !MOERL_HAVE_CUDA_IPC
    MOERL_FAIL("cuda-ipc policy v", policy.version, ": this build has no CUDA runtime (MOERL_WITH_CUDA off)");
#else
    c10::NoGradGuard no_grad;
    DeviceGuard guard(device.index());
    MOERL_CUDA_CHECK(cudaDeviceSynchronize());  // nothing still reads the weights
    // Where each allocation the plan reads lies in this process.
    std::map<std::pair<size_t, int>, char*> bases;
    std::set<std::string> used;
    for (const IpcCopy& c : plan) {
        const std::pair<size_t, int> key{c.process, c.allocation};
        if (bases.count(key) > 0) continue;
        const IpcProcess& p = policy.processes[c.process];
        const IpcAllocation& a = p.allocations[c.allocation];
        if (is_self(p)) {
            bases[key] = reinterpret_cast<char*>(a.base);
            continue;
        }
        used.insert(a.handle);
        if (held_.count(a.handle) > 0) {
            bases[key] = OpenHandles::get().base(a.handle);
            continue;
        }
        bases[key] = OpenHandles::get().acquire(
            a.handle,
            moerl::detail::concat("cuda-ipc policy v", policy.version, ": the handle of ", ranks_of(p),
                                  "'s allocation ", c.allocation, " (pid ", p.pid, ", ", a.bytes, " bytes)"));
        held_.insert(a.handle);
    }
    int64_t bytes = 0;
    for (const IpcCopy& c : plan) {
        const char* src = bases.at({c.process, c.allocation}) + c.offset;
        // The legacy default stream: ordered with LibTorch's default stream, where the conversion
        // below and the engine's work run.
        if (c.src_dtype == c.dst.scalar_type()) {
            MOERL_CUDA_CHECK(cudaMemcpyAsync(c.dst.data_ptr(), src, c.bytes, cudaMemcpyDefault, nullptr));
        } else {
            at::Tensor staging = at::empty(c.dst.sizes(), c.dst.options().dtype(c.src_dtype));
            MOERL_CUDA_CHECK(cudaMemcpyAsync(staging.data_ptr(), src, c.bytes, cudaMemcpyDefault, nullptr));
            c.dst.copy_(staging);
        }
        bytes += c.dst.numel() * static_cast<int64_t>(c.dst.element_size());
    }
    const cudaError_t done = cudaDeviceSynchronize();
    MOERL_CHECK(done == cudaSuccess, "cuda-ipc policy v", policy.version,
                ": copying the weights failed: ", cuda_failure(done));
    // Allocations no longer named: the trainer reallocated those weights.
    for (auto it = held_.begin(); it != held_.end();) {
        if (used.count(*it) > 0) {
            ++it;
            continue;
        }
        OpenHandles::get().release(*it);
        it = held_.erase(it);
    }
    return bytes;
#endif
}

}  // namespace moerl::rl::detail
