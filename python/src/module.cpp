// moerl_ep._C: the EP library (include/moerl/ep) for Python. Thin on purpose: one Engine per moerl
// Buffer, tensors in and out, the library's errors as Python exceptions. The DeepEP-compatible
// Buffer (python/moerl_ep/buffer.py) chooses the shapes and builds engines on top of this.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/ep/transport.hpp"
#ifdef MOERL_HAVE_CUDA
#include "cuda/kernels/kernels.hpp"
#include "cuda/stream.hpp"
#endif
#ifdef MOERL_TORCH_CUDA
#include <ATen/EmptyTensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;
namespace ep = moerl::ep;

namespace {

// A bootstrap store backed by a Python object with set(key: str, value: bytes) and
// get(key: str, timeout_ms: int) -> bytes, which raises when the key does not appear in time
// (python/moerl_ep/_store.py wraps a torch.distributed store this way).
class PyStore final : public ep::Store {
  public:
    explicit PyStore(py::object store) : store_(std::move(store)) {}
    ~PyStore() override {
        py::gil_scoped_acquire gil;
        store_ = py::object();
    }

    void set(const std::string& key, const std::vector<uint8_t>& value) override {
        py::gil_scoped_acquire gil;
        try {
            store_.attr("set")(key, py::bytes(reinterpret_cast<const char*>(value.data()), value.size()));
        } catch (py::error_already_set& e) {
            throw moerl::Error("bootstrap store: set('" + key + "') failed: " + e.what(), __FILE__, __LINE__);
        }
    }

    std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
        py::gil_scoped_acquire gil;
        try {
            std::string v = store_.attr("get")(key, timeout.count()).cast<std::string>();
            return std::vector<uint8_t>(v.begin(), v.end());
        } catch (py::error_already_set& e) {
            throw moerl::TimeoutError("bootstrap store: key '" + key + "' did not appear within " +
                                          std::to_string(timeout.count()) + " ms (" + e.what() + ")",
                                      __FILE__, __LINE__);
        }
    }

  private:
    py::object store_;
};

at::ScalarType scalar_type(ep::DType t) { return t == ep::DType::kFloat32 ? at::kFloat : at::kBFloat16; }

// The checks the library cannot make on a void pointer: dtype, rank 2, contiguity and device.
void check_tensor(const at::Tensor& t, const char* what, at::ScalarType dtype, bool on_device) {
    MOERL_CHECK(t.defined(), what, " is required");
    MOERL_CHECK(t.scalar_type() == dtype, what, " is ", c10::toString(t.scalar_type()), ", expected ",
                c10::toString(dtype));
    MOERL_CHECK(t.dim() == 2, what, " has ", t.dim(), " dimensions, expected 2");
    MOERL_CHECK(t.is_contiguous(), what, " is not contiguous");
    MOERL_CHECK(t.is_cuda() == on_device, what, " is on ", t.device().str(), ", but this EP buffer reads ",
                on_device ? "CUDA" : "CPU", " memory");
}

template <typename T>
ep::View<const T> cview(const at::Tensor& t) {
    if (!t.defined()) return {};
    return {static_cast<const T*>(t.data_ptr()), t.size(0), t.size(1)};
}

at::Tensor int_tensor(const std::vector<int>& v) {
    at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kInt);
    std::copy(v.begin(), v.end(), t.data_ptr<int>());
    return t;
}

// Sets the EP stream of the calling thread for one call (cuda and nccl transports).
class StreamScope {
  public:
    explicit StreamScope([[maybe_unused]] uintptr_t stream) {
#ifdef MOERL_HAVE_CUDA
        guard_.emplace(reinterpret_cast<cudaStream_t>(stream));
#endif
    }

  private:
#ifdef MOERL_HAVE_CUDA
    std::optional<ep::cuda::StreamGuard> guard_;
#endif
};

// What torch.cuda.synchronize() does, for the native timing loop.
void synchronize_device([[maybe_unused]] bool on_device) {
#ifdef MOERL_HAVE_CUDA
    if (on_device) MOERL_CHECK(cudaDeviceSynchronize() == cudaSuccess, "cudaDeviceSynchronize failed");
#endif
}

// The raw handle of the current CUDA stream of t's device (0 for a CPU tensor), as
// torch.cuda.current_stream(t.device).cuda_stream gives it, without a Python call. Empty where this
// build cannot ask (a torch without c10_cuda): the caller passes the stream itself then.
std::optional<uintptr_t> current_stream(const at::Tensor& t) {
    if (!t.is_cuda()) return 0;
#ifdef MOERL_TORCH_CUDA
    return reinterpret_cast<uintptr_t>(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(t.get_device())).stream());
