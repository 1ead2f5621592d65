// moerl_control_bench: the control plane's costs, as tables.
//   1. task queue throughput: put, then lease + ack, per backend and number of workers
//   2. failover: time from a worker's death (its last heartbeat) to its task leased elsewhere,
//      against the lease timeout
//   3. checkpoint store: upload / download MB/s per size, local directory and S3 (s3rver), with
//      sha256 and a plain file copy of the same bytes as baselines
// Servers come from the same variables as the dist tests (scripts/test-servers.sh):
// MOERL_TEST_REDIS_URL, MOERL_TEST_S3_ENDPOINT, MOERL_TEST_S3_BUCKET, AWS_*. Rows whose server is
// not set are skipped.
//
//   moerl_control_bench [--tasks N] [--sizes-mib 8,64,256] [--repeats R] [--quick]
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moerl/control/control.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using moerl::control::Millis;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

std::string unique_name(const std::string& base) {
    static std::mt19937_64 rng(std::random_device{}());
    return base + "-" + std::to_string(::getpid()) + "-" + std::to_string(rng() % 1000000);
}

struct Backend {
    std::string label;
    std::string address;
};

std::vector<Backend> queue_backends() {
    std::vector<Backend> out{{"embedded", "embedded"}};
    if (auto url = moerl::env::get("MOERL_TEST_REDIS_URL")) out.push_back({"redis", *url});
    return out;
}

// ---- 1. queue throughput -----------------------------------------------------------------------
// Puts `num_tasks` tasks (payload of `payload_bytes`), then `num_workers` threads, each with its own
// queue handle (its own connection), lease and acknowledge until all are done.
void bench_queue(const std::vector<Backend>& backends, int num_tasks, int payload_bytes) {
    std::printf("\n## Task queue throughput (%d tasks, %d-byte payload, one run per row)\n", num_tasks,
                payload_bytes);
    std::printf("%-9s %8s %12s %16s %18s\n", "backend", "workers", "put/s", "lease+ack/s", "put+lease+ack/s");
    const std::string payload(static_cast<size_t>(payload_bytes), 'x');
    for (const auto& b : backends) {
        for (int num_workers : {1, 4}) {
            const std::string run = unique_name("bench-queue");
            auto queue = moerl::control::make_task_queue(b.address, run, Millis(30000));
            auto t0 = Clock::now();
            for (int i = 0; i < num_tasks; ++i) queue->put({"t" + std::to_string(i), 0, payload, ""});
            const double put_s = seconds_since(t0);
            std::atomic<int> done{0};
            std::vector<std::thread> threads;
            auto t1 = Clock::now();
            for (int w = 0; w < num_workers; ++w) {
                threads.emplace_back([&, w] {
                    auto q = moerl::control::make_task_queue(b.address, run, Millis(30000));
                    const std::string name = "w" + std::to_string(w);
                    while (done.load() < num_tasks) {
                        auto lease = q->lease(name, Millis(20));
                        if (!lease) continue;
                        q->ack(*lease);
                        ++done;
                    }
                });
            }
            for (auto& t : threads) t.join();
            const double work_s = seconds_since(t1);
            MOERL_CHECK(queue->outstanding() == 0, "queue bench: ", queue->outstanding(),
                        " tasks outstanding after all were acknowledged; expected 0");
            std::printf("%-9s %8d %12.0f %16.0f %18.0f\n", b.label.c_str(), num_workers, num_tasks / put_s,
                        num_tasks / work_s, num_tasks / (put_s + work_s));
        }
    }
}

