// The write proxy: producers that cannot call the transport (GPU blocks; here host threads standing
// in for them, with the same queue protocol) queue writes on their own rings, and the proxy thread
// runs them on the transport and mirrors its signals back. Every rank is a forked process; the
// transports are the host transport and, where built, the fabric transport on shm with its region
// as device memory (host memory on the device-memory path).
#include "write_proxy.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "moerl/core/error.hpp"
#include "moerl/ep/store.hpp"
#include "moerl/ep/transport.hpp"
#include "ranks.hpp"
#ifdef MOERL_HAVE_FABRIC
#include "fabric/fabric_transport.hpp"
#endif

namespace moerl::ep::proxy {
namespace {

using namespace std::chrono_literals;

constexpr auto kTestLimit = std::chrono::seconds(30);

uint8_t pattern(int src, int dst, int ring, size_t i) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ (static_cast<uint32_t>(src) << 24) ^
                 (static_cast<uint32_t>(dst) << 16) ^ (static_cast<uint32_t>(ring) << 8);
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    return static_cast<uint8_t>(x >> 24);
}

struct Case {
    std::string transport;  // "host", "fabric" or "proxy+host"
    int world_size;
    RegionMemory memory = RegionMemory::kHost;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
    return info.param.transport + "_" + std::to_string(info.param.world_size) + "ranks" +
           (info.param.memory == RegionMemory::kHostAsDevice ? "_hmem" : "");
}

std::unique_ptr<Transport> open_transport(const Case& c, int rank, size_t region_bytes, Store* store) {
    TransportOptions o;
    o.rank = rank;
    o.world_size = c.world_size;
    o.region_bytes = region_bytes;
    o.job_id = "proxy-test";
    o.fabric_provider = "shm";
    o.fabric_chunk_bytes = 4096;  // messages of several chunks
    o.region_memory = c.memory;
    o.timeout_s = 10;
    o.store = store;
    return make_transport(c.transport, o);
}

class WriteProxyTest : public testing::TestWithParam<Case> {
  protected:
    void SetUp() override {
#ifdef MOERL_HAVE_FABRIC
        if (GetParam().transport == "fabric") {
            // Probed in a child: libfabric must not be initialised in the parent before it forks.
            const auto probe = test::run_ranks(1, [&](int) {
                std::string why;
                if (!fabric_provider_available("shm", &why, GetParam().memory)) throw std::runtime_error(why);
            });
            if (probe[0].exit_code == 1) GTEST_SKIP() << "shm unavailable: " << probe[0].message;
        }
#endif
        store_dir_ = test::unique_dir("proxy-store");
    }
    void TearDown() override { std::filesystem::remove_all(store_dir_); }
    std::string store_dir_;
};

// Three producers a rank, each on its own ring (a small one, so producers wait for room) and its
// own channel, write patterned messages of one byte to several chunks to every rank, itself
// included, then signal; each waits on the mirrored signals and checks what arrived from every rank.
TEST_P(WriteProxyTest, ProducersOnTheirRingsReachEveryRank) {
    const Case c = GetParam();
    const std::string dir = store_dir_;
    const auto results = test::run_ranks(
        c.world_size,
        [&](int rank) {
            constexpr int kRings = 3;
            constexpr int kMessages = 20;
            const auto message_bytes = [](int m) -> size_t { return m % 5 == 0 ? 3 * 4096 + 7 : 1 + 37 * m; };
            size_t slot = 0;
            for (int m = 0; m < kMessages; ++m) slot += message_bytes(m);
            // Layout: [received: ring x source][to send: ring x destination], one slot each.
            const size_t per_side = static_cast<size_t>(kRings) * c.world_size * slot;
            auto recv_at = [&](int ring, int src) {
                return (static_cast<size_t>(ring) * c.world_size + src) * slot;
            };
            auto send_at = [&](int ring, int dst) { return per_side + recv_at(ring, dst); };
            auto store = make_file_store(dir);
            auto t = open_transport(c, rank, 2 * per_side, store.get());
            std::vector<std::byte> host(2 * per_side, std::byte{0xEE});
            for (int ring = 0; ring < kRings; ++ring)
                for (int dst = 0; dst < c.world_size; ++dst)
                    for (size_t i = 0; i < slot; ++i)
                        host[send_at(ring, dst) + i] = std::byte{pattern(rank, dst, ring, i)};
            t->copy_into_region(0, host.data(), host.size());
            // Everyone's region is ready before anyone writes into it.
            for (int peer = 0; peer < c.world_size; ++peer) t->signal(peer, 15);
            for (int peer = 0; peer < c.world_size; ++peer) t->wait(15, peer, 1, Clock::now() + 10s, "ready");

            WriteProxy proxy(*t, {.num_rings = kRings, .capacity = 4});
            std::vector<std::thread> producers;
            std::vector<std::string> errors(kRings);
            for (int ring = 0; ring < kRings; ++ring)
                producers.emplace_back([&, ring] {
                    try {
                        HostProducer p(proxy, ring);
                        const int channel = 1 + ring;
                        size_t offset = 0;
                        for (int m = 0; m < kMessages; ++m) {
                            for (int dst = 0; dst < c.world_size; ++dst)
                                p.write(dst, send_at(ring, dst) + offset, recv_at(ring, rank) + offset,
                                        message_bytes(m), channel);
                            offset += message_bytes(m);
                        }
                        for (int dst = 0; dst < c.world_size; ++dst) p.signal(dst, 10 + ring);
                        p.quiet(Clock::now() + 10s);
                        for (int src = 0; src < c.world_size; ++src) {
                            p.wait(channel, src, kMessages, Clock::now() + 10s, "messages");
                            p.wait(10 + ring, src, 1, Clock::now() + 10s, "signal");
                        }
                    } catch (const std::exception& e) {
                        errors[ring] = e.what();
                    }
                });
            for (auto& th : producers) th.join();
            for (int ring = 0; ring < kRings; ++ring)
                MOERL_CHECK(errors[ring].empty(), "ring ", ring, ": ", errors[ring]);
            proxy.check();
            MOERL_CHECK(
                proxy.commands_run() == static_cast<uint64_t>(kRings) * (c.world_size * (kMessages + 1) + 1),
                "the proxy ran ", proxy.commands_run(), " commands");
            t->copy_from_region(0, host.data(), per_side);
            for (int ring = 0; ring < kRings; ++ring)
                for (int src = 0; src < c.world_size; ++src)
                    for (size_t i = 0; i < slot; ++i)
                        MOERL_CHECK(host[recv_at(ring, src) + i] == std::byte{pattern(src, rank, ring, i)},
                                    "byte ", i, " from rank ", src, " on ring ", ring, " is wrong");
            proxy.stop();
            // Nobody tears down before everyone has checked.
            for (int peer = 0; peer < c.world_size; ++peer) t->signal(peer, 15);
            for (int peer = 0; peer < c.world_size; ++peer) t->wait(15, peer, 2, Clock::now() + 10s, "done");
            t->destroy();
        },
        kTestLimit);
    for (size_t r = 0; r < results.size(); ++r)
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].message;
}

