// The host engine: dispatch and combine computed on the CPU, bytes moved by any Transport.
// This is the reference every other engine is tested against.
//
// Protocol per channel c, per call (epoch e, the same on every rank since calls are collective):
//   1. before writing into peer p's receive slot, wait until p has signalled ready(c) e-1 times
//      (it has consumed the previous call's data);
//   2. pack rows into p's slot (directly when the transport maps peers, else into the local send
//      slot followed by write()); the data signal counts as one message per (c, source);
//   3. wait for e data messages from every source, unpack, then signal ready(c) to every peer.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "builtin.hpp"
#include "moerl/core/error.hpp"

namespace moerl::ep {

namespace {

enum Channel : int {
    kCount = 0,
    kDispatch = 1,
    kCombine = 2,
    kLowLatencyDispatch = 3,
    kLowLatencyCombine = 4
};
constexpr int kReadyBase = 8;  // ready(c) is channel kReadyBase + c
constexpr int kUsedChannels = 5;

size_t align16(size_t n) { return (n + 15) & ~size_t{15}; }

// Whether a token's top-k ids name expert e (low-latency mode sends a token once to each such expert).
bool names_expert(const int64_t* ids, int K, int64_t e) { return std::find(ids, ids + K, e) != ids + K; }

// acc[j] += w * row[j]; the dtype branch sits outside the loop so it vectorizes.
void accumulate_row(float* acc, const std::byte* row, int n, DType t, float w) {
    if (t == DType::kFloat32) {
        const auto* v = reinterpret_cast<const float*>(row);
        for (int j = 0; j < n; ++j) acc[j] += w * v[j];
    } else {
        const auto* v = reinterpret_cast<const uint16_t*>(row);
        for (int j = 0; j < n; ++j) acc[j] += w * bf16_to_float(v[j]);
    }
}

void store_row(std::byte* dst, const float* acc, int n, DType t) {
    if (t == DType::kFloat32) {
        std::memcpy(dst, acc, n * sizeof(float));
    } else {
        auto* v = reinterpret_cast<uint16_t*>(dst);
        for (int j = 0; j < n; ++j) v[j] = float_to_bf16(acc[j]);
    }
}

// Byte layout of the symmetric region: per channel, W receive slots then W send slots.
struct RegionLayout {
    size_t slot_bytes[kUsedChannels] = {};
    size_t recv_base[kUsedChannels] = {};
    size_t send_base[kUsedChannels] = {};
    size_t total = 0;

    RegionLayout(const Config& c) {
        const size_t ll_rows = c.low_latency ? static_cast<size_t>(c.max_tokens_per_rank) * c.top_k : 0;
        slot_bytes[kCount] = align16((1 + c.num_local_experts()) * sizeof(int32_t));
        slot_bytes[kDispatch] = c.max_tokens_per_rank * c.dispatch_row_bytes();
        slot_bytes[kCombine] = c.max_tokens_per_rank * c.combine_row_bytes();
        slot_bytes[kLowLatencyDispatch] = c.low_latency ? align16(c.num_local_experts() * sizeof(int32_t)) +
                                                              ll_rows * c.dispatch_row_bytes()
                                                        : 0;
        slot_bytes[kLowLatencyCombine] = ll_rows * c.combine_row_bytes();
        for (int ch = 0; ch < kUsedChannels; ++ch) {
            recv_base[ch] = total;
            total += slot_bytes[ch] * c.world_size;
            send_base[ch] = total;
            total += slot_bytes[ch] * c.world_size;
        }
    }
};

// Field offsets inside one dispatched row: data | scales | K int32 ids | K fp32 weights | int32 token.
struct RowLayout {
    size_t data_bytes, scales_off, ids_off, weights_off, token_off;
    RowLayout(const Config& c) {
        data_bytes = c.fp8_dispatch ? c.hidden : c.hidden * c.element_bytes();
        scales_off = data_bytes;
        ids_off = scales_off + (c.fp8_dispatch ? (c.hidden / kFp8BlockCols) * sizeof(float) : 0);
        weights_off = ids_off + c.top_k * sizeof(int32_t);
        token_off = weights_off + c.top_k * sizeof(float);
    }
};

class HostEngine final : public Engine {
  public:
    HostEngine(const Config& config, Store* store) : c_(config), region_(config), row_(config) {
        TransportOptions o;
        o.rank = c_.rank;
        o.world_size = c_.world_size;
        o.region_bytes = region_.total;
        o.job_id = c_.job_id;
        o.fabric_provider = c_.fabric_provider;
        o.fabric_domain = c_.fabric_domain;
        o.fabric_chunk_bytes = c_.fabric_chunk_bytes;
        o.timeout_s = c_.timeout_s;
        o.store = store;
        t_ = make_transport(c_.transport, o);
    }