// ---- 2. failover -------------------------------------------------------------------------------
// Worker "a" leases the only task, heartbeats twice and dies (stops). Worker "b" polls lease() with
// a short wait; the takeover time is from a's last heartbeat to b holding the task.
void bench_failover(const std::vector<Backend>& backends, int repeats) {
    std::printf("\n## Failover: worker death (last heartbeat) -> its task leased by another worker\n");
    std::printf("%-9s %14s %14s %14s %14s\n", "backend", "lease_ms", "takeover_ms", "overhead_ms", "attempt");
    for (const auto& b : backends) {
        for (int timeout_ms : {250, 500, 1000, 2000}) {
            std::vector<double> takeovers;
            int attempt = 0;
            for (int r = 0; r < repeats; ++r) {
                const std::string run = unique_name("bench-failover");
                auto qa = moerl::control::make_task_queue(b.address, run, Millis(timeout_ms));
                auto qb = moerl::control::make_task_queue(b.address, run, Millis(timeout_ms));
                qa->put({"only", 0, "payload", ""});
                auto la = qa->lease("a", Millis(1000));
                MOERL_CHECK(la.has_value(), "failover bench: worker a got no lease of the one task put");
                for (int h = 0; h < 2; ++h) {
                    std::this_thread::sleep_for(Millis(timeout_ms / 4));
                    qa->heartbeat("a");
                }
                const auto death = Clock::now();
                std::optional<moerl::control::Lease> lb;
                while (!lb) {
                    lb = qb->lease("b", Millis(10));
                    MOERL_CHECK(seconds_since(death) < 10.0 + timeout_ms / 1000.0,
                                "failover bench: the task did not move to worker b within 10 s after the ",
                                timeout_ms, " ms lease timeout");
                }
                takeovers.push_back(seconds_since(death) * 1000);
                attempt = lb->task.attempt;
                qb->ack(*lb);
            }
            const double t = median(takeovers);
            std::printf("%-9s %14d %14.0f %14.0f %14d\n", b.label.c_str(), timeout_ms, t, t - timeout_ms,
                        attempt);
        }
    }
}

// ---- 3. checkpoint store -----------------------------------------------------------------------
void write_random_file(const fs::path& path, size_t bytes) {
    std::mt19937_64 rng(bytes);
    std::vector<uint64_t> block(1 << 17);  // 1 MiB
    std::ofstream out(path, std::ios::binary);
    for (size_t done = 0; done < bytes;) {
        for (auto& x : block) x = rng();
        const size_t n = std::min(bytes - done, block.size() * sizeof(uint64_t));
        out.write(reinterpret_cast<const char*>(block.data()), static_cast<std::streamsize>(n));
        done += n;
    }
    MOERL_CHECK(out.good(), "store bench: cannot write ", path.string());
}

void bench_store(const std::vector<size_t>& sizes_mib, int repeats, const fs::path& tmp) {
    std::vector<Backend> stores{{"file", "file://" + (tmp / "store").string()}};
    if (auto endpoint = moerl::env::get("MOERL_TEST_S3_ENDPOINT")) {
        ::setenv("AWS_ENDPOINT_URL_S3", endpoint->c_str(), 0);
        const std::string bucket = moerl::env::get_string("MOERL_TEST_S3_BUCKET", "moerl-test");
        stores.push_back({"s3rver", "s3://" + bucket + "/" + unique_name("bench")});
    }
    std::printf("\n## Checkpoint store: one file per row (median of %d; MB/s = MiB moved / s)\n", repeats);
    std::printf("%-8s %8s %12s %14s %12s %14s\n", "store", "MiB", "upload_s", "upload_MB/s", "download_s",
                "download_MB/s");
    std::vector<std::pair<size_t, std::pair<double, double>>> baselines;
    for (size_t mib : sizes_mib) {
        const fs::path src = tmp / ("src-" + std::to_string(mib));
        write_random_file(src, mib << 20);
        std::vector<double> sha_s, copy_s;
        for (int r = 0; r < repeats; ++r) {
            auto t0 = Clock::now();
            (void)moerl::control::sha256_file(src.string());
            sha_s.push_back(seconds_since(t0));
            t0 = Clock::now();
            fs::copy_file(src, tmp / "copy", fs::copy_options::overwrite_existing);
            copy_s.push_back(seconds_since(t0));
            fs::remove(tmp / "copy");
        }
        baselines.push_back({mib, {median(sha_s), median(copy_s)}});
        for (const auto& s : stores) {
            auto store = moerl::control::make_checkpoint_store(s.address);
            std::vector<double> up, down;
            for (int r = 0; r < repeats; ++r) {
                const std::string key = "ckpt/" + std::to_string(mib) + "-" + std::to_string(r);
                auto t0 = Clock::now();
                store->put_file(key, src.string());
                up.push_back(seconds_since(t0));
                const fs::path dst = tmp / "download";
                t0 = Clock::now();
                store->get_file(key, dst.string());
                down.push_back(seconds_since(t0));
                MOERL_CHECK(fs::file_size(dst) == (mib << 20), "store bench: ", s.label, " returned ",
                            fs::file_size(dst), " bytes for ", key, "; expected ", mib << 20);
                fs::remove(dst);
                store->remove(key);
            }
            const double u = median(up), d = median(down);
            std::printf("%-8s %8zu %12.3f %14.0f %12.3f %14.0f\n", s.label.c_str(), mib, u, mib / u, d,
                        mib / d);
        }
        fs::remove(src);
    }
    std::printf("\nBaselines, same run and files:\n%-8s %12s %14s\n", "MiB", "sha256_MB/s", "file_copy_MB/s");
    for (const auto& [mib, b] : baselines)
        std::printf("%-8zu %12.0f %14.0f\n", mib, mib / b.first, mib / b.second);
}

