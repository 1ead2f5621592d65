#include "moerl/ep/buffer.hpp"

#include <map>
#include <mutex>

#include "engine.hpp"
#include "moerl/core/error.hpp"
#ifdef MOERL_HAVE_CUDA
#include "cuda/stream.hpp"
#endif

namespace moerl::ep {

namespace {

// Buffers are created collectively in the same order on every rank, so (job, rank, n-th buffer)
// names the same group everywhere; a fresh namespace per buffer keeps stale bootstrap keys of an
// earlier buffer from being read.
// Only buffers that were set up count, so a rank whose construction failed stays in step.
std::mutex instance_mu;
std::map<std::pair<std::string, int>, int> instance_counts;  // GUARDED_BY(instance_mu)

std::string instance_id(const std::string& job, int rank) {
    std::lock_guard lock(instance_mu);
    return job + "/ep" + std::to_string(instance_counts[{job, rank}]);
}

void count_instance(const std::string& job, int rank) {
    std::lock_guard lock(instance_mu);
    instance_counts[{job, rank}]++;
}

}  // namespace

void check_rows(const Config&, const char* what, int64_t rows, int64_t cols, int64_t max_rows,
                int64_t expect_cols) {
    MOERL_CHECK(rows >= 0 && rows <= max_rows, what, " has ", rows, " rows, but at most ", max_rows,
                " are allowed (Config.max_tokens_per_rank)");
    MOERL_CHECK(cols == expect_cols, what, " has ", cols, " columns, expected ", expect_cols);
}

void check_topk(const Config& c, View<const int64_t> topk_idx) {
    for (int64_t t = 0; t < topk_idx.rows; ++t)
        for (int64_t k = 0; k < topk_idx.cols; ++k) {
            const int64_t e = topk_idx.data[t * topk_idx.cols + k];
            MOERL_CHECK(e >= -1 && e < c.num_experts, "topk_idx[", t, ",", k, "] = ", e,
                        ", but num_experts = ", c.num_experts, " (valid: -1..", c.num_experts - 1, ")");
        }
}

Buffer::Buffer(const Config& config, Store* store) : config_(config) {
    config_.validate();
    Config inner = config_;
    inner.job_id = instance_id(config_.job_id, config_.rank);
    engine_ = make_engine(inner, store);
    count_instance(config_.job_id, config_.rank);
}

Buffer::~Buffer() {
    try {
        destroy();
    } catch (...) {
    }
}

bool Buffer::on_device() const { return engine_ && engine_->on_device(); }
std::string Buffer::transport_name() const { return engine_ ? engine_->name() : config_.transport; }

#ifdef MOERL_HAVE_CUDA
DeviceStreamScope::DeviceStreamScope(void* stream) : previous_(cuda::current_stream()) {
    cuda::set_stream(static_cast<cudaStream_t>(stream));
}
DeviceStreamScope::~DeviceStreamScope() { cuda::set_stream(static_cast<cudaStream_t>(previous_)); }
#else
DeviceStreamScope::DeviceStreamScope(void*) {}
DeviceStreamScope::~DeviceStreamScope() = default;
#endif

void Buffer::destroy() {
    if (engine_) engine_->destroy();
    engine_.reset();
}

Layout Buffer::layout(View<const int64_t> topk_idx) const { return compute_layout(config_, topk_idx); }

Layout compute_layout(const Config& c, View<const int64_t> topk_idx) {
    check_rows(c, "topk_idx", topk_idx.rows, topk_idx.cols, c.max_tokens_per_rank, c.top_k);
    check_topk(c, topk_idx);
    const int W = c.world_size;
    Layout out;
    out.num_tokens_per_rank.assign(W, 0);
    out.num_tokens_per_expert.assign(c.num_experts, 0);
    out.is_token_in_rank.assign(topk_idx.rows * W, 0);
    for (int64_t t = 0; t < topk_idx.rows; ++t)
        for (int64_t k = 0; k < c.top_k; ++k) {
            const int64_t e = topk_idx.data[t * c.top_k + k];
            if (e < 0) continue;
            out.num_tokens_per_expert[e]++;
            uint8_t& in = out.is_token_in_rank[t * W + c.expert_owner(static_cast<int>(e))];
            if (!in) out.num_tokens_per_rank[c.expert_owner(static_cast<int>(e))]++;
            in = 1;
        }
    return out;
}

namespace {
void check_alive(const std::unique_ptr<Engine>& e) {
    MOERL_CHECK(e != nullptr, "EP buffer used after destroy()");
}
}  // namespace

Handle Buffer::dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                        const DispatchOutput& out, const Handle* reuse) {
    check_alive(engine_);
    const Config& c = config_;
    check_rows(c, "dispatch: x", x.rows, x.cols, c.max_tokens_per_rank, c.hidden);
    if (reuse == nullptr || topk_idx.data != nullptr) {
        MOERL_CHECK(topk_idx.data != nullptr || x.rows == 0,
                    "dispatch: topk_idx is required without a handle to reuse");
        check_rows(c, "dispatch: topk_idx", topk_idx.rows, topk_idx.cols, x.rows, c.top_k);
        MOERL_CHECK(topk_idx.rows == x.rows, "dispatch: topk_idx has ", topk_idx.rows, " rows but x has ",
                    x.rows);
        if (!engine_->on_device()) check_topk(c, topk_idx);
    }
    if (topk_weights.data != nullptr)
        MOERL_CHECK(topk_weights.rows == x.rows && topk_weights.cols == c.top_k,
                    "dispatch: topk_weights is [", topk_weights.rows, ",", topk_weights.cols, "], expected [",
                    x.rows, ",", c.top_k, "]");
    MOERL_CHECK(out.recv_x.data != nullptr, "dispatch: recv_x is required");
    MOERL_CHECK(out.recv_x.cols == c.hidden, "dispatch: recv_x has ", out.recv_x.cols, " columns, expected ",
                c.hidden);
    if (c.fp8_dispatch)
        MOERL_CHECK(out.recv_x_scales.data != nullptr && out.recv_x_scales.cols == c.hidden / kFp8BlockCols,
                    "dispatch: fp8_dispatch needs recv_x_scales with ", c.hidden / kFp8BlockCols, " columns");
    return engine_->dispatch(x, topk_idx, topk_weights, out, reuse);
}