    ~HostEngine() override {
        try {
            destroy();
        } catch (...) {
        }
    }

    std::string name() const override { return t_ ? t_->name() : c_.transport; }
    bool on_device() const override { return false; }

    void destroy() override {
        if (t_) t_->destroy();
        t_.reset();
    }

    Handle dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                    const DispatchOutput& out, const Handle* reuse) override {
        const int W = c_.world_size, L = c_.num_local_experts(), K = c_.top_k;
        const int T = static_cast<int>(x.rows);
        const auto* idx = topk_idx.data;
        Handle h;
        if (reuse != nullptr) {
            MOERL_CHECK(reuse->num_tokens == T, "dispatch: the reused handle was made for ",
                        reuse->num_tokens, " tokens, but x has ", T, " rows");
            h = *reuse;
        } else {
            h.num_tokens = T;
            h.num_send_per_rank.assign(W, 0);
            h.send_pos.assign(static_cast<size_t>(T) * W, -1);
            std::vector<int> per_expert(static_cast<size_t>(W) * L, 0);
            for (int t = 0; t < T; ++t) {
                for (int k = 0; k < K; ++k) {
                    int64_t e = idx[static_cast<size_t>(t) * K + k];
                    if (e < 0) continue;
                    int r = c_.expert_owner(static_cast<int>(e));
                    per_expert[static_cast<size_t>(r) * L + (e - c_.first_local_expert(r))]++;
                    int& pos = h.send_pos[static_cast<size_t>(t) * W + r];
                    if (pos < 0) pos = h.num_send_per_rank[r]++;
                }
            }
            h.num_recv_per_src.assign(W, 0);
            h.num_recv_tokens_per_expert.assign(L, 0);
            // Count exchange: [tokens for you, tokens per your local expert].
            exchange(
                kCount, "dispatch/notify",
                [&](int p, std::byte* slot) {
                    auto* v = reinterpret_cast<int32_t*>(slot);
                    v[0] = h.num_send_per_rank[p];
                    for (int l = 0; l < L; ++l) v[1 + l] = per_expert[static_cast<size_t>(p) * L + l];
                    return region_.slot_bytes[kCount];
                },
                [&](int src, const std::byte* slot) {
                    auto* v = reinterpret_cast<const int32_t*>(slot);
                    h.num_recv_per_src[src] = v[0];
                    for (int l = 0; l < L; ++l) h.num_recv_tokens_per_expert[l] += v[1 + l];
                });
            h.recv_src_offset.assign(W + 1, 0);
            for (int r = 0; r < W; ++r)
                h.recv_src_offset[r + 1] = h.recv_src_offset[r] + h.num_recv_per_src[r];
            h.recv_src_token.assign(h.num_recv_tokens(), -1);
        }
        const int R = h.num_recv_tokens();
        MOERL_CHECK(out.recv_x.rows >= R, "dispatch: recv_x has ", out.recv_x.rows, " rows, but ", R,
                    " arrive");
        const size_t row_bytes = c_.dispatch_row_bytes();
        exchange(
            kDispatch, "dispatch/data",
            [&](int p, std::byte* slot) {
                for (int t = 0; t < T; ++t) {
                    int pos = h.send_pos[static_cast<size_t>(t) * W + p];
                    if (pos < 0) continue;
                    pack_row(slot + pos * row_bytes, x.data, t, idx, topk_weights.data);
                }
                return static_cast<size_t>(h.num_send_per_rank[p]) * row_bytes;
            },
            [&](int src, const std::byte* slot) {
                for (int i = 0; i < h.num_recv_per_src[src]; ++i) {
                    int row = h.recv_src_offset[src] + i;
                    unpack_row(slot + i * row_bytes, row, out, &h.recv_src_token[row]);
                }
            });
        return h;
    }