#else
    return std::nullopt;
#endif
}

// `bytes` of memory on `like`'s device. On the current CUDA device straight from the caching
// allocator (what at::empty ends in, without the dispatcher and the device guard on the way).
at::Tensor byte_block(const at::Tensor& like, int64_t bytes) {
#ifdef MOERL_TORCH_CUDA
    if (like.is_cuda() && like.get_device() == c10::cuda::current_device()) {
        return at::detail::empty_generic({bytes}, c10::cuda::CUDACachingAllocator::get(),
                                         c10::DispatchKeySet(c10::DispatchKey::CUDA), at::kByte, {});
    }
#endif
    return at::empty({bytes}, like.options().dtype(at::kByte));
}

// The memory of one call's outputs, used again by the next call of the same kind once the caller
// holds none of them (nothing else owns the storage) and that call runs on the same stream, so every
// earlier use on that stream is ordered before the reuse, as with the caching allocator's own reuse.
// An inference loop drops a dispatch's outputs before the next one; each call then skips the
// allocator's malloc and free (a few microseconds on CUDA).
class OutputMemory {
  public:
    at::Tensor take(const at::Tensor& like, int64_t bytes, uintptr_t stream) {
        const bool reusable = block_.defined() && block_.storage().use_count() == 1 && stream == stream_ &&
                              bytes <= block_.numel() && block_.device() == like.device();
        if (!reusable) {
            block_ = byte_block(like, bytes);
            stream_ = stream;
        }
        return block_;
    }

  private:
    at::Tensor block_;
    uintptr_t stream_ = 0;
};

// One call's outputs carved from one allocation. On CUDA each at::empty costs microseconds (the
// dispatcher, the caching allocator, a device guard); a dispatch returns up to four tensors. The
// parts are plain tensors over one storage, each 256-byte aligned, sized and shrunk without going
// through the dispatcher.
struct Part {
    at::ScalarType dtype;
    int64_t rows, cols;
};

std::vector<at::Tensor> carve(const at::Tensor& like, std::initializer_list<Part> parts, OutputMemory& memory,
                              uintptr_t stream) {
    constexpr int64_t kAlign = 256;
    std::vector<int64_t> offsets;
    int64_t bytes = 0;
    for (const Part& p : parts) {
        offsets.push_back(bytes);
        bytes += (p.rows * p.cols * static_cast<int64_t>(c10::elementSize(p.dtype)) + kAlign - 1) / kAlign *
                 kAlign;
    }
    const at::Tensor block = memory.take(like, std::max<int64_t>(bytes, 1), stream);
    std::vector<at::Tensor> out;
    out.reserve(parts.size());
    size_t i = 0;
    for (const Part& p : parts) {
        at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
            c10::Storage(block.storage()), block.key_set(), c10::scalarTypeToTypeMeta(p.dtype));
        t.unsafeGetTensorImpl()->set_storage_offset(offsets[i++] /
                                                    static_cast<int64_t>(c10::elementSize(p.dtype)));
        t.unsafeGetTensorImpl()->set_sizes_contiguous({p.rows, p.cols});
        out.push_back(std::move(t));
    }
    return out;
}

// Keeps the first `rows` rows of a carved part (its storage stays; no dispatcher call).
void shrink_rows(at::Tensor& t, int64_t rows) {
    if (t.defined()) t.unsafeGetTensorImpl()->set_sizes_contiguous({rows, t.size(1)});
}

struct PyHandle {
    ep::Handle h;
    int world_size = 0;
};

struct PyLowLatencyHandle {
    ep::LowLatencyHandle h;
    int world_size = 0;
    int rows_per_expert = 0;
};

class Engine {
  public:
    Engine(const ep::Config& config, py::object store) : store_(std::make_unique<PyStore>(std::move(store))) {
        py::gil_scoped_release nogil;
        buffer_ = std::make_unique<ep::Buffer>(config, store_.get());
    }
    ~Engine() {
        py::gil_scoped_release nogil;
        buffer_.reset();
    }

    const ep::Config& config() const { return buffer_->config(); }
    bool on_device() const { return alive().on_device(); }
    std::string transport_name() const { return alive().transport_name(); }

