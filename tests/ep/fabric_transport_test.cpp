// The fabric transport on the providers this machine has (tcp, shm): every rank is a forked process
// with its own endpoint, bootstrapped through a file store. Children report failure through their
// exit status; libfabric is never initialised in the parent, so forking stays safe.
#include "fabric/fabric_transport.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "builtin.hpp"
#include "fabric/signal_code.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/store.hpp"
#include "moerl/ep/transport.hpp"
#include "ranks.hpp"

namespace moerl::ep {
namespace {

using namespace std::chrono_literals;

constexpr auto kTestLimit = std::chrono::seconds(20);
constexpr size_t kSmallChunk = 4096;  // fabric_chunk_bytes in tests that need many chunks

// Byte i of the message src sends to dst in round `round`: a hash, so that a chunk landing at the
// wrong offset (even a multiple of 256 away) is caught.
uint8_t pattern(int src, int dst, int round, size_t i) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ (static_cast<uint32_t>(src) << 24) ^
                 (static_cast<uint32_t>(dst) << 16) ^ (static_cast<uint32_t>(round) << 8);
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    return static_cast<uint8_t>(x >> 24);
}

constexpr uint8_t kPoison = 0xEE;

// Throws naming the first wrong byte and the number of wrong bytes.
void expect_bytes(const std::byte* got, size_t bytes, const std::string& what,
                  const std::function<uint8_t(size_t)>& want) {
    size_t num_wrong = 0;
    size_t first_wrong = 0;
    for (size_t i = 0; i < bytes; ++i) {
        if (static_cast<uint8_t>(got[i]) != want(i)) {
            if (num_wrong++ == 0) first_wrong = i;
        }
    }
    MOERL_CHECK(num_wrong == 0, what, ": ", num_wrong, " of ", bytes, " bytes wrong, first at ", first_wrong,
                " (got ", int(static_cast<uint8_t>(got[first_wrong])), ", want ", int(want(first_wrong)),
                ")");
}

struct Case {
    std::string provider;
    int world_size;
    // kHostAsDevice: the region goes through the device-memory path (FI_HMEM registration apart
    // from the scratch, reached only by copies), as a GPU region would on EFA.
    RegionMemory memory = RegionMemory::kHost;
};

void PrintTo(const Case& c, std::ostream* os) {
    *os << c.provider << " x" << c.world_size << " " << region_memory_name(c.memory);
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
    return info.param.provider + "_" + std::to_string(info.param.world_size) + "ranks" +
           (info.param.memory == RegionMemory::kHostAsDevice ? "_hmem"
            : info.param.memory == RegionMemory::kCuda       ? "_cuda"
                                                             : "");
}

// Runs fn(rank) in world_size processes and fails the test with every failing rank's message.
void expect_ranks_succeed(int num_ranks, const std::function<void(int)>& fn) {
    const auto results = test::run_ranks(num_ranks, fn, kTestLimit);
    for (size_t r = 0; r < results.size(); ++r) {
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].message;
    }
}

TransportOptions options_for(const std::string& provider, int rank, int world_size, size_t region_bytes,
                             Store* store, double timeout_s = 10.0, size_t chunk_bytes = size_t{8} << 20) {
    TransportOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.region_bytes = region_bytes;
    o.job_id = "fabric-test";
    o.fabric_provider = provider;
    o.timeout_s = timeout_s;
    o.fabric_chunk_bytes = chunk_bytes;
    o.store = store;
    return o;
}

class FabricTransportTest : public testing::TestWithParam<Case> {
  protected:
    void SetUp() override {
        // Probed in a child: the parent must not initialise libfabric before it forks the ranks.
        const auto results = test::run_ranks(1, [&](int) {
            std::string why;
            if (!fabric_provider_available(GetParam().provider, &why, GetParam().memory))
                throw std::runtime_error(why);
            if (GetParam().memory == RegionMemory::kCuda) {
                // A GPU, and a libfabric built with CUDA memory support: one rank registers a region.
                auto o = options_for(GetParam().provider, 0, 1, 4096, nullptr);
                o.region_memory = RegionMemory::kCuda;
                make_fabric_transport(o)->destroy();
            }
        });
        if (results[0].exit_code == 1) GTEST_SKIP() << "provider unavailable: " << results[0].message;
        ASSERT_EQ(results[0].exit_code, 0) << "the provider probe crashed";
        store_dir_ = test::unique_dir("fabric-store");
    }
    void TearDown() override {
        if (!store_dir_.empty()) std::filesystem::remove_all(store_dir_);
    }
    const std::string& provider() const { return GetParam().provider; }
    int world() const { return GetParam().world_size; }
    // options_for with the case's region memory.
    TransportOptions options(int rank, size_t region_bytes, Store* store, double timeout_s = 10.0,
                             size_t chunk_bytes = size_t{8} << 20) const {
        TransportOptions o =
            options_for(provider(), rank, world(), region_bytes, store, timeout_s, chunk_bytes);
        o.region_memory = GetParam().memory;
        return o;
    }

