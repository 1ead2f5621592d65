// `moerl ep check`: a quick end-to-end EP self-check for one rank of a launched group
// (`moerl launch -n 4 -- moerl ep check --transport fabric/tcp`): rendezvous through the
// TCPStore, dispatch rows tagged with (source rank, token), check where they landed, combine.
#include <cmath>
#include <iostream>
#include <random>

#include "commands.hpp"
#include "launch.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"

namespace moerl::cli {

namespace {

struct CheckOpts {
    std::string transport = "host";
    int experts = 16, hidden = 64, top_k = 4, tokens = 96, rounds = 3;
    double timeout_s = 30;
};

void run_check(const CheckOpts& o) {
    const RankEnv env = rank_env_from_environment();
    auto store = make_tcp_store(env, o.timeout_s);
    ep::Config c;
    c.world_size = env.world_size;
    c.rank = env.rank;
    c.num_experts = o.experts;
    c.hidden = o.hidden;
    c.top_k = o.top_k;
    c.max_tokens_per_rank = o.tokens;
    c.dtype = ep::DType::kFloat32;
    c.timeout_s = o.timeout_s;
    c.job_id = "check";
    c.set_transport(o.transport);
    ep::Buffer buffer(c, store.get());
    MOERL_CHECK(!buffer.on_device(), "ep check runs host-memory transports only (got ", o.transport, ")");
    const int W = c.world_size, H = c.hidden, K = c.top_k, T = c.max_tokens_per_rank;
    auto routing = [&](int r, int round) {
        std::mt19937 rng(1000 * round + r);
        std::uniform_int_distribution<int> e(-1, c.num_experts - 1);
        std::vector<int64_t> idx(static_cast<size_t>(T) * K);
        for (auto& v : idx) v = e(rng);
        return idx;
    };
    for (int round = 0; round < o.rounds; ++round) {
        std::vector<float> x(static_cast<size_t>(T) * H);
        for (int t = 0; t < T; ++t)
            for (int j = 0; j < H; ++j) x[static_cast<size_t>(t) * H + j] = c.rank * 1000.0f + t + j * 1e-3f;
        auto idx = routing(c.rank, round);
        std::vector<float> recv(static_cast<size_t>(c.max_recv_tokens()) * H, -1.0f);
        ep::Handle h = buffer.dispatch({x.data(), T, H}, {idx.data(), T, K}, {},
                                       {{recv.data(), c.max_recv_tokens(), H}});
        // Expected: rows from each source in token order, for tokens with an expert here.
        int row = 0;
        for (int s = 0; s < W; ++s) {
            auto sidx = routing(s, round);
            for (int t = 0; t < T; ++t) {
                bool here = false;
                for (int k = 0; k < K; ++k)
                    here |= sidx[static_cast<size_t>(t) * K + k] >= 0 &&
                            c.expert_owner(static_cast<int>(sidx[static_cast<size_t>(t) * K + k])) == c.rank;
                if (!here) continue;
                const float got = recv[static_cast<size_t>(row) * H];
                MOERL_CHECK(got == s * 1000.0f + t, "rank ", c.rank, " round ", round, ": row ", row,
                            " holds ", got, ", expected rank ", s, " token ", t);
                ++row;
            }
        }
        MOERL_CHECK(row == h.num_recv_tokens(), "rank ", c.rank, ": received ", h.num_recv_tokens(),
                    " rows, expected ", row);
        std::vector<float> out(static_cast<size_t>(T) * H);
        buffer.combine({recv.data(), h.num_recv_tokens(), H}, h, {out.data(), T, H});
        for (int t = 0; t < T; ++t) {
            int reached = 0;
            for (int r = 0; r < W; ++r) reached += h.send_pos[static_cast<size_t>(t) * W + r] >= 0;
            const float want = reached * x[static_cast<size_t>(t) * H + 1];
            const float got = out[static_cast<size_t>(t) * H + 1];
            MOERL_CHECK(std::fabs(got - want) <= 1e-3f * std::fabs(want) + 1e-3f, "rank ", c.rank,
                        ": combine of token ", t, " is ", got, ", expected ", want);
        }
    }
    buffer.destroy();
    std::cout << "ep check: rank " << c.rank << "/" << W << " on " << buffer.transport_name() << ": "
              << o.rounds << " rounds ok\n";
}

}  // namespace

void register_ep_commands(CLI::App& app) {
    auto* ep = app.add_subcommand("ep", "EP library tools");
    ep->require_subcommand(1);
    auto* check = ep->add_subcommand("check", "Self-check dispatch/combine on one rank of a launched group");
    auto o = std::make_shared<CheckOpts>();
    check->add_option("--transport", o->transport, "host, fabric/tcp, fabric/shm")->capture_default_str();
    check->add_option("--experts", o->experts, "Experts in total, split evenly over the ranks")
        ->capture_default_str();
    check->add_option("--hidden", o->hidden, "Hidden size: columns of each token row")->capture_default_str();
    check->add_option("--top-k", o->top_k, "Experts per token")->capture_default_str();
    check->add_option("--tokens", o->tokens, "Tokens per rank and round")->capture_default_str();
    check->add_option("--rounds", o->rounds, "Dispatch/combine rounds, each with fresh routing")
        ->capture_default_str();
    check->add_option("--timeout", o->timeout_s, "Seconds to wait for any peer")->capture_default_str();
    check->callback([o] { run_check(*o); });
}

}  // namespace moerl::cli