    // x [T, H] of the config's dtype, topk_idx [T, K] int64 (optional with a handle), topk_weights [T, K]
    // fp32 (optional). Returns recv_x [R, H] (fp8_dispatch: uint8 e4m3 bits), recv_x_scales [R, H/128],
    // recv_topk_idx and recv_topk_weights [R, K] (when asked for) and the handle.
    py::tuple dispatch(const at::Tensor& x, const std::optional<at::Tensor>& topk_idx,
                       const std::optional<at::Tensor>& topk_weights, std::shared_ptr<PyHandle> reuse,
                       bool want_topk, uintptr_t stream) {
        const ep::Buffer& b = alive();
        const ep::Config& c = b.config();
        const bool dev = b.on_device();
        check_tensor(x, "dispatch: x", scalar_type(c.dtype), dev);
        at::Tensor idx = topk_idx ? *topk_idx : at::Tensor(), w = topk_weights ? *topk_weights : at::Tensor();
        if (idx.defined()) check_tensor(idx, "dispatch: topk_idx", at::kLong, dev);
        if (w.defined()) check_tensor(w, "dispatch: topk_weights", at::kFloat, dev);
        Dispatched d = run_dispatch(x, idx, w, reuse.get(), want_topk, stream);
        auto none_if_undefined = [](const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
        return py::make_tuple(d.recv_x, none_if_undefined(d.recv_scales), none_if_undefined(d.recv_idx),
                              none_if_undefined(d.recv_w), d.handle);
    }

    // Whether x can go into this engine's dispatch or combine as it is: the engine is alive, and x of
    // the config's dtype and hidden size, rank 2, contiguous, on the engine's side of the bus.
    bool accepts(const at::Tensor& x) const {
        if (buffer_ == nullptr) return false;
        const ep::Config& c = buffer_->config();
        return x.dim() == 2 && x.scalar_type() == scalar_type(c.dtype) && x.size(1) == c.hidden &&
               !c.fp8_dispatch && x.is_cuda() == buffer_->on_device() && x.is_contiguous();
    }

    struct Dispatched {
        at::Tensor recv_x, recv_scales, recv_idx, recv_w;
        std::shared_ptr<PyHandle> handle;
    };

    // The dispatch itself, on tensors already checked.
    Dispatched run_dispatch(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                            const PyHandle* reuse, bool want_topk, uintptr_t stream) {
        ep::Buffer& b = alive();
        const ep::Config& c = b.config();
        const int64_t H = c.hidden, K = c.top_k;
        // At least one row: the library takes no null recv_x, even when nothing arrives.
        const int64_t rows = reuse ? std::max(reuse->h.num_recv_tokens(), 1) : c.max_recv_tokens();
        // recv_x (fp8: e4m3 bytes), then the fp8 scales and the top-k ids and weights when asked for.
        const at::ScalarType x_type = c.fp8_dispatch ? at::kByte : x.scalar_type();
        const int64_t scale_cols = c.fp8_dispatch ? H / ep::kFp8BlockCols : 0, topk_cols = want_topk ? K : 0;
        std::vector<at::Tensor> parts = carve(x,
                                              {{x_type, rows, H},
                                               {at::kFloat, rows, scale_cols},
                                               {at::kLong, rows, topk_cols},
                                               {at::kFloat, rows, topk_cols}},
                                              dispatched_, stream);
        Dispatched d;
        d.recv_x = parts[0];
        if (c.fp8_dispatch) d.recv_scales = parts[1];
        if (want_topk) d.recv_idx = parts[2], d.recv_w = parts[3];
        ep::DispatchOutput out;
        out.recv_x = {d.recv_x.data_ptr(), rows, H};
        if (c.fp8_dispatch)
            out.recv_x_scales = {d.recv_scales.data_ptr<float>(), rows, H / ep::kFp8BlockCols};
        if (want_topk) {
            out.recv_topk_idx = {d.recv_idx.data_ptr<int64_t>(), rows, K};
            out.recv_topk_weights = {d.recv_w.data_ptr<float>(), rows, K};
        }
        d.handle = std::make_shared<PyHandle>();
        d.handle->world_size = c.world_size;
        {
            py::gil_scoped_release nogil;
            StreamScope scope(stream);
            d.handle->h = b.dispatch({x.data_ptr(), x.size(0), x.size(1)}, cview<int64_t>(idx),
                                     cview<float>(w), out, reuse ? &reuse->h : nullptr);
        }
        const int64_t R = d.handle->h.num_recv_tokens();
        for (at::Tensor* t : {&d.recv_x, &d.recv_scales, &d.recv_idx, &d.recv_w}) shrink_rows(*t, R);
        return d;
    }

    // y [R, H] of the config's dtype -> [T, H]: the sum over ranks of the rows sent back.
    at::Tensor combine(const at::Tensor& y, const PyHandle& handle, uintptr_t stream) {
        ep::Buffer& b = alive();
        const ep::Config& c = b.config();
        check_tensor(y, "combine: y", scalar_type(c.dtype), b.on_device());
        MOERL_CHECK(y.size(0) == handle.h.num_recv_tokens(), "combine: y has ", y.size(0),
                    " rows, but the handle received ", handle.h.num_recv_tokens());
        at::Tensor out = carve(y, {{y.scalar_type(), handle.h.num_tokens, c.hidden}}, combined_, stream)[0];
        py::gil_scoped_release nogil;
        StreamScope scope(stream);
        b.combine({y.data_ptr(), y.size(0), y.size(1)}, handle.h, {out.data_ptr(), out.size(0), out.size(1)});
        return out;
    }

    // combine() on the current stream of y's device, or None when y is not as this engine takes it
    // as it is (buffer.py's general path then converts it or raises).
    py::object combine_current(const at::Tensor& y, const PyHandle& handle) {
        if (!accepts(y)) return py::none();
        const std::optional<uintptr_t> stream = current_stream(y);
        if (!stream) return py::none();
        return py::cast(combine(y, handle, *stream));
    }

    // x [T, H], topk_idx [T, K]; writes recv_x [L * W*maxT, H] (and recv_x_scales with fp8_dispatch) and
    // recv_count [L] int32, all given by the caller (fixed buffers). Returns the handle.
    std::shared_ptr<PyLowLatencyHandle> low_latency_dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                                             const at::Tensor& recv_x,
                                                             const std::optional<at::Tensor>& recv_x_scales,
                                                             const at::Tensor& recv_count, uintptr_t stream) {
        ep::Buffer& b = alive();
        const ep::Config& c = b.config();
        const bool dev = b.on_device();
        check_tensor(x, "low_latency_dispatch: x", scalar_type(c.dtype), dev);
        check_tensor(topk_idx, "low_latency_dispatch: topk_idx", at::kLong, dev);
        check_tensor(recv_x, "low_latency_dispatch: recv_x",
                     c.fp8_dispatch ? at::kByte : scalar_type(c.dtype), dev);
        MOERL_CHECK(recv_count.scalar_type() == at::kInt && recv_count.numel() == c.num_local_experts() &&
                        recv_count.is_cuda() == dev && recv_count.is_contiguous(),
                    "low_latency_dispatch: recv_count must be int32 [", c.num_local_experts(), "]");
        ep::LowLatencyOutput out;
        out.recv_x = {recv_x.data_ptr(), recv_x.size(0), recv_x.size(1)};
        if (c.fp8_dispatch) {
            MOERL_CHECK(recv_x_scales.has_value(), "low_latency_dispatch: fp8 needs recv_x_scales");
            check_tensor(*recv_x_scales, "low_latency_dispatch: recv_x_scales", at::kFloat, dev);
            out.recv_x_scales = {recv_x_scales->data_ptr<float>(), recv_x_scales->size(0),
                                 recv_x_scales->size(1)};
        }
        out.recv_count = recv_count.data_ptr<int>();
        auto handle = std::make_shared<PyLowLatencyHandle>();
        handle->world_size = c.world_size;
        handle->rows_per_expert = c.low_latency_rows_per_expert();
        py::gil_scoped_release nogil;
        StreamScope scope(stream);
        handle->h =
            b.low_latency_dispatch({x.data_ptr(), x.size(0), x.size(1)}, cview<int64_t>(topk_idx), out);
        return handle;
    }