std::vector<size_t> parse_sizes(const std::string& text) {
    std::vector<size_t> out;
    size_t pos = 0;
    while (pos < text.size()) {
        size_t comma = text.find(',', pos);
        if (comma == std::string::npos) comma = text.size();
        const std::string item = text.substr(pos, comma - pos);
        char* end = nullptr;
        const unsigned long v = std::strtoul(item.c_str(), &end, 10);
        MOERL_CHECK(!item.empty() && end && *end == '\0' && v >= 1, "--sizes-mib: '", item,
                    "' is not a size in MiB; expected e.g. 8,64,256");
        out.push_back(v);
        pos = comma + 1;
    }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    int num_tasks = 2000, repeats = 3;
    std::string sizes = "8,64,256";
    try {
        for (int i = 1; i < argc; ++i) {
            const std::string arg = argv[i];
            auto value = [&](const char* name) {
                MOERL_CHECK(i + 1 < argc, name, " needs a value");
                return std::string(argv[++i]);
            };
            if (arg == "--tasks") {
                num_tasks = std::stoi(value("--tasks"));
            } else if (arg == "--sizes-mib") {
                sizes = value("--sizes-mib");
            } else if (arg == "--repeats") {
                repeats = std::stoi(value("--repeats"));
            } else if (arg == "--quick") {
                num_tasks = 300;
                sizes = "8";
                repeats = 1;
            } else {
                MOERL_CHECK(false, "unknown argument '", arg,
                            "'; expected --tasks N, --sizes-mib A,B,C, --repeats R or --quick");
            }
        }
        MOERL_CHECK(num_tasks >= 1 && repeats >= 1, "--tasks ", num_tasks, " --repeats ", repeats,
                    "; expected both >= 1");
        const fs::path tmp = fs::temp_directory_path() / unique_name("moerl-control-bench");
        fs::create_directories(tmp);
        std::printf("# moerl_control_bench (redis: %s, s3: %s)\n",
                    moerl::env::get_string("MOERL_TEST_REDIS_URL", "not set").c_str(),
                    moerl::env::get_string("MOERL_TEST_S3_ENDPOINT", "not set").c_str());
        const auto backends = queue_backends();
        bench_queue(backends, num_tasks, 512);
        bench_failover(backends, repeats);
        bench_store(parse_sizes(sizes), repeats, tmp);
        fs::remove_all(tmp);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "moerl_control_bench: error: %s\n", e.what());
        return 1;
    }
    return 0;
}