    std::string store_dir_;
};

// Region layout for the exchange tests: [receive slot per source rank][send slot per destination rank].
struct SlotLayout {
    size_t slot_bytes;
    int world_size;
    size_t recv_offset(int src) const { return static_cast<size_t>(src) * slot_bytes; }
    size_t send_offset(int dst) const { return static_cast<size_t>(world_size + dst) * slot_bytes; }
    size_t region_bytes() const { return 2 * static_cast<size_t>(world_size) * slot_bytes; }
};

// Every rank writes patterned messages to every rank (itself included) for several rounds: one-byte,
// odd, exactly-one-chunk and many-chunk sizes, several messages per round on one channel, plus
// zero-byte writes and pure signals on their own channels. Checks the bytes and that nothing outside
// the written range changed.
TEST_P(FabricTransportTest, ExchangesPatternedMessages) {
    const int world_size = world();
    const std::string prov = provider();
    const std::string dir = store_dir_;
    expect_ranks_succeed(world_size, [&](int rank) {
        auto store = make_file_store(dir);
        const SlotLayout layout{64 * 1024, world_size};
        auto t = make_fabric_transport(options(rank, layout.region_bytes(), store.get(), 10.0, kSmallChunk));
        MOERL_CHECK(t->name() == "fabric/" + prov, "name() = ", t->name());
        MOERL_CHECK(t->rank() == rank && t->world_size() == world_size, "rank/world mismatch");
        MOERL_CHECK(t->region_bytes() == layout.region_bytes(), "region_bytes() = ", t->region_bytes());
        MOERL_CHECK(t->region_memory() == GetParam().memory,
                    "region_memory() = ", region_memory_name(t->region_memory()));
        MOERL_CHECK(t->peer_region(0) == nullptr, "peer_region must be null for fabric");
        // The region is reached only through copies, as a device region would be.
        std::vector<std::byte> region(layout.region_bytes());

        // Message sizes per round: the three parts of one round land back to back in the slot.
        const std::vector<std::vector<size_t>> rounds = {
            {1, 7, 4096},               // tiny, odd, exactly one chunk
            {4097, 1, 12289},           // one byte over a chunk; 4 chunks
            {50000, 0, 3},              // 13 chunks, a zero-byte write in the middle of a message train
            {kSmallChunk * 15, 17, 1},  // 15 chunks
        };
        const int data_channel = 2;
        const int zero_channel = 9;
        const int signal_channel = 14;
        const int barrier_channel = 15;
        const auto deadline = [] { return Clock::now() + 10s; };

        for (size_t round = 0; round < rounds.size(); ++round) {
            // Poison what peers will write, then tell them they may write (round barrier).
            std::memset(region.data(), kPoison, layout.send_offset(0));
            for (int dst = 0; dst < world_size; ++dst) {
                std::byte* send = region.data() + layout.send_offset(dst);
                for (size_t i = 0; i < layout.slot_bytes; ++i)
                    send[i] = std::byte{pattern(rank, dst, static_cast<int>(round), i)};
            }
            t->copy_into_region(0, region.data(), region.size());
            for (int peer = 0; peer < world_size; ++peer) t->signal(peer, barrier_channel);
            for (int peer = 0; peer < world_size; ++peer)
                t->wait(barrier_channel, peer, 2 * round + 1, deadline(), "round start");

            const auto& sizes = rounds[round];
            for (int dst = 0; dst < world_size; ++dst) {
                size_t offset = 0;
                for (size_t bytes : sizes) {
                    t->write(dst, layout.send_offset(dst) + offset, layout.recv_offset(rank) + offset, bytes,
                             data_channel);
                    offset += bytes;
                }
                t->write(dst, layout.send_offset(dst), layout.recv_offset(rank), 0, zero_channel);
                t->signal(dst, signal_channel);
            }
            const uint64_t messages_so_far = [&] {
                uint64_t n = 0;
                for (size_t r = 0; r <= round; ++r) n += rounds[r].size();
                return n;
            }();
            for (int src = 0; src < world_size; ++src) {
                t->wait(data_channel, src, messages_so_far, deadline(), "data");
                t->wait(zero_channel, src, round + 1, deadline(), "zero-byte write");
                t->wait(signal_channel, src, round + 1, deadline(), "signal");
                MOERL_CHECK(t->signals(data_channel, src) == messages_so_far, "rank ", rank, ": ",
                            t->signals(data_channel, src), " data signals from rank ", src, ", want ",
                            messages_so_far);
                size_t total = 0;
                for (size_t bytes : sizes) total += bytes;
                std::byte* got = region.data() + layout.recv_offset(src);
                t->copy_from_region(layout.recv_offset(src), got, layout.slot_bytes);
                expect_bytes(got, total,
                             "round " + std::to_string(round) + " from rank " + std::to_string(src),
                             [&](size_t i) { return pattern(src, rank, static_cast<int>(round), i); });
                expect_bytes(got + total, layout.slot_bytes - total,
                             "past the data from rank " + std::to_string(src),
                             [](size_t) { return kPoison; });
            }
            t->quiet();  // the send slots are refilled next round
            // Second barrier: nobody poisons the next round before everyone has checked this one.
            for (int peer = 0; peer < world_size; ++peer) t->signal(peer, barrier_channel);
            for (int peer = 0; peer < world_size; ++peer)
                t->wait(barrier_channel, peer, 2 * round + 2, deadline(), "round end");
        }
        t->destroy();
        t->destroy();  // idempotent
    });
}