    void combine(View<const void> y, const Handle& h, View<void> out) override {
        const int W = c_.world_size, H = c_.hidden;
        const int T = h.num_tokens;
        MOERL_CHECK(y.rows >= h.num_recv_tokens(), "combine: y has ", y.rows,
                    " rows, but the handle received ", h.num_recv_tokens());
        MOERL_CHECK(out.rows >= T, "combine: out has ", out.rows, " rows, but the handle dispatched ", T,
                    " tokens");
        const size_t row_bytes = c_.combine_row_bytes();
        const size_t elem_row = H * c_.element_bytes();
        std::vector<float> acc(static_cast<size_t>(T) * H, 0.0f);
        exchange(
            kCombine, "combine/data",
            [&](int p, std::byte* slot) {
                const auto* src = static_cast<const std::byte*>(y.data) + h.recv_src_offset[p] * elem_row;
                for (int i = 0; i < h.num_recv_per_src[p]; ++i)
                    std::memcpy(slot + i * row_bytes, src + i * elem_row, elem_row);
                return static_cast<size_t>(h.num_recv_per_src[p]) * row_bytes;
            },
            [&](int src, const std::byte* slot) {
                for (int t = 0; t < T; ++t) {
                    int pos = h.send_pos[static_cast<size_t>(t) * W + src];
                    if (pos < 0) continue;
                    accumulate_row(acc.data() + static_cast<size_t>(t) * H, slot + pos * row_bytes, H,
                                   c_.dtype, 1.0f);
                }
            });
        // Sources are accumulated in rank order, so the sum is the same on every transport.
        for (int t = 0; t < T; ++t)
            store_row(static_cast<std::byte*>(out.data) + t * elem_row,
                      acc.data() + static_cast<size_t>(t) * H, H, c_.dtype);
    }

    LowLatencyHandle low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                          const LowLatencyOutput& out) override {
        const int W = c_.world_size, L = c_.num_local_experts(), K = c_.top_k;
        const int T = static_cast<int>(x.rows);
        const int rows_per_expert = c_.low_latency_rows_per_expert();
        const size_t row_bytes = c_.dispatch_row_bytes();
        const size_t header = align16(L * sizeof(int32_t));
        LowLatencyHandle h;
        h.num_tokens = T;
        h.topk_idx.assign(topk_idx.data, topk_idx.data + static_cast<size_t>(T) * K);
        h.recv_count.assign(L, 0);
        h.recv_range.assign(static_cast<size_t>(L) * W * 2, 0);
        h.recv_src_token.assign(static_cast<size_t>(L) * rows_per_expert, -1);
        DispatchOutput rows_out;
        rows_out.recv_x = out.recv_x;
        rows_out.recv_x_scales = out.recv_x_scales;
        exchange(
            kLowLatencyDispatch, "low_latency_dispatch/data",
            [&](int p, std::byte* slot) {
                auto* counts = reinterpret_cast<int32_t*>(slot);
                std::byte* rows = slot + header;
                int n = 0;
                for (int l = 0; l < L; ++l) {
                    const int64_t e = c_.first_local_expert(p) + l;
                    counts[l] = 0;
                    for (int t = 0; t < T; ++t)
                        if (names_expert(h.topk_idx.data() + static_cast<size_t>(t) * K, K, e)) {
                            pack_row(rows + n++ * row_bytes, x.data, t, nullptr, nullptr);
                            counts[l]++;
                        }
                }
                return header + n * row_bytes;
            },
            [&](int src, const std::byte* slot) {
                const auto* counts = reinterpret_cast<const int32_t*>(slot);
                const std::byte* rows = slot + header;
                for (int l = 0; l < L; ++l) {
                    int* range = &h.recv_range[(static_cast<size_t>(l) * W + src) * 2];
                    range[0] = h.recv_count[l];
                    range[1] = counts[l];
                    for (int i = 0; i < counts[l]; ++i) {
                        int row = l * rows_per_expert + h.recv_count[l]++;
                        unpack_row(rows, row, rows_out, &h.recv_src_token[row]);
                        rows += row_bytes;
                    }
                }
            });
        if (out.recv_count != nullptr) std::copy(h.recv_count.begin(), h.recv_count.end(), out.recv_count);
        return h;
    }