void Buffer::combine(View<const void> y, const Handle& handle, View<void> out) {
    check_alive(engine_);
    MOERL_CHECK(y.cols == config_.hidden, "combine: y has ", y.cols, " columns, expected ", config_.hidden);
    MOERL_CHECK(out.cols == config_.hidden, "combine: out has ", out.cols, " columns, expected ",
                config_.hidden);
    MOERL_CHECK(static_cast<int>(handle.num_send_per_rank.size()) == config_.world_size,
                "combine: the handle is not from a dispatch of this buffer");
    engine_->combine(y, handle, out);
}

LowLatencyHandle Buffer::low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                              const LowLatencyOutput& out) {
    check_alive(engine_);
    const Config& c = config_;
    MOERL_CHECK(c.low_latency, "low_latency_dispatch: this buffer was made with Config.low_latency = false");
    check_rows(c, "low_latency_dispatch: x", x.rows, x.cols, c.max_tokens_per_rank, c.hidden);
    check_rows(c, "low_latency_dispatch: topk_idx", topk_idx.rows, topk_idx.cols, x.rows, c.top_k);
    MOERL_CHECK(topk_idx.rows == x.rows, "low_latency_dispatch: topk_idx has ", topk_idx.rows,
                " rows but x has ", x.rows);
    if (!engine_->on_device()) check_topk(c, topk_idx);
    const int64_t need = static_cast<int64_t>(c.num_local_experts()) * c.low_latency_rows_per_expert();
    MOERL_CHECK(out.recv_x.data != nullptr && out.recv_x.rows >= need && out.recv_x.cols == c.hidden,
                "low_latency_dispatch: recv_x is [", out.recv_x.rows, ",", out.recv_x.cols, "], expected [",
                need, ",", c.hidden, "] (local experts x world_size*max_tokens_per_rank rows)");
    if (c.fp8_dispatch)
        MOERL_CHECK(out.recv_x_scales.data != nullptr && out.recv_x_scales.rows >= need,
                    "low_latency_dispatch: fp8_dispatch needs recv_x_scales with ", need, " rows");
    return engine_->low_latency_dispatch(x, topk_idx, out);
}

void Buffer::low_latency_combine(View<const void> y, View<const int64_t> topk_idx,
                                 View<const float> topk_weights, const LowLatencyHandle& handle,
                                 View<void> out) {
    check_alive(engine_);
    const Config& c = config_;
    const int64_t need = static_cast<int64_t>(c.num_local_experts()) * c.low_latency_rows_per_expert();
    MOERL_CHECK(y.rows >= need && y.cols == c.hidden, "low_latency_combine: y is [", y.rows, ",", y.cols,
                "], expected [", need, ",", c.hidden, "]");
    MOERL_CHECK((topk_weights.data != nullptr || handle.num_tokens == 0) &&
                    topk_weights.rows == handle.num_tokens && topk_weights.cols == c.top_k,
                "low_latency_combine: topk_weights is [", topk_weights.rows, ",", topk_weights.cols,
                "], expected [", handle.num_tokens, ",", c.top_k, "]");
    MOERL_CHECK(out.rows >= handle.num_tokens && out.cols == c.hidden, "low_latency_combine: out is [",
                out.rows, ",", out.cols, "], expected [", handle.num_tokens, ",", c.hidden, "]");
    engine_->low_latency_combine(y, topk_idx, topk_weights, handle, out);
}

}  // namespace moerl::ep