// With the default chunk (8 MiB) a write just over it is split in two.
TEST_P(FabricTransportTest, SplitsWritesBiggerThanTheDefaultChunk) {
    const int world_size = world();
    const std::string prov = provider();
    const std::string dir = store_dir_;
    expect_ranks_succeed(world_size, [&](int rank) {
        auto store = make_file_store(dir);
        const size_t bytes = (size_t{8} << 20) + 4096 + 3;
        // A ring: one 8 MiB message per rank keeps the test quick with any world size.
        const int next = (rank + 1) % world_size;
        const int prev = (rank + world_size - 1) % world_size;
        const size_t recv_offset = 0;
        const size_t send_offset = bytes + 64;
        auto t = make_fabric_transport(options(rank, 2 * bytes + 64, store.get()));
        std::vector<std::byte> region(2 * bytes + 64);
        std::memset(region.data(), kPoison, send_offset);
        for (size_t i = 0; i < bytes; ++i) region[send_offset + i] = std::byte{pattern(rank, next, 0, i)};
        t->copy_into_region(0, region.data(), region.size());
        t->signal(prev, 1);  // prev may write: the receive slot is poisoned
        t->wait(1, next, 1, Clock::now() + 10s, "ready");
        t->write(next, send_offset, recv_offset + 5, bytes, 0);
        t->wait(0, prev, 1, Clock::now() + 15s, "large write");
        MOERL_CHECK(t->signals(0, prev) == 1, "one message, ", t->signals(0, prev), " signals");
        std::byte* got = region.data() + recv_offset;
        t->copy_from_region(recv_offset, got, send_offset);
        expect_bytes(got, 5, "before the large write", [](size_t) { return kPoison; });
        expect_bytes(got + 5, bytes, "large write", [&](size_t i) { return pattern(prev, rank, 0, i); });
        expect_bytes(got + 5 + bytes, send_offset - 5 - bytes, "after the large write",
                     [](size_t) { return kPoison; });
        t->quiet();
        t->destroy();
    });
}