    // y [L * W*maxT, H]; out [T, H] = the top-k weighted sum of each token's expert outputs.
    void low_latency_combine(const at::Tensor& y, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                             const PyLowLatencyHandle& handle, const at::Tensor& out, uintptr_t stream) {
        ep::Buffer& b = alive();
        const ep::Config& c = b.config();
        const bool dev = b.on_device();
        check_tensor(y, "low_latency_combine: y", scalar_type(c.dtype), dev);
        check_tensor(topk_idx, "low_latency_combine: topk_idx", at::kLong, dev);
        check_tensor(topk_weights, "low_latency_combine: topk_weights", at::kFloat, dev);
        check_tensor(out, "low_latency_combine: out", scalar_type(c.dtype), dev);
        py::gil_scoped_release nogil;
        StreamScope scope(stream);
        b.low_latency_combine({y.data_ptr(), y.size(0), y.size(1)}, cview<int64_t>(topk_idx),
                              cview<float>(topk_weights), handle.h,
                              {out.data_ptr(), out.size(0), out.size(1)});
    }

    // The C++ API called in a loop with outputs allocated once: the baseline of
    // bench/python_overhead.py. Returns the median microseconds of (dispatch, combine, the
    // synchronisation alone). On a device each call is followed by a device synchronisation, as the
    // Python side's calls are (its loop calls torch.cuda.synchronize()); the third figure is that
    // synchronisation on an idle device, the C++ loop's own cost, which the benchmark takes off.
    py::tuple time_native(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                          int iters) {
        ep::Buffer& b = alive();
        const ep::Config& c = b.config();
        const bool dev = b.on_device();
        check_tensor(x, "x", scalar_type(c.dtype), dev);
        const int64_t rows = c.max_recv_tokens(), H = c.hidden, K = c.top_k;
        at::Tensor recv_x = at::empty({rows, H}, x.options()),
                   recv_idx = at::empty({rows, K}, x.options().dtype(at::kLong)),
                   recv_w = at::empty({rows, K}, x.options().dtype(at::kFloat)), out = at::empty_like(x);
        ep::DispatchOutput o;
        o.recv_x = {recv_x.data_ptr(), rows, H};
        o.recv_topk_idx = {recv_idx.data_ptr<int64_t>(), rows, K};
        o.recv_topk_weights = {recv_w.data_ptr<float>(), rows, K};
        std::vector<double> td, tc, ts;
        py::gil_scoped_release nogil;
        using clock = std::chrono::steady_clock;
        for (int i = 0; i < iters; ++i) {
            auto t0 = clock::now();
            ep::Handle h = b.dispatch({x.data_ptr(), x.size(0), H}, cview<int64_t>(topk_idx),
                                      cview<float>(topk_weights), o);
            synchronize_device(dev);
            auto t1 = clock::now();
            b.combine({recv_x.data_ptr(), h.num_recv_tokens(), H}, h, {out.data_ptr(), x.size(0), H});
            synchronize_device(dev);
            auto t2 = clock::now();
            synchronize_device(dev);
            auto t3 = clock::now();
            td.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
            tc.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
            ts.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
        }
        auto median = [](std::vector<double>& v) {
            std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
            return v.empty() ? 0.0 : v[v.size() / 2];
        };
        py::gil_scoped_acquire gil;
        return py::make_tuple(median(td), median(tc), median(ts));
    }