std::vector<Case> cases() {
    std::vector<Case> all = {{"host", 2}, {"host", 3}};
#ifdef MOERL_HAVE_FABRIC
    all.push_back({"fabric", 2, RegionMemory::kHostAsDevice});
    all.push_back({"fabric", 3, RegionMemory::kHostAsDevice});
#endif
    return all;
}

INSTANTIATE_TEST_SUITE_P(Transports, WriteProxyTest, testing::ValuesIn(cases()), case_name);

// A command the transport refuses stops the proxy: the producer waiting behind it gets the proxy's
// error (naming ring, command and what was wrong) instead of waiting forever, and check() has it.
TEST(WriteProxy, ABadCommandStopsTheProxyAndItsProducersHearWhy) {
    const auto results = test::run_ranks(
        1,
        [](int) {
            auto t = open_transport({"host", 1}, 0, 4096, nullptr);
            WriteProxy proxy(*t, {.num_rings = 2, .capacity = 8});
            HostProducer good(proxy, 0), bad(proxy, 1);
            good.write(0, 0, 1024, 100, 2);
            good.quiet(Clock::now() + 5s);
            bad.write(0, 4000, 0, 200, 2);  // past the region's end
            std::string waited;
            try {
                good.wait(2, 0, 2, Clock::now() + 5s, "second write");
            } catch (const TimeoutError& e) {
                MOERL_FAIL("waited until the deadline: ", e.what());
            } catch (const Error& e) {
                waited = e.what();
            }
            for (const char* want : {"write proxy of rank 0", "ring 1", "[4000, 4200)"})
                MOERL_CHECK(waited.find(want) != std::string::npos, "'", want, "' not in: ", waited);
            MOERL_CHECK(proxy.failed(), "the proxy did not stop");
            bool checked = false;
            try {
                proxy.check();
            } catch (const Error& e) {
                checked = std::string(e.what()).find("ring 1") != std::string::npos;
            }
            MOERL_CHECK(checked, "check() does not report the error");
            t->destroy();
        },
        kTestLimit);
    EXPECT_EQ(results[0].exit_code, 0) << results[0].message;
}