// Far more messages to one peer on one channel than the sequence window holds, multi-chunk ones
// mixed in, without waiting in between: the sender must throttle, the receiver count in order.
TEST_P(FabricTransportTest, BurstBeyondTheSignalWindow) {
    const int world_size = world();
    const std::string prov = provider();
    const std::string dir = store_dir_;
    expect_ranks_succeed(world_size, [&](int rank) {
        auto store = make_file_store(dir);
        constexpr int kNumMessages = 5 * static_cast<int>(fabric::kSeqWindow) + 3;
        const auto message_bytes = [](int m) -> size_t { return m % 7 == 0 ? 3 * kSmallChunk - 5 : 64 + m; };
        size_t total = 0;
        for (int m = 0; m < kNumMessages; ++m) total += message_bytes(m);
        const SlotLayout layout{total, world_size};
        auto t = make_fabric_transport(options(rank, layout.region_bytes(), store.get(), 10.0, kSmallChunk));
        std::vector<std::byte> region(layout.region_bytes());
        std::memset(region.data(), kPoison, layout.send_offset(0));
        for (int dst = 0; dst < world_size; ++dst)
            for (size_t i = 0; i < total; ++i)
                region[layout.send_offset(dst) + i] = std::byte{pattern(rank, dst, 1, i)};
        t->copy_into_region(0, region.data(), region.size());
        for (int peer = 0; peer < world_size; ++peer) t->signal(peer, 15);
        for (int peer = 0; peer < world_size; ++peer) t->wait(15, peer, 1, Clock::now() + 10s, "ready");

        const int channel = 3;
        size_t offset = 0;
        for (int m = 0; m < kNumMessages; ++m) {
            for (int dst = 0; dst < world_size; ++dst)
                t->write(dst, layout.send_offset(dst) + offset, layout.recv_offset(rank) + offset,
                         message_bytes(m), channel);
            offset += message_bytes(m);
        }
        for (int src = 0; src < world_size; ++src) {
            t->wait(channel, src, kNumMessages, Clock::now() + 15s, "burst");
            MOERL_CHECK(t->signals(channel, src) == kNumMessages, "got ", t->signals(channel, src),
                        " signals");
            t->copy_from_region(layout.recv_offset(src), region.data() + layout.recv_offset(src), total);
            expect_bytes(region.data() + layout.recv_offset(src), total,
                         "burst from rank " + std::to_string(src),
                         [&](size_t i) { return pattern(src, rank, 1, i); });
        }
        t->destroy();
    });
}

// Rank world-1 never starts: the others fail in bootstrap within the timeout, naming it.
TEST_P(FabricTransportTest, PeerThatNeverArrivesTimesOut) {
    const int world_size = world();
    const std::string prov = provider();
    const std::string dir = store_dir_;
    const int missing = world_size - 1;
    expect_ranks_succeed(world_size - 1, [&](int rank) {
        auto store = make_file_store(dir);
        const auto start = Clock::now();
        try {
            auto t = make_fabric_transport(options(rank, 4096, store.get(), 1.5));
        } catch (const TimeoutError& e) {
            const double waited = std::chrono::duration<double>(Clock::now() - start).count();
            const std::string what = e.what();
            MOERL_CHECK(what.find("rank " + std::to_string(missing)) != std::string::npos,
                        "the error does not name the missing rank: ", what);
            MOERL_CHECK(what.find("bootstrap") != std::string::npos,
                        "the error does not name the phase: ", what);
            MOERL_CHECK(waited >= 1.4 && waited < 5.0, "gave up after ", waited, " s, timeout 1.5 s");
            return;
        }
        MOERL_FAIL("rank ", rank, ": no TimeoutError although rank ", missing, " never started");
    });
}

// A signal that never comes: wait() throws at its deadline naming the phase and the peer, and the
// transport stays usable (destroy still meets the peers).
TEST_P(FabricTransportTest, WaitTimesOutNamingPhaseAndPeer) {
    const int world_size = world();
    const std::string prov = provider();
    const std::string dir = store_dir_;
    expect_ranks_succeed(world_size, [&](int rank) {
        auto store = make_file_store(dir);
        auto t = make_fabric_transport(options(rank, 4096, store.get()));
        if (rank == 0) {
            const int silent = world_size - 1;
            const auto start = Clock::now();
            try {
                t->wait(5, silent, 1, start + 1s, "combine-recv");
                MOERL_FAIL("wait returned without any signal");
            } catch (const TimeoutError& e) {
                const double waited = std::chrono::duration<double>(Clock::now() - start).count();
                const std::string what = e.what();
                MOERL_CHECK(what.find("combine-recv") != std::string::npos, "phase missing: ", what);
                MOERL_CHECK(what.find("rank " + std::to_string(silent)) != std::string::npos,
                            "peer missing: ", what);
                MOERL_CHECK(waited >= 0.99 && waited < 3.0, "wait gave up after ", waited,
                            " s, deadline 1 s");
            }
        }
        // Still working after the timeout.
        for (int peer = 0; peer < world_size; ++peer) t->signal(peer, 6);
        for (int peer = 0; peer < world_size; ++peer)
            t->wait(6, peer, 1, Clock::now() + 10s, "after timeout");
        t->destroy();
    });
}