    void destroy() {
        py::gil_scoped_release nogil;
        if (buffer_) buffer_->destroy();
        buffer_.reset();
    }

  private:
    ep::Buffer& alive() const {
        MOERL_CHECK(buffer_ != nullptr, "EP buffer used after destroy()");
        return *buffer_;
    }
    std::unique_ptr<PyStore> store_;      // outlives buffer_ (declared first)
    OutputMemory dispatched_, combined_;  // the last dispatch's and combine's outputs
    std::unique_ptr<ep::Buffer> buffer_;
};

// The normal-mode engines of one moerl_ep.Buffer, for its common dispatch: top-k ids given, no handle,
// tensors as the engine takes them. buffer.py builds the engines and adds each here under its key
// ('normal', hidden, dtype, top_k, num_experts); dispatch() finds the engine in C++ and makes the
// whole call, so such a dispatch is one extension call instead of a dozen small Python steps.
class NormalEngines {
  public:
    void add(py::object key, py::object engine) {
        Entry e{key, engine, &engine.cast<Engine&>()};
        entries_.push_back(std::move(e));
    }
    void clear() { entries_.clear(); }

    // (recv_x, recv_topk_idx, recv_topk_weights or None without topk_weights, received tokens per
    // local expert as a list, the native handle, the engine's key), or None when no engine takes these
    // tensors as they are; buffer.py's general path then handles (or rejects) the call.
    py::object dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                        const std::optional<at::Tensor>& topk_weights,
                        const at::Tensor& num_tokens_per_expert) {
        if (topk_idx.dim() != 2 || topk_idx.scalar_type() != at::kLong || !topk_idx.is_contiguous())
            return py::none();
        const at::Tensor w = topk_weights ? *topk_weights : at::Tensor();
        if (w.defined() && (w.scalar_type() != at::kFloat || !w.is_contiguous() || w.dim() != 2))
            return py::none();
        const Entry* e = find(x, topk_idx.size(1), num_tokens_per_expert.numel());
        if (e == nullptr || topk_idx.is_cuda() != x.is_cuda() || (w.defined() && w.is_cuda() != x.is_cuda()))
            return py::none();
        const std::optional<uintptr_t> stream = current_stream(x);
        if (!stream) return py::none();
        Engine::Dispatched d = e->engine->run_dispatch(x, topk_idx, w, nullptr, true, *stream);
        return py::make_tuple(d.recv_x, d.recv_idx, w.defined() ? py::cast(d.recv_w) : py::none(),
                              d.handle->h.num_recv_tokens_per_expert, d.handle, e->key);
    }

  private:
    struct Entry {
        py::object key, owner;  // owner keeps engine alive
        Engine* engine;
    };
    const Entry* find(const at::Tensor& x, int64_t top_k, int64_t num_experts) const {
        for (const Entry& e : entries_) {
            if (!e.engine->accepts(x)) continue;
            const ep::Config& c = e.engine->config();
            if (c.top_k == top_k && c.num_experts == num_experts) return &e;
        }
        return nullptr;
    }
    std::vector<Entry> entries_;
};