// Commands naming a rank or channel that does not exist are refused by name; a stopped proxy makes
// its producers fail at once rather than wait; bad options are refused.
TEST(WriteProxy, OutOfRangeCommandsAndAStoppedProxyAreClearErrors) {
    const auto results = test::run_ranks(
        1,
        [](int) {
            auto t = open_transport({"host", 1}, 0, 4096, nullptr);
            {
                WriteProxy proxy(*t, {.num_rings = 1, .capacity = 2});
                HostProducer p(proxy, 0);
                p.signal(3, 0);
                std::string what;
                try {
                    p.quiet(Clock::now() + 5s);
                } catch (const Error& e) {
                    what = e.what();
                }
                MOERL_CHECK(what.find("signal names rank 3") != std::string::npos, "got: ", what);
            }
            WriteProxy proxy(*t, {.num_rings = 1, .capacity = 2});
            HostProducer p(proxy, 0);
            proxy.stop();
            std::string what;
            try {
                for (int i = 0; i < 3; ++i) p.signal(0, 0);  // the third finds the ring full
            } catch (const Error& e) {
                what = e.what();
            }
            MOERL_CHECK(what.find("was stopped") != std::string::npos, "got: ", what);
            proxy.check();  // stopped, not failed: nothing to report
            for (const ProxyOptions& bad : {ProxyOptions{.num_rings = 0}, ProxyOptions{.capacity = 0}}) {
                bool refused = false;
                try {
                    WriteProxy w(*t, bad);
                } catch (const Error& e) {
                    refused = std::string(e.what()).find("write proxy:") != std::string::npos;
                }
                MOERL_CHECK(refused, "bad options accepted");
            }
            bool refused = false;
            try {
                HostProducer outside(proxy, 1);
            } catch (const Error&) {
                refused = true;
            }
            MOERL_CHECK(refused, "a producer on a ring that does not exist");
            t->destroy();
        },
        kTestLimit);
    EXPECT_EQ(results[0].exit_code, 0) << results[0].message;
}

// The "proxy+NAME" transports (the host engine's traffic through a write proxy; the conformance
// suite runs dispatch and combine over them): the name says so, peers' regions are never stored
// into directly, bytes and signals arrive through the proxy, a wait for a peer that never signals
// times out naming the phase and the peer, and names that cannot work are refused by name.
TEST(ProxiedTransport, WritesGoThroughTheProxyAndMisuseIsNamed) {
    const std::string dir = test::unique_dir("proxied-store");
    const auto results = test::run_ranks(
        2,
        [&](int rank) {
            auto store = make_file_store(dir);
            auto t = open_transport({"proxy+host", 2}, rank, 4096, store.get());
            MOERL_CHECK(t->name() == "proxy+host", "name: ", t->name());
            MOERL_CHECK(t->peer_region(1 - rank) == nullptr, "a peer's region is reachable directly");
            std::vector<std::byte> bytes(300);
            for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte{pattern(rank, 1 - rank, 0, i)};
            t->copy_into_region(2048, bytes.data(), bytes.size());
            t->write(1 - rank, 2048, 0, bytes.size(), 3);
            t->wait(3, 1 - rank, 1, Clock::now() + 10s, "pattern");
            t->quiet();
            std::vector<std::byte> got(bytes.size());
            t->copy_from_region(0, got.data(), got.size());
            for (size_t i = 0; i < got.size(); ++i)
                MOERL_CHECK(got[i] == std::byte{pattern(1 - rank, rank, 0, i)}, "byte ", i, " from rank ",
                            1 - rank);
            MOERL_CHECK(t->signals(3, 1 - rank) == 1, "signals: ", t->signals(3, 1 - rank));
            if (rank == 0) {
                std::string what;
                try {
                    t->wait(4, 1, 1, Clock::now() + 200ms, "combine send");
                } catch (const TimeoutError& e) {
                    what = e.what();
                }
                for (const char* want : {"combine send", "rank 1"})
                    MOERL_CHECK(what.find(want) != std::string::npos, "'", want, "' not in: ", what);
            }
            t->signal(1 - rank, 5);  // both are done before either tears down
            t->wait(5, 1 - rank, 1, Clock::now() + 10s, "done");
            t->destroy();
        },
        kTestLimit);
    for (int r = 0; r < 2; ++r)
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].message;
    std::filesystem::remove_all(dir);
    EXPECT_TRUE(has_transport("proxy+host"));
    EXPECT_FALSE(has_transport("proxy+nonesuch"));
    const auto names = available_transports();
    EXPECT_NE(std::find(names.begin(), names.end(), "proxy+host"), names.end());
    for (const auto& [name, want] : std::vector<std::pair<std::string, std::string>>{
             {"proxy+proxy+host", "one proxy is enough"}, {"proxy+cuda", "unknown EP transport 'cuda'"}}) {
        std::string what;
        try {
            open_transport({name, 1}, 0, 4096, nullptr);
        } catch (const Error& e) {
            what = e.what();
        }
        EXPECT_NE(what.find(want), std::string::npos) << name << ": " << what;
    }
}

}  // namespace
}  // namespace moerl::ep::proxy