// A peer that dies after bootstrap: a write to it ends in an error or a timeout naming it (tcp and
// shm keep answering FI_EAGAIN), and destroy() gives up on it at the timeout instead of hanging. With
// 2 ranks nothing is written, so the error is destroy's own.
TEST_P(FabricTransportTest, PeerThatDiesIsReportedNotWaitedForForever) {
    const int world_size = world();
    const std::string prov = provider();
    const std::string dir = store_dir_;
    const int dead = world_size - 1;
    const bool write_to_dead = world_size > 2;
    const auto results = test::run_ranks(
        world_size,
        [&](int rank) {
            auto store = make_file_store(dir);
            auto t = make_fabric_transport(options(rank, 64 * 1024, store.get(), 1.5));
            if (rank == dead) _exit(3);  // no destroy, no goodbye
            const auto names_dead_rank = [&](const std::string& what) {
                return what.find("rank " + std::to_string(dead)) != std::string::npos;
            };
            if (write_to_dead) {
                std::this_thread::sleep_for(100ms);
                try {
                    t->write(dead, 0, 0, 64 * 1024, 0);
                    t->quiet();  // a provider may accept the bytes without noticing
                } catch (const Error& e) {
                    MOERL_CHECK(names_dead_rank(e.what()),
                                "write error does not name the dead rank: ", e.what());
                }
            }
            const auto start = Clock::now();
            try {
                t->destroy();
            } catch (const Error& e) {
                const double waited = std::chrono::duration<double>(Clock::now() - start).count();
                const std::string what = e.what();
                MOERL_CHECK(names_dead_rank(what), "destroy error does not name the dead rank: ", what);
                MOERL_CHECK(write_to_dead || what.find("destroy") != std::string::npos,
                            "destroy error does not name the phase: ", what);
                MOERL_CHECK(waited < 5.0, "destroy gave up only after ", waited, " s, timeout 1.5 s");
                return;
            }
            MOERL_FAIL("destroy succeeded although rank ", dead, " is dead");
        },
        kTestLimit);
    for (int r = 0; r < world_size; ++r) {
        EXPECT_EQ(results[r].exit_code, r == dead ? 3 : 0) << "rank " << r << ": " << results[r].message;
    }
}

std::vector<Case> provider_cases() {
    std::vector<Case> cases = {{"tcp", 2},
                               {"tcp", 3},
                               {"shm", 2},
                               {"shm", 3},
                               {"shm", 2, RegionMemory::kHostAsDevice},
                               {"shm", 3, RegionMemory::kHostAsDevice}};
#if MOERL_HAVE_CUDA
    // GPU memory, where a GPU and libfabric's CUDA support are here (ranks sharing the GPU; shm
    // moves the bytes by CUDA IPC).
    cases.push_back({"shm", 2, RegionMemory::kCuda});
#endif
    return cases;
}

INSTANTIATE_TEST_SUITE_P(Providers, FabricTransportTest, testing::ValuesIn(provider_cases()), case_name);

