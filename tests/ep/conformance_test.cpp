// EP conformance suite: every transport against the reference semantics of the EP contract
// (docs/architecture.md).
// Ranks are forked processes; inputs are regenerated from the run seed on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "mismatches.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/ep/transport.hpp"
#include "ranks.hpp"
#include "reference.hpp"

namespace moerl::test {
namespace {

struct Case {
    std::string transport;  // "host", "fabric/tcp", "fabric/shm", "proxy+" any of them
    int world;
    ep::DType dtype;
    int num_experts;
    int top_k;
    bool fp8 = false;
    bool crowd = false;  // every token of every rank names expert 0 in all entries (crowd_one_expert)
};

void PrintTo(const Case& c, std::ostream* os) {
    *os << c.transport << " world=" << c.world << " " << ep::dtype_name(c.dtype) << (c.fp8 ? "+fp8" : "")
        << " experts=" << c.num_experts << " top_k=" << c.top_k << (c.crowd ? " crowd" : "");
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
    const Case& c = info.param;
    std::string t = c.transport;
    for (char& ch : t)
        if (ch == '/' || ch == '+') ch = '_';
    return t + "_w" + std::to_string(c.world) + "_" + ep::dtype_name(c.dtype) + (c.fp8 ? "_fp8" : "") + "_e" +
           std::to_string(c.num_experts) + "_k" + std::to_string(c.top_k) + (c.crowd ? "_crowd" : "");
}

ep::Config make_config(const Case& tc, int rank, const std::string& job) {
    ep::Config c;
    c.world_size = tc.world;
    c.rank = rank;
    c.num_experts = tc.num_experts;
    c.hidden = tc.fp8 ? 256 : 72;
    c.top_k = tc.top_k;
    c.max_tokens_per_rank = 40;
    c.dtype = tc.dtype;
    c.fp8_dispatch = tc.fp8;
    c.timeout_s = 20;
    c.job_id = job;
    c.set_transport(tc.transport);
    return c;
}

float dequant(const ep::Config& c, const uint8_t* row, const float* scales, int j) {
    if (!c.fp8_dispatch) return ep::load_as_float(row, j, c.dtype);
    return ep::e4m3_to_float(row[j]) * scales[j / ep::kFp8BlockCols];
}

bool close(const ep::Config& c, float got, float want, float scale_ref) {
    if (c.fp8_dispatch) return std::fabs(got - want) <= 0.07f * std::fabs(want) + scale_ref / 448.0f;
    return std::fabs(got - want) <= test::tolerance(c.dtype) * (std::fabs(want) + 1e-3f);
}

float block_amax(const ep::Config& c, const RankInput& in, int t, int j) {
    float amax = 0;
    int b = j / ep::kFp8BlockCols;
    for (int i = b * ep::kFp8BlockCols; i < (b + 1) * ep::kFp8BlockCols; ++i)
        amax = std::max(amax, std::fabs(x_at(c, in, t, i)));
    return amax;
}

// The whole normal-mode and low-latency contract, run on one rank.
void conformance(const Case& tc, int rank, uint64_t seed, const std::string& store_dir) {
    const ep::Config c = make_config(tc, rank, "conf");
    auto store = ep::make_file_store(store_dir);
    ep::Buffer buffer(c, store.get());
    const int W = c.world_size, K = c.top_k, H = c.hidden, L = c.num_local_experts();
    const int zero_rank = W > 1 ? W - 1 : -1;
    std::vector<RankInput> all;
    for (int r = 0; r < W; ++r) {
        all.push_back(make_input(c, seed, r, zero_rank));
        if (tc.crowd) crowd_one_expert(c, all.back(), r, 0);
    }
    const RankInput& in = all[rank];
    const int T = in.num_tokens;
    const size_t out_row = c.fp8_dispatch ? H : H * c.element_bytes();

    // layout() against the reference.
    ep::Layout layout = buffer.layout(idx_view(c, in));
    {
        Mismatches m("layout");
        for (int r = 0; r < W; ++r) {
            int n = 0;
            for (int t = 0; t < T; ++t) {
                bool in_r = token_in_rank(c, in, t, r);
                n += in_r;
                m.expect(layout.is_token_in_rank[t * W + r] == in_r, "is_token_in_rank");
            }
            m.expect(layout.num_tokens_per_rank[r] == n, "num_tokens_per_rank[" + std::to_string(r) + "]");
        }
        for (int e = 0; e < c.num_experts; ++e) {
            int n = 0;
            for (int64_t v : in.topk_idx) n += v == e;
            m.expect(layout.num_tokens_per_expert[e] == n,
                     "num_tokens_per_expert[" + std::to_string(e) + "]");
        }
        m.done();
    }

    // Expected received rows: by source rank, then source token.
    struct Row {
        int src, t;
    };
    std::vector<Row> expected;
    for (int s = 0; s < W; ++s)
        for (int t = 0; t < all[s].num_tokens; ++t)
            if (token_in_rank(c, all[s], t, rank)) expected.push_back({s, t});
    const int R = static_cast<int>(expected.size());

    const int max_recv = c.max_recv_tokens();
    const int nb = H / ep::kFp8BlockCols;
    std::vector<uint8_t> recv_x(static_cast<size_t>(max_recv) * out_row, 0xAB);  // poisoned
    std::vector<float> recv_scales(static_cast<size_t>(max_recv) * std::max(nb, 1), -7.0f);
    std::vector<int64_t> recv_idx(static_cast<size_t>(max_recv) * K, 12345);
    std::vector<float> recv_w(static_cast<size_t>(max_recv) * K, -9.0f);
    ep::DispatchOutput out{{recv_x.data(), max_recv, H},
                           {recv_scales.data(), max_recv, nb},
                           {recv_idx.data(), max_recv, K},
                           {recv_w.data(), max_recv, K}};
    ep::Handle h = buffer.dispatch(x_view(c, in), idx_view(c, in), weights_view(c, in), out);

    auto check_dispatch = [&](const char* what) {
        Mismatches m(std::string(what) + " (rank " + std::to_string(rank) + ")");
        m.expect(h.num_recv_tokens() == R,
                 "received " + std::to_string(h.num_recv_tokens()) + " rows, expected " + std::to_string(R));
        if (h.num_recv_tokens() != R) m.done();
        for (int s = 0; s < W; ++s) {
            int n = 0;
            for (auto& e : expected) n += e.src == s;
            m.expect(h.num_recv_per_src[s] == n, "num_recv_per_src[" + std::to_string(s) + "]");
        }
        for (int l = 0; l < L; ++l) {
            int n = 0;
            const int e = c.first_local_expert(rank) + l;
            for (int s = 0; s < W; ++s)
                for (int64_t v : all[s].topk_idx) n += v == e;
            m.expect(h.num_recv_tokens_per_expert[l] == n,
                     "num_recv_tokens_per_expert[" + std::to_string(l) + "]");
        }
        for (int i = 0; i < R; ++i) {
            const RankInput& src = all[expected[i].src];
            const int t = expected[i].t;
            const std::string where = "row " + std::to_string(i) + " (from rank " +
                                      std::to_string(expected[i].src) + " token " + std::to_string(t) + ")";
            m.expect(h.recv_src_token[i] == t, where + ": recv_src_token");
            const uint8_t* row = recv_x.data() + static_cast<size_t>(i) * out_row;
            if (!c.fp8_dispatch) {
                m.expect(std::memcmp(row, src.x.data() + static_cast<size_t>(t) * out_row, out_row) == 0,
                         where + ": data differs");
            } else {
                for (int j = 0; j < H; ++j)
                    m.expect(close(c, dequant(c, row, &recv_scales[static_cast<size_t>(i) * nb], j),
                                   x_at(c, src, t, j), block_amax(c, src, t, j)),
                             where + " col " + std::to_string(j));
            }
            for (int k = 0; k < K; ++k) {
                const int64_t e = src.topk_idx[static_cast<size_t>(t) * K + k];
                const bool mine = e >= 0 && c.expert_owner(static_cast<int>(e)) == rank;
                const int64_t want = mine ? e - c.first_local_expert(rank) : -1;
                m.expect(recv_idx[static_cast<size_t>(i) * K + k] == want,
                         where + ": topk id k=" + std::to_string(k));
                const float want_w = mine ? src.topk_weights[static_cast<size_t>(t) * K + k] : 0.0f;
                m.expect(recv_w[static_cast<size_t>(i) * K + k] == want_w,
                         where + ": weight k=" + std::to_string(k));
            }
        }
        m.done();
    };
    check_dispatch("dispatch");

    // A reused handle reproduces the result (outputs poisoned again first).
    std::fill(recv_x.begin(), recv_x.end(), 0xCD);
    std::fill(recv_idx.begin(), recv_idx.end(), 777);
    h = buffer.dispatch(x_view(c, in), idx_view(c, in), weights_view(c, in), out, &h);
    check_dispatch("dispatch with a reused handle");

    // combine(dispatch(x)) == x * number of ranks each token reached; with weights, the weighted sum.
    if (!c.fp8_dispatch) {
        for (bool weighted : {false, true}) {
            std::vector<uint8_t> y(static_cast<size_t>(std::max(R, 1)) * out_row);
            for (int i = 0; i < R; ++i) {
                float scale = 1.0f;
                if (weighted) {
                    scale = 0.0f;
                    for (int k = 0; k < K; ++k) scale += recv_w[static_cast<size_t>(i) * K + k];
                }
                for (int j = 0; j < H; ++j)
                    ep::store_from_float(y.data() + static_cast<size_t>(i) * out_row, j,
                                         scale * ep::load_as_float(recv_x.data() + i * out_row, j, c.dtype),
                                         c.dtype);
            }
            std::vector<uint8_t> combined(static_cast<size_t>(std::max(T, 1)) * out_row, 0xEE);
            buffer.combine({y.data(), R, H}, h, {combined.data(), T, H});
            Mismatches m(std::string(weighted ? "weighted " : "") + "combine (rank " + std::to_string(rank) +
                         ")");
            for (int t = 0; t < T; ++t) {
                float factor = 0.0f;
                for (int r = 0; r < W; ++r) {
                    if (!token_in_rank(c, in, t, r)) continue;
                    if (!weighted) {
                        factor += 1.0f;
                        continue;
                    }
                    for (int k = 0; k < K; ++k) {
                        int64_t e = in.topk_idx[static_cast<size_t>(t) * K + k];
                        if (e >= 0 && c.expert_owner(static_cast<int>(e)) == r)
                            factor += in.topk_weights[static_cast<size_t>(t) * K + k];
                    }
                }
                for (int j = 0; j < H; ++j) {
                    const float got =
                        ep::load_as_float(combined.data() + static_cast<size_t>(t) * out_row, j, c.dtype);
                    const float want = factor * x_at(c, in, t, j);
                    const float tol = weighted ? 3 * tolerance(c.dtype) : tolerance(c.dtype);
                    m.expect(std::fabs(got - want) <= tol * (std::fabs(want) + 1e-2f),
                             "token " + std::to_string(t) + " col " + std::to_string(j) + ": got " +
                                 std::to_string(got) + ", want " + std::to_string(want));
                }
            }
            m.done();
        }
    }

    // Low-latency: expert-major rows, then the top-k weighted sum.
    const int rows_per_expert = c.low_latency_rows_per_expert();
    const int ll_rows = L * rows_per_expert;
    std::vector<uint8_t> ll_x(static_cast<size_t>(ll_rows) * out_row, 0x5A);
    std::vector<float> ll_scales(static_cast<size_t>(ll_rows) * std::max(nb, 1), -3.0f);
    std::vector<int> ll_count(L, -1);
    ep::LowLatencyOutput ll_out{{ll_x.data(), ll_rows, H}, {ll_scales.data(), ll_rows, nb}, ll_count.data()};
    ep::LowLatencyHandle lh = buffer.low_latency_dispatch(x_view(c, in), idx_view(c, in), ll_out);
    {
        Mismatches m("low_latency_dispatch (rank " + std::to_string(rank) + ")");
        for (int l = 0; l < L; ++l) {
            const int e = c.first_local_expert(rank) + l;
            int i = 0;
            for (int s = 0; s < W; ++s)
                for (int t = 0; t < all[s].num_tokens; ++t) {
                    // once per token, however many of its entries name e
                    const int64_t* ids = all[s].topk_idx.data() + static_cast<size_t>(t) * K;
                    if (std::find(ids, ids + K, e) == ids + K) continue;
                    const size_t row_idx = static_cast<size_t>(l) * rows_per_expert + i;
                    const std::string where = "expert " + std::to_string(l) + " row " + std::to_string(i);
                    m.expect(lh.recv_src_token[row_idx] == t, where + ": source token");
                    const uint8_t* row = ll_x.data() + row_idx * out_row;
                    if (!c.fp8_dispatch)
                        m.expect(std::memcmp(row, all[s].x.data() + static_cast<size_t>(t) * out_row,
                                             out_row) == 0,
                                 where + ": data differs");
                    else
                        for (int j = 0; j < H; ++j)
                            m.expect(close(c, dequant(c, row, &ll_scales[row_idx * nb], j),
                                           x_at(c, all[s], t, j), block_amax(c, all[s], t, j)),
                                     where + " col " + std::to_string(j));
                    ++i;
                }
            m.expect(ll_count[l] == i, "recv_count[" + std::to_string(l) + "] = " +
                                           std::to_string(ll_count[l]) + ", expected " + std::to_string(i));
        }
        m.done();
    }
    if (!c.fp8_dispatch) {
        std::vector<uint8_t> combined(static_cast<size_t>(std::max(T, 1)) * out_row, 0x11);
        buffer.low_latency_combine({ll_x.data(), ll_rows, H}, idx_view(c, in), weights_view(c, in), lh,
                                   {combined.data(), T, H});
        Mismatches m("low_latency_combine (rank " + std::to_string(rank) + ")");
        for (int t = 0; t < T; ++t) {
            float wsum = 0;
            for (int k = 0; k < K; ++k)
                if (in.topk_idx[static_cast<size_t>(t) * K + k] >= 0)
                    wsum += in.topk_weights[static_cast<size_t>(t) * K + k];
            for (int j = 0; j < H; ++j) {
                const float got =
                    ep::load_as_float(combined.data() + static_cast<size_t>(t) * out_row, j, c.dtype);
                const float want = wsum * x_at(c, in, t, j);
                m.expect(std::fabs(got - want) <= 3 * tolerance(c.dtype) * (std::fabs(want) + 1e-2f),
                         "token " + std::to_string(t) + " col " + std::to_string(j));
            }
        }
        m.done();
    }
    buffer.destroy();
}

class Conformance : public testing::TestWithParam<Case> {};

TEST_P(Conformance, MatchesReference) {
    const Case tc = GetParam();
    if (!ep::has_transport(tc.transport.substr(0, tc.transport.find('/'))))
        GTEST_SKIP() << "transport " << tc.transport << " not built";
    const uint64_t seed = std::random_device{}();
    const std::string dir = unique_dir("conf");
    auto results = run_ranks(tc.world, [&](int rank) { conformance(tc, rank, seed, dir); });
    for (int r = 0; r < tc.world; ++r) {
        if (results[r].message.find("no provider") != std::string::npos) GTEST_SKIP() << results[r].message;
        EXPECT_EQ(results[r].exit_code, 0)
            << "rank " << r << " (seed " << seed << "): " << results[r].message;
    }
    std::filesystem::remove_all(dir);
}

std::vector<Case> cases() {
    std::vector<Case> out;
    std::vector<std::string> transports = {"host", "fabric/tcp", "fabric/shm"};
    for (const auto& tr : transports) {
        for (ep::DType dt : {ep::DType::kFloat32, ep::DType::kBFloat16}) {
            out.push_back({tr, 2, dt, 8, 4});
            out.push_back({tr, 3, dt, 10, 3});  // 10 experts over 3 ranks: 4, 4, 2
            out.push_back({tr, 4, dt, 16, 8});
        }
        out.push_back({tr, 3, ep::DType::kBFloat16, 12, 4, true});
    }
    out.push_back({"host", 1, ep::DType::kFloat32, 4, 2});
    // One expert gets every token of every rank, each token naming it top_k times.
    out.push_back({"host", 2, ep::DType::kBFloat16, 8, 4, false, true});
    out.push_back({"host", 1, ep::DType::kBFloat16, 16, 8, true, true});
    out.push_back({"fabric/tcp", 3, ep::DType::kFloat32, 6, 3, false, true});
    // Every write, signal and quiet queued through a write proxy, as kernels between nodes reach the
    // NIC (proxied_transport.cpp).
    out.push_back({"proxy+host", 2, ep::DType::kBFloat16, 8, 4});
    out.push_back({"proxy+host", 4, ep::DType::kFloat32, 16, 8});
    out.push_back({"proxy+fabric/tcp", 3, ep::DType::kBFloat16, 10, 3});
    out.push_back({"proxy+fabric/tcp", 2, ep::DType::kBFloat16, 12, 4, true});
    out.push_back({"proxy+fabric/shm", 4, ep::DType::kFloat32, 16, 8});
    out.push_back({"proxy+fabric/tcp", 3, ep::DType::kFloat32, 6, 3, false, true});
    return out;
}

INSTANTIATE_TEST_SUITE_P(Transports, Conformance, testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace moerl::test
