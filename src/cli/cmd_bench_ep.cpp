// `moerl bench ep`: dispatch/combine time and bandwidth per transport and rank count, with an
// all-to-all of the same bytes through c10d (Gloo on CPU) measured in the same run as the baseline.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#if __has_include(<gloo/algorithm.h>)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#define MOERL_HAVE_GLOO 1
#endif
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(MOERL_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include "c10d_store.hpp"
#include "commands.hpp"
#include "launch.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"

namespace moerl::cli {

namespace {

using Json = nlohmann::json;

struct BenchCase {
    std::string name;
    int tokens, hidden, top_k, experts;
};

struct BenchOpts {
    std::vector<std::string> transports{"host"};
    std::vector<int> ranks{2, 4};
    std::string dtype = "bf16";
    int iters = 10;
    int warmup = 2;
    int big_tokens = 512;
    bool baseline = true;
    bool low_latency = true;
    int num_sms = 0;  // 0: the Config default
};

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

// One rank of one configuration; returns its measurements.
Json run_rank(const BenchOpts& o, const std::string& transport, const BenchCase& bc, int world, int rank,
              int port) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = false;
    so.numWorkers = world;
    so.timeout = std::chrono::seconds(120);
    auto tcp = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    C10dStore store(c10::make_intrusive<c10d::PrefixStore>("ep", tcp));

    ep::Config c;
    c.world_size = world;
    c.rank = rank;
    c.num_experts = bc.experts;
    c.hidden = bc.hidden;
    c.top_k = bc.top_k;
    c.max_tokens_per_rank = bc.tokens;
    c.dtype = ep::parse_dtype(o.dtype);
    c.low_latency = o.low_latency && bc.tokens <= 128;
    c.timeout_s = 120;
    if (o.num_sms > 0) c.num_sms = o.num_sms;
    c.job_id = "bench";
    c.set_transport(transport);
    ep::Buffer buffer(c, &store);
    const auto device = buffer.on_device() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    const auto dt = c.dtype == ep::DType::kFloat32 ? torch::kFloat32 : torch::kBFloat16;
    auto sync = [&] {
#if defined(MOERL_HAVE_CUDA)
        if (buffer.on_device()) torch::cuda::synchronize();
#endif
    };

    // Uniform routing: top-k distinct experts per token from random scores.
    torch::manual_seed(1234 + rank);
    const int T = bc.tokens, H = bc.hidden, K = bc.top_k;
    auto x = torch::randn({T, H}, torch::TensorOptions().dtype(dt)).to(device);
    auto scores = torch::rand({T, bc.experts});
    auto topk = std::get<1>(scores.topk(K, 1)).to(torch::kInt64).contiguous();
    auto weights = torch::rand({T, K}).contiguous();
    auto topk_d = topk.to(device), weights_d = weights.to(device);
    const int max_recv = c.max_recv_tokens();
    auto recv_x = torch::empty({max_recv, H}, x.options());
    auto recv_idx = torch::empty({max_recv, K}, topk_d.options());
    auto recv_w = torch::empty({max_recv, K}, weights_d.options());
    auto out = torch::empty({T, H}, x.options());
    ep::DispatchOutput dout{{recv_x.data_ptr(), max_recv, H},
                            {},
                            {recv_idx.data_ptr<int64_t>(), max_recv, K},
                            {recv_w.data_ptr<float>(), max_recv, K}};
    ep::View<const void> xv{x.data_ptr(), T, H};
    ep::View<const int64_t> iv{topk_d.data_ptr<int64_t>(), T, K};
    ep::View<const float> wv{weights_d.data_ptr<float>(), T, K};

    std::vector<double> t_dispatch, t_combine;
    ep::Handle h;
    for (int i = 0; i < o.warmup + o.iters; ++i) {
        sync();
        auto t0 = std::chrono::steady_clock::now();
        h = buffer.dispatch(xv, iv, wv, dout);
        sync();
        auto t1 = std::chrono::steady_clock::now();
        buffer.combine({recv_x.data_ptr(), h.num_recv_tokens(), H}, h, {out.data_ptr(), T, H});
        sync();
        auto t2 = std::chrono::steady_clock::now();
        if (i >= o.warmup) {
            t_dispatch.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
            t_combine.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
        }
    }
    Json r;
    r["recv_rows"] = h.num_recv_tokens();
    r["dispatch_us"] = median(t_dispatch);
    r["combine_us"] = median(t_combine);

    if (c.low_latency) {
        const int L = c.num_local_experts();
        const int rows = L * c.low_latency_rows_per_expert();
        auto ll_x = torch::empty({rows, H}, x.options());
        auto ll_out = torch::empty({T, H}, x.options());
        std::vector<double> t_ld, t_lc;
        for (int i = 0; i < o.warmup + o.iters; ++i) {
            sync();
            auto t0 = std::chrono::steady_clock::now();
            auto lh = buffer.low_latency_dispatch(xv, iv, {{ll_x.data_ptr(), rows, H}});
            sync();
            auto t1 = std::chrono::steady_clock::now();
            buffer.low_latency_combine({ll_x.data_ptr(), rows, H}, iv, wv, lh, {ll_out.data_ptr(), T, H});
            sync();
            auto t2 = std::chrono::steady_clock::now();
            if (i >= o.warmup) {
                t_ld.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
                t_lc.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
            }
        }
        r["ll_dispatch_us"] = median(t_ld);
        r["ll_combine_us"] = median(t_lc);
    }

#if defined(MOERL_HAVE_CUDA)
    if (o.baseline && buffer.on_device()) {
        // Device-to-device copy of the same bytes: the bandwidth a permute could reach at best. A plain
        // cudaMemcpyAsync on the stream the engine uses (the legacy default stream), timed like the EP
        // calls, so no framework overhead (such as Tensor::copy_'s) is counted against the copy.
        auto src = torch::empty({std::max(h.num_recv_tokens(), 1), H}, x.options());
        auto dst = torch::empty_like(src);
        const size_t copy_bytes = static_cast<size_t>(h.num_recv_tokens()) * H * c.element_bytes();
        std::vector<double> t_copy;
        for (int i = 0; i < o.warmup + o.iters; ++i) {
            sync();
            auto t0 = std::chrono::steady_clock::now();
            const cudaError_t err =
                cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), copy_bytes, cudaMemcpyDeviceToDevice, 0);
            MOERL_CHECK(err == cudaSuccess, "baseline cudaMemcpyAsync failed: ", cudaGetErrorString(err));
            sync();
            auto t1 = std::chrono::steady_clock::now();
            if (i >= o.warmup) t_copy.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        r["baseline_us"] = median(t_copy);
    }
#endif
#ifdef MOERL_HAVE_GLOO
    if (o.baseline && world > 1 && !buffer.on_device()) {
        // The same bytes through Gloo's all-to-all: rows this rank sends to each peer.
        auto opts = c10d::ProcessGroupGloo::Options::create();
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        opts->timeout = std::chrono::seconds(120);
        c10d::ProcessGroupGloo pg(c10::make_intrusive<c10d::PrefixStore>("gloo", tcp), rank, world, opts);
        const int64_t row_bytes = static_cast<int64_t>(H) * c.element_bytes();
        std::vector<int64_t> in_split(world), out_split(world);
        // Split sizes are rows (dim 0) of [rows, row_bytes] byte tensors.
        for (int p = 0; p < world; ++p) in_split[p] = h.num_send_per_rank[p];
        for (int p = 0; p < world; ++p) out_split[p] = h.num_recv_per_src[p];
        int64_t in_total = 0, out_total = 0;
        for (int p = 0; p < world; ++p) in_total += in_split[p], out_total += out_split[p];
        auto in = torch::randint(0, 255, {in_total, row_bytes}, torch::kUInt8);
        auto outb = torch::empty({out_total, row_bytes}, torch::kUInt8);
        std::vector<double> t_a2a;
        for (int i = 0; i < o.warmup + o.iters; ++i) {
            auto t0 = std::chrono::steady_clock::now();
            auto out_counts = out_split, in_counts = in_split;  // c10d moves the split vectors away
            pg.alltoall_base(outb, in, out_counts, in_counts)->wait();
            auto t1 = std::chrono::steady_clock::now();
            if (i >= o.warmup) t_a2a.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        r["baseline_us"] = median(t_a2a);
    }
#endif
    buffer.destroy();
    return r;
}

void run_config(const BenchOpts& o, const std::string& transport, const BenchCase& bc, int world) {
    int port = 0;
    auto server = host_tcp_store(port, world);
    const std::string dir = (std::filesystem::temp_directory_path() /
                             ("moerl-bench-" + std::to_string(getpid()) + "-" + std::to_string(port)))
                                .string();
    std::filesystem::create_directories(dir);
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
        pid_t pid = fork();
        if (pid == 0) {
            int code = 0;
            Json j;
            try {
                j = run_rank(o, transport, bc, world, r, port);
            } catch (const std::exception& e) {
                j["error"] = e.what();
                code = 1;
            }
            std::ofstream(dir + "/" + std::to_string(r)) << j.dump();
            _exit(code);
        }
        pids.push_back(pid);
    }
    for (pid_t p : pids) waitpid(p, nullptr, 0);
    // Average over ranks; bandwidth per rank = received bytes / time.
    const double elem = ep::dtype_size(ep::parse_dtype(o.dtype));
    double rows = 0, d = 0, cmb = 0, g = 0, ld = 0, lc = 0;
    std::string error;
    for (int r = 0; r < world; ++r) {
        std::ifstream f(dir + "/" + std::to_string(r));
        std::stringstream ss;
        ss << f.rdbuf();
        Json j = Json::parse(ss.str().empty() ? "{\"error\":\"rank crashed\"}" : ss.str());
        if (j.contains("error")) {
            error = j["error"].get<std::string>();
            break;
        }
        rows += j["recv_rows"].get<double>();
        d += j["dispatch_us"].get<double>();
        cmb += j["combine_us"].get<double>();
        g += j.value("baseline_us", 0.0);
        ld += j.value("ll_dispatch_us", 0.0);
        lc += j.value("ll_combine_us", 0.0);
    }
    // One file per rank, then the folder (remove_all is avoided: some LibTorch builds export a broken copy).
    for (int r = 0; r < world; ++r) std::remove((dir + "/" + std::to_string(r)).c_str());
    ::rmdir(dir.c_str());
    if (!error.empty()) {
        std::printf("| %-11s | %2d | %-9s | error: %s\n", transport.c_str(), world, bc.name.c_str(),
                    error.c_str());
        return;
    }
    rows /= world, d /= world, cmb /= world, g /= world, ld /= world, lc /= world;
    const double bytes = rows * bc.hidden * elem;
    auto gbps = [&](double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; };
    std::printf(
        "| %-11s | %2d | %-9s | %5d | %5d | %2d | %3d | %7.0f | %9.1f | %6.2f | %9.1f | %6.2f | %9.1f | "
        "%6.2f |",
        transport.c_str(), world, bc.name.c_str(), bc.tokens, bc.hidden, bc.top_k, bc.experts, rows, d,
        gbps(d), cmb, gbps(cmb), g, gbps(g));
    if (ld > 0)
        std::printf(" %7.1f / %7.1f |\n", ld, lc);
    else
        std::printf("       - |\n");
    std::fflush(stdout);
}

}  // namespace

