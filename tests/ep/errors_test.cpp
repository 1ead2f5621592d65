// Bad input and failing peers: a clear error on the calling rank, a timeout naming the peer and
// phase elsewhere, and a buffer that still works after rejected input.
#include <gtest/gtest.h>

#include <chrono>

#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "ranks.hpp"
#include "reference.hpp"

namespace moerl::test {
namespace {

ep::Config small_config(int world, int rank, double timeout_s = 2.0) {
    ep::Config c;
    c.world_size = world;
    c.rank = rank;
    c.num_experts = 8;
    c.hidden = 16;
    c.top_k = 2;
    c.max_tokens_per_rank = 8;
    c.dtype = ep::DType::kFloat32;
    c.timeout_s = timeout_s;
    c.job_id = "err";
    return c;
}

template <typename F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(Config, RejectsEachBadField) {
    auto c = small_config(2, 0);
    c.top_k = 0;
    EXPECT_NE(error_of([&] { c.validate(); }).find("Config.top_k = 0"), std::string::npos);
    c = small_config(2, 5);
    EXPECT_NE(error_of([&] { c.validate(); }).find("Config.rank = 5"), std::string::npos);
    c = small_config(4, 0);
    c.num_experts = 5;  // 2 per rank leaves rank 3 without experts
    EXPECT_NE(error_of([&] { c.validate(); }).find("leaves a rank without experts"), std::string::npos);
    c = small_config(2, 0);
    c.fp8_dispatch = true;
    EXPECT_NE(error_of([&] { c.validate(); }).find("fp8_dispatch needs dtype bf16"), std::string::npos);
    c = small_config(2, 0);
    c.device = -2;
    EXPECT_NE(error_of([&] { c.validate(); }).find("Config.device = -2"), std::string::npos);
    c = small_config(2, 0);
    c.fabric_chunk_bytes = 4;
    EXPECT_NE(error_of([&] { c.validate(); }).find("Config.fabric_chunk_bytes = 4"), std::string::npos);
    c = small_config(2, 0);
    EXPECT_NO_THROW(c.validate());
    EXPECT_GT(c.normal_bytes_hint(), 0u);
    EXPECT_GT(c.low_latency_bytes_hint(), 0u);
}

TEST(Transport, UnknownNameListsAvailable) {
    auto c = small_config(1, 0);
    c.transport = "carrier-pigeon";
    std::string msg = error_of([&] { ep::Buffer b(c, nullptr); });
    EXPECT_NE(msg.find("unknown EP transport 'carrier-pigeon'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("host"), std::string::npos) << msg;
}

// Every rank passes the same bad input: each gets the error, nothing was sent, and a valid
// dispatch afterwards still produces correct counts.
TEST(BadInput, RejectedBeforeAnyCommunication) {
    const std::string dir = unique_dir("bad");
    auto results = run_ranks(2, [&](int rank) {
        const auto c = small_config(2, rank, 10.0);
        auto store = ep::make_file_store(dir);
        ep::Buffer buffer(c, store.get());
        std::vector<float> x(16 * 16, 1.0f);
        std::vector<int64_t> idx(16 * 2, 0);
        std::vector<float> recv(2 * 8 * 16);
        ep::DispatchOutput out{{recv.data(), 16, 16}};
        auto expect_error = [&](auto&& f, const std::string& needle) {
            std::string msg = error_of(f);
            MOERL_CHECK(msg.find(needle) != std::string::npos, "expected an error containing '", needle,
                        "', got '", msg, "'");
        };
        idx[3] = 300;  // token 1, k = 1
        expect_error(
            [&] {
                buffer.dispatch({x.data(), 4, 16}, {idx.data(), 4, 2}, {}, out);
            },
            "topk_idx[1,1] = 300, but num_experts = 8");
        idx[3] = -2;
        expect_error([&] { buffer.layout({idx.data(), 4, 2}); }, "topk_idx[1,1] = -2");
        idx[3] = 0;
        expect_error(
            [&] {
                buffer.dispatch({x.data(), 12, 16}, {idx.data(), 12, 2}, {}, out);
            },
            "has 12 rows, but at most 8");
        expect_error(
            [&] {
                buffer.dispatch({x.data(), 4, 15}, {idx.data(), 4, 2}, {}, out);
            },
            "x has 15 columns, expected 16");
        expect_error(
            [&] {
                buffer.dispatch({x.data(), 4, 16}, {idx.data(), 4, 3}, {}, out);
            },
            "topk_idx has 3 columns, expected 2");
        expect_error(
            [&] {
                buffer.dispatch({x.data(), 4, 16}, {idx.data(), 3, 2}, {}, out);
            },
            "topk_idx has 3 rows");
        // Still usable: every token to expert 5 (rank 1).
        std::fill(idx.begin(), idx.end(), 5);
        ep::Handle h = buffer.dispatch({x.data(), 4, 16}, {idx.data(), 4, 2}, {}, out);
        MOERL_CHECK(h.num_recv_tokens() == (rank == 1 ? 8 : 0), "rank ", rank, " received ",
                    h.num_recv_tokens());
        MOERL_CHECK(rank == 0 || h.num_recv_tokens_per_expert[1] == 16, "expert 5 count ",
                    h.num_recv_tokens_per_expert[1]);
    });
    for (int r = 0; r < 2; ++r)
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].message;
}

// One rank passes an out-of-range id: it gets the error; its peer times out naming it.
TEST(BadInput, OneRankFailsPeerTimesOut) {
    const std::string dir = unique_dir("bad1");
    auto results = run_ranks(2, [&](int rank) {
        const auto c = small_config(2, rank, 1.5);
        auto store = ep::make_file_store(dir);
        ep::Buffer buffer(c, store.get());
        std::vector<float> x(8 * 16, 1.0f), recv(16 * 16);
        std::vector<int64_t> idx(8 * 2, 1);
        if (rank == 0) idx[0] = 8;
        ep::DispatchOutput out{{recv.data(), 16, 16}};
        buffer.dispatch({x.data(), 8, 16}, {idx.data(), 8, 2}, {}, out);
    });
    EXPECT_EQ(results[0].exit_code, 1);
    EXPECT_NE(results[0].message.find("topk_idx[0,0] = 8, but num_experts = 8"), std::string::npos)
        << results[0].message;
    EXPECT_EQ(results[1].exit_code, 1);
    EXPECT_NE(results[1].message.find("timed out in dispatch/notify waiting for rank 0"), std::string::npos)
        << results[1].message;
}

// A peer dies after setup: the survivors fail with a TimeoutError that names it and says it exited
// (the host transport looks at the peer's process while it waits), within the timeout.
TEST(Peers, DeadPeerIsNamed) {
    const std::string dir = unique_dir("dead");
    std::vector<double> seconds(3, 0.0);
    auto results = run_ranks(3, [&](int rank) {
        const auto c = small_config(3, rank, 1.0);
        auto store = ep::make_file_store(dir);
        ep::Buffer buffer(c, store.get());
        if (rank == 2) _exit(42);  // dies without a word
        std::vector<float> x(8 * 16, 1.0f), recv(24 * 16), y(24 * 16), out(8 * 16);
        std::vector<int64_t> idx(8 * 2, 0);
        ep::DispatchOutput o{{recv.data(), 24, 16}};
        const auto start = std::chrono::steady_clock::now();
        try {
            buffer.dispatch({x.data(), 8, 16}, {idx.data(), 8, 2}, {}, o);
        } catch (const TimeoutError& e) {
            double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            MOERL_CHECK(s < 3.0, "the timeout took ", s, " s, configured 1 s");
            throw;
        }
    });
    EXPECT_EQ(results[2].exit_code, 42);
    for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(results[r].exit_code, 1) << results[r].message;
        EXPECT_NE(results[r].message.find("waiting for rank 2"), std::string::npos) << results[r].message;
        EXPECT_NE(results[r].message.find("dispatch/"), std::string::npos) << results[r].message;
        EXPECT_NE(results[r].message.find("rank 2 (pid "), std::string::npos) << results[r].message;
        EXPECT_NE(results[r].message.find("has exited"), std::string::npos) << results[r].message;
    }
}

// A peer that never arrives: setup fails naming it.
TEST(Peers, MissingPeerIsNamed) {
    const std::string dir = unique_dir("missing");
    auto results = run_ranks(3, [&](int rank) {
        if (rank == 1) return;  // never joins
        const auto c = small_config(3, rank, 1.0);
        auto store = ep::make_file_store(dir);
        ep::Buffer buffer(c, store.get());
    });
    EXPECT_EQ(results[1].exit_code, 0);
    for (int r : {0, 2}) {
        EXPECT_EQ(results[r].exit_code, 1);
        EXPECT_NE(results[r].message.find("rank 1 never arrived"), std::string::npos) << results[r].message;
    }
}

TEST(Fp8, RoundTripWithinHalfUlp) {
    for (float v : {0.0f, 1.0f, -1.5f, 448.0f, 0.015625f, 3.3f, -200.0f, 0.001f}) {
        float back = ep::e4m3_to_float(ep::float_to_e4m3(v));
        EXPECT_LE(std::fabs(back - v), std::max(std::fabs(v) * 0.0625f, 0.002f)) << v;
    }
    EXPECT_EQ(ep::e4m3_to_float(ep::float_to_e4m3(1e6f)), 448.0f);  // saturates
    EXPECT_EQ(ep::float_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ(ep::bf16_to_float(0x4040), 3.0f);
}

}  // namespace
}  // namespace moerl::test