// Tokens per rank [W] and per expert [E] (int32) and is_token_in_rank [T, W] (bool) of topk_idx.
py::tuple layout(const at::Tensor& topk_idx, int num_experts, int world_size) {
    check_tensor(topk_idx, "get_dispatch_layout: topk_idx", at::kLong, false);
    ep::Config c;
    c.world_size = world_size;
    c.num_experts = num_experts;
    c.top_k = static_cast<int>(topk_idx.size(1));
    c.max_tokens_per_rank = static_cast<int>(std::max<int64_t>(topk_idx.size(0), 1));
    MOERL_CHECK(world_size >= 1 && num_experts >= world_size,
                "get_dispatch_layout: num_experts = ", num_experts, ", expected >= the group's ", world_size,
                " ranks");
    ep::Layout l;
    {
        py::gil_scoped_release nogil;
        l = ep::compute_layout(c, cview<int64_t>(topk_idx));
    }
    at::Tensor in_rank = at::empty({topk_idx.size(0), world_size}, at::kBool);
    std::copy(l.is_token_in_rank.begin(), l.is_token_in_rank.end(), in_rank.data_ptr<bool>());
    return py::make_tuple(int_tensor(l.num_tokens_per_rank), int_tensor(l.num_tokens_per_expert), in_rank);
}

// layout() for topk_idx on a CUDA device: one kernel on `stream`, then one read of its verdict on the
// ids (the only synchronisation), returned after the three tensors as the first entry t * K + k out
// of range (-1: none) and its id, for the caller to raise as the CPU layout does.
py::tuple layout_on_device([[maybe_unused]] const at::Tensor& topk_idx, [[maybe_unused]] int num_experts,
                           [[maybe_unused]] int world_size, [[maybe_unused]] uintptr_t stream) {
#ifndef MOERL_HAVE_CUDA
    MOERL_FAIL("get_dispatch_layout: topk_idx is on ", topk_idx.device().str(),
               ", but moerl_ep was built without CUDA");
#else
    check_tensor(topk_idx, "get_dispatch_layout: topk_idx", at::kLong, true);
    MOERL_CHECK(world_size >= 1 && world_size <= ep::cuda::kMaxRanks && num_experts >= world_size,
                "get_dispatch_layout: num_experts = ", num_experts, " over ", world_size,
                " ranks, expected 1..", ep::cuda::kMaxRanks, " ranks and at least one expert each");
    const int64_t T = topk_idx.size(0), K = topk_idx.size(1);
    MOERL_CHECK(T * K < ep::cuda::kTopkLayoutNoBadEntry, "get_dispatch_layout: topk_idx has ", T, " x ", K,
                " entries, too many to count");
    at::Tensor counts = at::empty({world_size + num_experts + 1}, topk_idx.options().dtype(at::kInt));
    at::Tensor in_rank = at::empty({T, world_size}, topk_idx.options().dtype(at::kBool));
    ep::cuda::TopkLayoutArgs a{};
    a.topk_idx = topk_idx.data_ptr<int64_t>();
    a.num_tokens = static_cast<int>(T);
    a.top_k = static_cast<int>(K);
    a.num_experts = num_experts;
    a.world = world_size;
    a.counts = counts.data_ptr<int>();
    a.in_rank = in_rank.data_ptr<bool>();
    int bad = 0;
    {
        py::gil_scoped_release nogil;
        const auto s = reinterpret_cast<cudaStream_t>(stream);
        ep::cuda::launch_topk_layout(a, s);
        MOERL_CHECK(
            cudaMemcpyAsync(&bad, a.counts + world_size + num_experts, sizeof bad, cudaMemcpyDeviceToHost,
                            s) == cudaSuccess &&
                cudaStreamSynchronize(s) == cudaSuccess,
            "get_dispatch_layout: the layout kernel failed: ", cudaGetErrorString(cudaGetLastError()));
    }
    // The first entry out of range (-1: none) and its id, raised by the caller.
    int64_t value = 0;
    if (bad != ep::cuda::kTopkLayoutNoBadEntry)
        MOERL_CHECK(cudaMemcpy(&value, a.topk_idx + bad, sizeof value, cudaMemcpyDeviceToHost) == cudaSuccess,
                    "get_dispatch_layout: reading topk_idx failed");
    else
        bad = -1;
    return py::make_tuple(counts.narrow(0, 0, world_size), counts.narrow(0, world_size, num_experts), in_rank,
                          bad, value);
#endif
}