    void low_latency_combine(View<const void> y, View<const int64_t> /*topk_idx*/,
                             View<const float> topk_weights, const LowLatencyHandle& h,
                             View<void> out) override {
        const int W = c_.world_size, L = c_.num_local_experts(), K = c_.top_k, H = c_.hidden;
        const int T = h.num_tokens;
        const int rows_per_expert = c_.low_latency_rows_per_expert();
        const size_t row_bytes = c_.combine_row_bytes();
        const size_t elem_row = H * c_.element_bytes();
        std::vector<float> acc(static_cast<size_t>(T) * H, 0.0f);
        exchange(
            kLowLatencyCombine, "low_latency_combine/data",
            [&](int p, std::byte* slot) {
                int n = 0;
                for (int l = 0; l < L; ++l) {
                    const int* range = &h.recv_range[(static_cast<size_t>(l) * W + p) * 2];
                    const auto* src = static_cast<const std::byte*>(y.data) +
                                      (static_cast<size_t>(l) * rows_per_expert + range[0]) * elem_row;
                    for (int i = 0; i < range[1]; ++i)
                        std::memcpy(slot + n++ * row_bytes, src + i * elem_row, elem_row);
                }
                return n * row_bytes;
            },
            [&](int src, const std::byte* slot) {
                // Rows come back in the order this rank sent them: expert, then token; every entry k
                // that names the expert adds the token's one row with its own weight.
                int n = 0;
                for (int l = 0; l < L; ++l) {
                    const int64_t e = c_.first_local_expert(src) + l;
                    for (int t = 0; t < T; ++t) {
                        const int64_t* ids = h.topk_idx.data() + static_cast<size_t>(t) * K;
                        if (!names_expert(ids, K, e)) continue;
                        const std::byte* row = slot + n++ * row_bytes;
                        for (int k = 0; k < K; ++k) {
                            if (ids[k] != e) continue;
                            const float w =
                                topk_weights.data ? topk_weights.data[static_cast<size_t>(t) * K + k] : 1.0f;
                            accumulate_row(acc.data() + static_cast<size_t>(t) * H, row, H, c_.dtype, w);
                        }
                    }
                }
            });
        for (int t = 0; t < T; ++t)
            store_row(static_cast<std::byte*>(out.data) + t * elem_row,
                      acc.data() + static_cast<size_t>(t) * H, H, c_.dtype);
    }

  private:
    // One collective step on a channel: pack(p, slot) -> bytes for every peer, then unpack(src, slot)
    // for every source in rank order.
    template <typename Pack, typename Unpack>
    void exchange(int ch, const char* phase, Pack&& pack, Unpack&& unpack) {
        const int W = c_.world_size, me = c_.rank;
        const uint64_t epoch = ++epoch_[ch];
        const auto deadline =
            Clock::now() + std::chrono::milliseconds(static_cast<long>(c_.timeout_s * 1000));
        std::byte* local = t_->region();
        const size_t slot = region_.slot_bytes[ch];
        for (int i = 1; i <= W; ++i) {
            const int p = (me + i) % W;  // self last; spreads traffic over peers
            if (p == me) {
                size_t n = pack(p, local + region_.recv_base[ch] + me * slot);
                check_slot(n, slot, phase);
                continue;
            }
            t_->wait(kReadyBase + ch, p, epoch - 1, deadline, phase);
            if (std::byte* peer = t_->peer_region(p)) {
                size_t n = pack(p, peer + region_.recv_base[ch] + me * slot);
                check_slot(n, slot, phase);
                t_->signal(p, ch);
            } else {
                const size_t src_off = region_.send_base[ch] + p * slot;
                size_t n = pack(p, local + src_off);
                check_slot(n, slot, phase);
                t_->write(p, src_off, region_.recv_base[ch] + me * slot, n, ch);
            }
        }
        for (int src = 0; src < W; ++src) {
            if (src != me) t_->wait(ch, src, epoch, deadline, phase);
            unpack(src, local + region_.recv_base[ch] + src * slot);
        }
        t_->quiet();
        for (int p = 0; p < W; ++p)
            if (p != me) t_->signal(p, kReadyBase + ch);
    }