void register_bench_ep(CLI::App& bench) {
    auto* cmd = bench.add_subcommand(
        "ep", "EP dispatch/combine per transport and rank count, with a Gloo all-to-all baseline");
    auto o = std::make_shared<BenchOpts>();
    cmd->add_option("--transport", o->transports, "transports: host, fabric/tcp, fabric/shm, cuda")
        ->delimiter(',');
    cmd->add_option("--ranks", o->ranks, "rank counts")->delimiter(',');
    cmd->add_option("--dtype", o->dtype, "bf16 or fp32");
    cmd->add_option("--iters", o->iters, "timed iterations (median reported)");
    cmd->add_option("--tokens", o->big_tokens, "tokens per rank of the DeepSeek-V3-shaped case");
    cmd->add_flag("!--no-baseline", o->baseline,
                  "skip the baseline (Gloo all-to-all, or device copy for cuda)");
    cmd->add_option("--sms", o->num_sms, "SMs for the cuda kernels (Config.num_sms; 0 = default)");
    cmd->callback([o] {
        const std::vector<BenchCase> cases = {{"decode", 128, 7168, 8, 256},
                                              {"dsv3", o->big_tokens, 7168, 8, 256}};
        std::printf(
            "dtype %s, %d timed iterations, median; GB/s = received rows x hidden x element size / time, "
            "per rank; baseline = c10d Gloo all-to-all of the same bytes (host memory) or a "
            "device-to-device copy of the same bytes (cuda)\n\n",
            o->dtype.c_str(), o->iters);
        std::printf(
            "| transport   |  W | case      | tok/r | hidden |  K | E   | rows/r | dispatch us | GB/s | "
            "combine us | GB/s | baseline us | GB/s | LL disp/comb us |\n");
        std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (const auto& t : o->transports)
            for (int w : o->ranks)
                for (const auto& bc : cases) run_config(*o, t, bc, w);
    });
}

}  // namespace moerl::cli