ep::DType parse_torch_dtype(const std::string& name) { return ep::parse_dtype(name); }

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "moerl's expert-parallel library (include/moerl/ep); use moerl_ep.Buffer";

    // Leaked on purpose: the translator may run until the interpreter is gone.
    PyObject* error = PyErr_NewException("moerl_ep._C.Error", PyExc_RuntimeError, nullptr);
    // TimeoutError is both moerl_ep.Error and the builtin TimeoutError.
    PyObject* timeout_error =
        PyErr_NewException("moerl_ep._C.TimeoutError",
                           py::make_tuple(py::handle(error), py::handle(PyExc_TimeoutError)).ptr(), nullptr);
    m.attr("Error") = py::handle(error);
    m.attr("TimeoutError") = py::handle(timeout_error);
    static PyObject* error_type = error;
    static PyObject* timeout_type = timeout_error;
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const moerl::TimeoutError& e) {
            PyErr_SetString(timeout_type, e.what());
        } catch (const moerl::Error& e) {
            PyErr_SetString(error_type, e.what());
        }
    });

    py::class_<ep::Config>(m, "EngineConfig", "moerl::ep::Config (include/moerl/ep/config.hpp)")
        .def(py::init<>())
        .def_readwrite("world_size", &ep::Config::world_size)
        .def_readwrite("rank", &ep::Config::rank)
        .def_readwrite("num_experts", &ep::Config::num_experts)
        .def_readwrite("hidden", &ep::Config::hidden)
        .def_readwrite("top_k", &ep::Config::top_k)
        .def_readwrite("max_tokens_per_rank", &ep::Config::max_tokens_per_rank)
        .def_property(
            "dtype", [](const ep::Config& c) { return ep::dtype_name(c.dtype); },
            [](ep::Config& c, const std::string& s) { c.dtype = parse_torch_dtype(s); })
        .def_readwrite("fp8_dispatch", &ep::Config::fp8_dispatch)
        .def_property(
            "transport", [](const ep::Config& c) { return c.transport; },
            [](ep::Config& c, const std::string& s) { c.set_transport(s); })
        .def_readwrite("fabric_provider", &ep::Config::fabric_provider)
        .def_readwrite("fabric_domain", &ep::Config::fabric_domain)
        .def_readwrite("low_latency", &ep::Config::low_latency)
        .def_readwrite("timeout_s", &ep::Config::timeout_s)
        .def_readwrite("job_id", &ep::Config::job_id)
        .def_readwrite("num_sms", &ep::Config::num_sms)
        .def_readwrite("device", &ep::Config::device)
        .def_readwrite("async_", &ep::Config::async)
        .def("validate", &ep::Config::validate)
        .def("num_local_experts", &ep::Config::num_local_experts)
        .def("max_recv_tokens", &ep::Config::max_recv_tokens)
        .def("low_latency_rows_per_expert", &ep::Config::low_latency_rows_per_expert)
        .def("normal_bytes_hint", &ep::Config::normal_bytes_hint)
        .def("low_latency_bytes_hint", &ep::Config::low_latency_bytes_hint);

    py::class_<PyHandle, std::shared_ptr<PyHandle>>(m, "Handle", "where each dispatched row came from")
        .def_property_readonly("num_tokens", [](const PyHandle& h) { return h.h.num_tokens; })
        .def_property_readonly("num_recv_tokens", [](const PyHandle& h) { return h.h.num_recv_tokens(); })
        .def_property_readonly("num_recv_per_src",
                               [](const PyHandle& h) { return int_tensor(h.h.num_recv_per_src); })
        .def_property_readonly("num_send_per_rank",
                               [](const PyHandle& h) { return int_tensor(h.h.num_send_per_rank); })
        .def_property_readonly("recv_src_token",
                               [](const PyHandle& h) { return int_tensor(h.h.recv_src_token); })
        .def_property_readonly("send_pos",
                               [](const PyHandle& h) {
                                   return int_tensor(h.h.send_pos).view({h.h.num_tokens, h.world_size});
                               })
        .def_property_readonly("num_recv_tokens_per_expert",
                               [](const PyHandle& h) { return h.h.num_recv_tokens_per_expert; });

    py::class_<PyLowLatencyHandle, std::shared_ptr<PyLowLatencyHandle>>(m, "LowLatencyHandle")
        .def_property_readonly("num_tokens", [](const PyLowLatencyHandle& h) { return h.h.num_tokens; })
        .def_property_readonly("recv_count",
                               [](const PyLowLatencyHandle& h) { return int_tensor(h.h.recv_count); })
        // [L, W*maxT] source token of each row, -1 past the count.
        .def_property_readonly("recv_src_token",
                               [](const PyLowLatencyHandle& h) {
                                   return int_tensor(h.h.recv_src_token).view({-1, h.rows_per_expert});
                               })
        // [L, W] (first row << 32) | count, DeepEP's packed_recv_layout_range.
        .def_property_readonly("recv_layout_range", [](const PyLowLatencyHandle& h) {
            const int64_t n = static_cast<int64_t>(h.h.recv_range.size()) / 2;
            at::Tensor t = at::empty({n}, at::kLong);
            for (int64_t i = 0; i < n; ++i)
                t.data_ptr<int64_t>()[i] = (static_cast<int64_t>(h.h.recv_range[2 * i]) << 32) |
                                           static_cast<uint32_t>(h.h.recv_range[2 * i + 1]);
            return t.view({-1, h.world_size});
        });

    py::class_<Engine>(m, "Engine", "one moerl::ep::Buffer; construction and every call are collective")
        .def(py::init<const ep::Config&, py::object>(), py::arg("config"), py::arg("store"))
        .def_property_readonly("config", &Engine::config)
        .def_property_readonly("on_device", &Engine::on_device)
        .def_property_readonly("transport_name", &Engine::transport_name)
        .def("dispatch", &Engine::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
             py::arg("handle"), py::arg("want_topk"), py::arg("stream") = 0)
        .def("combine", &Engine::combine, py::arg("y"), py::arg("handle"), py::arg("stream") = 0)
        .def("combine_current", &Engine::combine_current, py::arg("y"), py::arg("handle"))
        .def("low_latency_dispatch", &Engine::low_latency_dispatch, py::arg("x"), py::arg("topk_idx"),
             py::arg("recv_x"), py::arg("recv_x_scales"), py::arg("recv_count"), py::arg("stream") = 0)
        .def("low_latency_combine", &Engine::low_latency_combine, py::arg("y"), py::arg("topk_idx"),
             py::arg("topk_weights"), py::arg("handle"), py::arg("out"), py::arg("stream") = 0)
        .def("time_native", &Engine::time_native)
        .def("destroy", &Engine::destroy);

    py::class_<NormalEngines>(m, "NormalEngines", "a Buffer's normal-mode engines, for its common dispatch")
        .def(py::init<>())
        .def("add", &NormalEngines::add, py::arg("key"), py::arg("engine"))
        .def("clear", &NormalEngines::clear)
        .def("dispatch", &NormalEngines::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
             py::arg("num_tokens_per_expert"));

    m.def("layout", &layout, py::arg("topk_idx"), py::arg("num_experts"), py::arg("world_size"));
    m.def("layout_on_device", &layout_on_device, py::arg("topk_idx"), py::arg("num_experts"),
          py::arg("world_size"), py::arg("stream"));
    m.def("available_transports", &ep::available_transports);
#ifdef MOERL_HAVE_CUDA
    m.attr("has_cuda") = true;
#else
    m.attr("has_cuda") = false;
#endif
}