    static void check_slot(size_t n, size_t slot, const char* phase) {
        MOERL_CHECK(n <= slot, phase, ": ", n, " bytes do not fit the ", slot, "-byte receive slot");
    }

    void pack_row(std::byte* row, const void* x, int t, const int64_t* idx, const float* weights) const {
        const int H = c_.hidden, K = c_.top_k;
        const auto* src = static_cast<const std::byte*>(x) + static_cast<size_t>(t) * H * c_.element_bytes();
        if (c_.fp8_dispatch) {
            auto* q = reinterpret_cast<uint8_t*>(row);
            auto* scales = reinterpret_cast<float*>(row + row_.scales_off);
            for (int b = 0; b < H / kFp8BlockCols; ++b) {
                float amax = 0.0f;
                for (int j = b * kFp8BlockCols; j < (b + 1) * kFp8BlockCols; ++j)
                    amax = std::max(amax, std::fabs(load_as_float(src, j, c_.dtype)));
                const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
                scales[b] = scale;
                for (int j = b * kFp8BlockCols; j < (b + 1) * kFp8BlockCols; ++j)
                    q[j] = float_to_e4m3(load_as_float(src, j, c_.dtype) / scale);
            }
        } else {
            std::memcpy(row, src, row_.data_bytes);
        }
        auto* ids = reinterpret_cast<int32_t*>(row + row_.ids_off);
        auto* w = reinterpret_cast<float*>(row + row_.weights_off);
        for (int k = 0; k < K; ++k) {
            ids[k] = idx ? static_cast<int32_t>(idx[static_cast<size_t>(t) * K + k]) : -1;
            w[k] = weights ? weights[static_cast<size_t>(t) * K + k] : 0.0f;
        }
        *reinterpret_cast<int32_t*>(row + row_.token_off) = t;
    }

    void unpack_row(const std::byte* row, int dst_row, const DispatchOutput& out, int* src_token) const {
        const int K = c_.top_k, L = c_.num_local_experts();
        std::memcpy(static_cast<std::byte*>(out.recv_x.data) + static_cast<size_t>(dst_row) * row_.data_bytes,
                    row, row_.data_bytes);
        if (c_.fp8_dispatch && out.recv_x_scales.data) {
            const int nb = c_.hidden / kFp8BlockCols;
            std::memcpy(out.recv_x_scales.data + static_cast<size_t>(dst_row) * nb, row + row_.scales_off,
                        nb * sizeof(float));
        }
        const auto* ids = reinterpret_cast<const int32_t*>(row + row_.ids_off);
        const auto* w = reinterpret_cast<const float*>(row + row_.weights_off);
        const int first = c_.first_local_expert(c_.rank);
        for (int k = 0; k < K; ++k) {
            const int local = ids[k] - first;
            const bool mine = ids[k] >= 0 && local >= 0 && local < L;
            if (out.recv_topk_idx.data)
                out.recv_topk_idx.data[static_cast<size_t>(dst_row) * K + k] = mine ? local : -1;
            if (out.recv_topk_weights.data)
                out.recv_topk_weights.data[static_cast<size_t>(dst_row) * K + k] = mine ? w[k] : 0.0f;
        }
        *src_token = *reinterpret_cast<const int32_t*>(row + row_.token_off);
    }

    Config c_;
    RegionLayout region_;
    RowLayout row_;
    std::unique_ptr<Transport> t_;
    uint64_t epoch_[kUsedChannels] = {};
};

}  // namespace

std::unique_ptr<Engine> make_host_engine(const Config& config, Store* store) {
    return std::make_unique<HostEngine>(config, store);
}

}  // namespace moerl::ep