// A single rank needs no store; writes to itself are copies.
TEST(FabricTransportSingleRank, SelfWritesAndBadArguments) {
    const auto results = test::run_ranks(
        1,
        [](int) {
            std::string why;
            if (!fabric_provider_available("tcp", &why)) return;  // nothing to test without tcp
            auto t = make_fabric_transport(options_for("tcp", 0, 1, 1000, nullptr));
            std::byte* region = t->region();
            for (size_t i = 0; i < 100; ++i) region[i] = std::byte{pattern(0, 0, 0, i)};
            t->write(0, 0, 500, 100, 4);
            t->write(0, 0, 999, 0, 4);
            t->signal(0, 4);
            MOERL_CHECK(t->signals(4, 0) == 3, "self signals = ", t->signals(4, 0));
            expect_bytes(region + 500, 100, "self write", [](size_t i) { return pattern(0, 0, 0, i); });

            const auto expect_error = [](const char* what, const std::function<void()>& fn) {
                try {
                    fn();
                } catch (const Error&) {
                    return;
                }
                MOERL_FAIL("no error for ", what);
            };
            expect_error("destination past the region", [&] { t->write(0, 0, 901, 100, 0); });
            expect_error("source past the region", [&] { t->write(0, 950, 0, 51, 0); });
            expect_error("huge size", [&] { t->write(0, 10, 0, ~size_t{0} - 5, 0); });
            expect_error("peer out of range", [&] { t->write(1, 0, 0, 1, 0); });
            expect_error("negative channel", [&] { t->signal(0, -1); });
            expect_error("channel out of range", [&] { t->signals(kNumChannels, 0); });
            t->quiet();
            t->destroy();
            expect_error("write after destroy", [&] { t->write(0, 0, 0, 1, 0); });
        },
        kTestLimit);
    EXPECT_EQ(results[0].exit_code, 0) << results[0].message;
}

// A process whose id was a killed rank's finds that rank's shm region still there (libfabric names it
// after the process id). Reproduced exactly: a rank opens an shm endpoint and, without closing it,
// replaces itself (exec keeps the process id) with this test binary running the helper below, which
// opens an shm endpoint again and must succeed.
constexpr const char* kReexecEnv = "MOERL_TEST_SHM_REEXEC";

TEST(FabricTransportSingleRank, ShmEndpointOfAnEarlierProcessWithTheSameId) {
    if (getenv(kReexecEnv) != nullptr) {  // the re-executed rank
        auto t = make_fabric_transport(options_for("shm", 0, 1, 4096, nullptr));
        t->region()[0] = std::byte{7};
        t->write(0, 0, 64, 1, 0);
        t->quiet();
        EXPECT_EQ(t->region()[64], std::byte{7});
        t->destroy();
        return;
    }
    const auto results = test::run_ranks(
        1,
        [](int) {
            std::string why;
            if (!fabric_provider_available("shm", &why)) _exit(0);  // nothing to test without shm
            auto left_open = make_fabric_transport(options_for("shm", 0, 1, 4096, nullptr));
            setenv(kReexecEnv, "1", 1);
            const std::string filter =
                "--gtest_filter=FabricTransportSingleRank.ShmEndpointOfAnEarlierProcessWithTheSameId";
            execl("/proc/self/exe", "fabric_transport_test", filter.c_str(), static_cast<char*>(nullptr));
            MOERL_FAIL("exec of the test binary failed: ", std::strerror(errno));
        },
        kTestLimit);
    EXPECT_EQ(results[0].exit_code, 0)
        << "the re-executed rank could not open its shm endpoint " << results[0].message;
}

// The device-memory path on one rank: a self write is a copy within the region, and the CPU reaches
// the region only through the copy calls, which check their range.
TEST(FabricTransportSingleRank, HostAsDeviceRegionCopiesAndSelfWrites) {
    const auto results = test::run_ranks(
        1,
        [](int) {
            if (!fabric_provider_available("shm", nullptr, RegionMemory::kHostAsDevice)) return;
            auto o = options_for("shm", 0, 1, 1000, nullptr);
            o.region_memory = RegionMemory::kHostAsDevice;
            auto t = make_fabric_transport(o);
            MOERL_CHECK(t->region_memory() == RegionMemory::kHostAsDevice,
                        "region_memory() = ", region_memory_name(t->region_memory()));
            std::vector<std::byte> bytes(100);
            for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte{pattern(0, 0, 0, i)};
            t->copy_into_region(0, bytes.data(), bytes.size());
            t->write(0, 0, 900, 100, 4);
            t->quiet();
            std::vector<std::byte> back(100);
            t->copy_from_region(900, back.data(), back.size());
            expect_bytes(back.data(), back.size(), "self write",
                         [](size_t i) { return pattern(0, 0, 0, i); });
            MOERL_CHECK(t->signals(4, 0) == 1, "self signals = ", t->signals(4, 0));
            bool refused = false;
            try {
                t->copy_from_region(901, back.data(), back.size());
            } catch (const Error& e) {
                refused = std::string(e.what()).find("outside the region of 1000 bytes") != std::string::npos;
            }
            MOERL_CHECK(refused, "a copy past the region's end was not refused by name");
            t->destroy();
        },
        kTestLimit);
    EXPECT_EQ(results[0].exit_code, 0) << results[0].message;
}

// A provider without FI_HMEM (tcp here) cannot register device memory: the error says so and names
// the memory, instead of failing later in registration.
TEST(FabricTransportSingleRank, ProviderWithoutHmemRefusesADeviceRegionByName) {
    const auto results = test::run_ranks(
        1,
        [](int) {
            if (!fabric_provider_available("tcp")) return;
            if (fabric_provider_available("tcp", nullptr, RegionMemory::kHostAsDevice))
                return;  // tcp with FI_HMEM
            auto o = options_for("tcp", 0, 1, 64, nullptr);
            o.region_memory = RegionMemory::kHostAsDevice;
            try {
                make_fabric_transport(o);
            } catch (const Error& e) {
                const std::string what = e.what();
                for (const char* want : {"'tcp'", "FI_HMEM", "host-as-device"})
                    MOERL_CHECK(what.find(want) != std::string::npos, "'", want, "' not in: ", what);
                return;
            }
            MOERL_FAIL("tcp without FI_HMEM accepted a device-memory region");
        },
        kTestLimit);
    EXPECT_EQ(results[0].exit_code, 0) << results[0].message;
}

TEST(FabricTransportSingleRank, UnknownProviderIsAClearError) {
    const auto results = test::run_ranks(
        1,
        [](int) {
            try {
                make_fabric_transport(options_for("no-such-provider", 0, 1, 64, nullptr));
            } catch (const Error& e) {
                const std::string what = e.what();
                MOERL_CHECK(what.find("no-such-provider") != std::string::npos, "provider not named: ", what);
                return;
            }
            MOERL_FAIL("no error for an unknown provider");
        },
        kTestLimit);
    EXPECT_EQ(results[0].exit_code, 0) << results[0].message;
}

TEST(FabricSignalCode, RoundTrips) {
    for (int src : {0, 1, 77, fabric::kMaxRanks - 1})
        for (int channel : {0, 5, kNumChannels - 1})
            for (uint32_t seq : {0u, 17u, fabric::kSeqWindow - 1})
                for (uint32_t num_chunks : {1u, 300u, fabric::kMaxChunks}) {
                    const uint32_t bits = fabric::encode({src, channel, seq, num_chunks});
                    const auto back = fabric::decode(uint64_t{0xdead} << 32 | bits);  // high bits ignored
                    EXPECT_EQ(back.src, src);
                    EXPECT_EQ(back.channel, channel);
                    EXPECT_EQ(back.seq, seq);
                    EXPECT_EQ(back.num_chunks, num_chunks);
                }
}

// Chunks of consecutive messages arriving interleaved (as on EFA): a message counts only when it and
// every earlier one are complete.
TEST(FabricSignalCode, ReceiveLaneCountsMessagesInOrder) {
    fabric::ReceiveLane lane;
    // message 0: 3 chunks, message 1: 2 chunks, message 2: 1 chunk
    EXPECT_EQ(lane.on_chunk(1, 2), 0u);
    EXPECT_EQ(lane.on_chunk(0, 3), 0u);
    EXPECT_EQ(lane.on_chunk(2, 1), 0u);
    EXPECT_EQ(lane.on_chunk(1, 2), 0u);  // message 1 complete, but message 0 is not
    EXPECT_EQ(lane.on_chunk(0, 3), 0u);
    EXPECT_EQ(lane.on_chunk(0, 3), 3u);  // all three at once
    // The window wraps around.
    uint32_t num_done = 0;
    for (uint32_t m = 3; m < 3 + 2 * fabric::kSeqWindow; ++m)
        num_done += lane.on_chunk(m % fabric::kSeqWindow, 1);
    EXPECT_EQ(num_done, 2 * fabric::kSeqWindow);
    // More chunks than announced is a protocol error, not a silent miscount.
    EXPECT_EQ(lane.on_chunk(4, 1), 0u);
    EXPECT_THROW(lane.on_chunk(4, 1), Error);
}

}  // namespace
}  // namespace moerl::ep
