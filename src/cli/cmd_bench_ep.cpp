// `moerl bench ep`: dispatch/combine time and bandwidth per transport and rank count, with an
// all-to-all of the same bytes through c10d (Gloo on CPU) measured in the same run as the baseline.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
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

#include "commands.hpp"
#include "launch.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/ep/c10d_store.hpp"

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
    int num_sms = 0;                            // 0: the Config default
    bool async = false;                         // Config.async (the cuda engine)
    std::vector<std::string> dispatch{"bf16"};  // bf16 (as dtype) and/or fp8 (e4m3 dispatch)
};

// One configuration's figures, averaged over ranks (microseconds; 0 = not measured).
struct BenchResult {
    std::string transport, dispatch, error;
    int world = 0;
    std::string case_name;
    double rows = 0, remote_rows = 0, dispatch_us = 0, combine_us = 0, baseline_us = 0, ll_dispatch_us = 0,
           ll_combine_us = 0;
    // On a device: the same calls timed on the stream (CUDA events just before and after each), without
    // the synchronisation that the times above include (the host's work up to the launch stays in).
    double dispatch_device_us = 0, combine_device_us = 0, baseline_device_us = 0;
};

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

// One rank of one configuration; returns its measurements.
Json run_rank(const BenchOpts& o, const std::string& transport, const BenchCase& bc, bool fp8, int world,
              int rank, int port) {
    auto tcp = connect_local_store(port, world, std::chrono::seconds(120));
    ep::C10dStore store(c10::make_intrusive<c10d::PrefixStore>("ep", tcp));

    ep::Config c;
    c.world_size = world;
    c.rank = rank;
    c.num_experts = bc.experts;
    c.hidden = bc.hidden;
    c.top_k = bc.top_k;
    c.max_tokens_per_rank = bc.tokens;
    c.dtype = ep::parse_dtype(o.dtype);
    c.fp8_dispatch = fp8;
    c.low_latency = o.low_latency && bc.tokens <= 128;
    c.timeout_s = 120;
    if (o.num_sms > 0) c.num_sms = o.num_sms;
    c.async = o.async;
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
    const int scale_cols = H / ep::kFp8BlockCols;
    // With fp8 dispatch the received rows are e4m3 bytes plus scales; combine takes bf16 rows.
    auto recv_x = fp8 ? torch::empty({max_recv, H}, x.options().dtype(torch::kUInt8))
                      : torch::empty({max_recv, H}, x.options());
    auto recv_scales = torch::empty({fp8 ? max_recv : 0, scale_cols}, x.options().dtype(torch::kFloat32));
    auto y = fp8 ? torch::randn({max_recv, H}, torch::TensorOptions().dtype(dt)).to(device) : recv_x;
    auto recv_idx = torch::empty({max_recv, K}, topk_d.options());
    auto recv_w = torch::empty({max_recv, K}, weights_d.options());
    auto out = torch::empty({T, H}, x.options());
    ep::DispatchOutput dout{{recv_x.data_ptr(), max_recv, H},
                            {},
                            {recv_idx.data_ptr<int64_t>(), max_recv, K},
                            {recv_w.data_ptr<float>(), max_recv, K}};
    if (fp8) dout.recv_x_scales = {recv_scales.data_ptr<float>(), max_recv, scale_cols};
    ep::View<const void> xv{x.data_ptr(), T, H};
    ep::View<const int64_t> iv{topk_d.data_ptr<int64_t>(), T, K};
    ep::View<const float> wv{weights_d.data_ptr<float>(), T, K};

    // On a device, the baseline is a device-to-device copy of the bytes each dispatch received: the
    // bandwidth a permute could reach at best. A plain cudaMemcpyAsync on the stream the engine uses
    // (the legacy default stream), timed like the EP calls and in the same iterations (between
    // them), so both see the same clocks and host jitter and no framework overhead (such as
    // Tensor::copy_'s) is counted against the copy.
    const bool copy_baseline = o.baseline && buffer.on_device();
    at::Tensor copy_src, copy_dst;
    if (copy_baseline) {
        copy_src = torch::empty({std::max<int64_t>(max_recv, 1), H}, x.options());
        copy_dst = torch::empty_like(copy_src);
    }
    std::vector<double> t_dispatch, t_combine, t_copy, d_dispatch, d_combine, d_copy;
    // Events on the stream the engine and the copy use (the legacy default stream), recorded just
    // before and after each call: its time on the device without the synchronisation (copy_baseline
    // holds only on a device, so without CUDA both helpers are never reached).
#if defined(MOERL_HAVE_CUDA)
    cudaEvent_t ev[4] = {};
    if (copy_baseline)
        for (auto& e : ev) MOERL_CHECK(cudaEventCreate(&e) == cudaSuccess, "bench: cudaEventCreate failed");
    auto mark = [&](int i) {
        if (copy_baseline) cudaEventRecord(ev[i], 0);
    };
    auto elapsed_us = [&](int a, int b) {
        float ms = 0;
        cudaEventElapsedTime(&ms, ev[a], ev[b]);
        return 1e3 * ms;
    };
#else
    auto mark = [](int) {};
    auto elapsed_us = [](int, int) { return 0.0; };
#endif
    ep::Handle h;
    for (int i = 0; i < o.warmup + o.iters; ++i) {
        sync();
        auto t0 = std::chrono::steady_clock::now();
        mark(0);
        h = buffer.dispatch(xv, iv, wv, dout);
        mark(1);
        sync();
        auto t1 = std::chrono::steady_clock::now();
        mark(2);
        buffer.combine({y.data_ptr(), h.num_recv_tokens(), H}, h, {out.data_ptr(), T, H});
        mark(3);
        sync();
        auto t2 = std::chrono::steady_clock::now();
        if (i >= o.warmup) {
            t_dispatch.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
            t_combine.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
            if (copy_baseline) {
                d_dispatch.push_back(elapsed_us(0, 1));
                d_combine.push_back(elapsed_us(2, 3));
            }
        }
#if defined(MOERL_HAVE_CUDA)
        if (copy_baseline) {
            const size_t copy_bytes = static_cast<size_t>(h.num_recv_tokens()) * H * c.element_bytes();
            auto c0 = std::chrono::steady_clock::now();
            mark(0);
            const cudaError_t err = cudaMemcpyAsync(copy_dst.data_ptr(), copy_src.data_ptr(), copy_bytes,
                                                    cudaMemcpyDeviceToDevice, 0);
            MOERL_CHECK(err == cudaSuccess, "baseline cudaMemcpyAsync failed: ", cudaGetErrorString(err));
            mark(1);
            sync();
            auto c1 = std::chrono::steady_clock::now();
            if (i >= o.warmup) {
                t_copy.push_back(std::chrono::duration<double, std::micro>(c1 - c0).count());
                d_copy.push_back(elapsed_us(0, 1));
            }
        }
#endif
    }
#if defined(MOERL_HAVE_CUDA)
    if (copy_baseline)
        for (auto& e : ev) cudaEventDestroy(e);
#endif
    Json r;
    if (copy_baseline && !t_copy.empty()) r["baseline_us"] = median(t_copy);
    r["recv_rows"] = h.num_recv_tokens();
    // Rows from other ranks: what crosses NVLink (or the network) rather than a local copy.
    r["remote_rows"] = h.num_recv_tokens() -
                       (static_cast<int>(h.num_recv_per_src.size()) > rank ? h.num_recv_per_src[rank] : 0);
    r["dispatch_us"] = median(t_dispatch);
    r["combine_us"] = median(t_combine);
    if (!d_copy.empty()) {
        r["dispatch_device_us"] = median(d_dispatch);
        r["combine_device_us"] = median(d_combine);
        r["baseline_device_us"] = median(d_copy);
    }

    if (c.low_latency) {
        const int L = c.num_local_experts();
        const int rows = L * c.low_latency_rows_per_expert();
        auto ll_x = fp8 ? torch::empty({rows, H}, x.options().dtype(torch::kUInt8))
                        : torch::empty({rows, H}, x.options());
        auto ll_scales = torch::empty({fp8 ? rows : 0, scale_cols}, x.options().dtype(torch::kFloat32));
        auto ll_y = fp8 ? torch::randn({rows, H}, torch::TensorOptions().dtype(dt)).to(device) : ll_x;
        auto ll_out = torch::empty({T, H}, x.options());
        ep::LowLatencyOutput ll_dout{{ll_x.data_ptr(), rows, H}};
        if (fp8) ll_dout.recv_x_scales = {ll_scales.data_ptr<float>(), rows, scale_cols};
        std::vector<double> t_ld, t_lc;
        for (int i = 0; i < o.warmup + o.iters; ++i) {
            sync();
            auto t0 = std::chrono::steady_clock::now();
            auto lh = buffer.low_latency_dispatch(xv, iv, ll_dout);
            sync();
            auto t1 = std::chrono::steady_clock::now();
            buffer.low_latency_combine({ll_y.data_ptr(), rows, H}, iv, wv, lh, {ll_out.data_ptr(), T, H});
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

BenchResult run_config(const BenchOpts& o, const std::string& transport, const BenchCase& bc, bool fp8,
                       int world) {
    BenchResult res;
    res.transport = transport;
    res.dispatch = fp8 ? "fp8" : o.dtype;
    res.world = world;
    res.case_name = bc.name;
    const std::vector<Json> ranks = run_forked_ranks(
        world, [&](int r, int port) { return run_rank(o, transport, bc, fp8, world, r, port); });
    for (int r = 0; r < world; ++r) {
        const Json& j = ranks[r];
        if (j.contains("error")) {
            res.error = "rank " + std::to_string(r) + ": " + j["error"].get<std::string>();
            break;
        }
        res.rows += j["recv_rows"].get<double>() / world;
        res.remote_rows += j["remote_rows"].get<double>() / world;
        res.dispatch_us += j["dispatch_us"].get<double>() / world;
        res.combine_us += j["combine_us"].get<double>() / world;
        res.baseline_us += j.value("baseline_us", 0.0) / world;
        res.ll_dispatch_us += j.value("ll_dispatch_us", 0.0) / world;
        res.ll_combine_us += j.value("ll_combine_us", 0.0) / world;
        res.dispatch_device_us += j.value("dispatch_device_us", 0.0) / world;
        res.combine_device_us += j.value("combine_device_us", 0.0) / world;
        res.baseline_device_us += j.value("baseline_device_us", 0.0) / world;
    }
    return res;
}

// Bytes one received row carries: the data (e4m3 + scales with fp8 dispatch) or the combined row.
double row_bytes(const BenchOpts& o, const BenchCase& bc, bool fp8, bool combine) {
    if (fp8 && !combine) return bc.hidden + bc.hidden / ep::kFp8BlockCols * 4.0;
    return bc.hidden * static_cast<double>(ep::dtype_size(ep::parse_dtype(o.dtype)));
}

void print_row(const BenchOpts& o, const BenchCase& bc, const BenchResult& r) {
    if (!r.error.empty()) {
        std::printf("| %-11s | %2d | %-9s | %-4s | error: %s\n", r.transport.c_str(), r.world,
                    bc.name.c_str(), r.dispatch.c_str(), r.error.c_str());
        std::fflush(stdout);
        return;
    }
    const bool fp8 = r.dispatch == "fp8";
    const double d_bytes = r.rows * row_bytes(o, bc, fp8, false),
                 c_bytes = r.rows * row_bytes(o, bc, fp8, true);
    auto gbps = [](double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; };
    std::printf(
        "| %-11s | %2d | %-9s | %-4s | %5d | %5d | %2d | %3d | %7.0f | %9.1f | %6.1f | %9.1f | %6.1f | %6.1f "
        "/ "
        "%6.1f | %9.1f | %6.1f |",
        r.transport.c_str(), r.world, bc.name.c_str(), r.dispatch.c_str(), bc.tokens, bc.hidden, bc.top_k,
        bc.experts, r.rows, r.dispatch_us, gbps(d_bytes, r.dispatch_us), r.combine_us,
        gbps(c_bytes, r.combine_us), gbps(d_bytes * r.remote_rows / std::max(r.rows, 1.0), r.dispatch_us),
        gbps(c_bytes * r.remote_rows / std::max(r.rows, 1.0), r.combine_us), r.baseline_us,
        gbps(c_bytes, r.baseline_us));
    if (r.ll_dispatch_us > 0)
        std::printf(" %7.1f / %7.1f |\n", r.ll_dispatch_us, r.ll_combine_us);
    else
        std::printf("       - |\n");
    std::fflush(stdout);
}

// Device-side times (events on the stream) next to the copy's, where they were measured.
void print_device_times(const std::vector<BenchResult>& results) {
    bool header = false;
    for (const auto& r : results) {
        if (!r.error.empty() || r.baseline_device_us <= 0) continue;
        if (!header) {
            std::printf(
                "\non the device (CUDA events just before and after each call on its stream: no "
                "synchronisation cost; the host's work up to the launch is still in, the stream idling until "
                "then)\n\n| transport | W | case | disp | dispatch us | combine us | copy us "
                "| "
                "dispatch: of copy bandwidth | combine: of copy bandwidth "
                "|\n|---|---|---|---|---|---|---|---|---|\n");
            header = true;
        }
        std::printf("| %s | %d | %s | %s | %.1f | %.1f | %.1f | %.1f%% | %.1f%% |\n", r.transport.c_str(),
                    r.world, r.case_name.c_str(), r.dispatch.c_str(), r.dispatch_device_us,
                    r.combine_device_us, r.baseline_device_us,
                    100.0 * r.baseline_device_us / r.dispatch_device_us,
                    100.0 * r.baseline_device_us / r.combine_device_us);
    }
}

// Each transport against the nccl one on the same world size, case and dispatch dtype.
void print_ratios(const std::vector<BenchResult>& results) {
    bool header = false;
    for (const auto& r : results) {
        if (r.transport == "nccl" || !r.error.empty()) continue;
        for (const auto& n : results) {
            if (n.transport != "nccl" || !n.error.empty() || n.world != r.world ||
                n.case_name != r.case_name || n.dispatch != r.dispatch)
                continue;
            if (!header) {
                std::printf(
                    "\nagainst nccl (time ratio nccl / transport; > 1 = faster than the baseline)\n\n"
                    "| transport | W | case | dispatch | dispatch x | combine x | LL dispatch+combine us | "
                    "nccl LL us | LL x |\n|---|---|---|---|---|---|---|---|---|\n");
                header = true;
            }
            const double ll = r.ll_dispatch_us + r.ll_combine_us, nll = n.ll_dispatch_us + n.ll_combine_us;
            std::printf("| %s | %d | %s | %s | %.2f | %.2f | ", r.transport.c_str(), r.world,
                        r.case_name.c_str(), r.dispatch.c_str(), n.dispatch_us / r.dispatch_us,
                        n.combine_us / r.combine_us);
            if (ll > 0 && nll > 0)
                std::printf("%.1f | %.1f | %.2f |\n", ll, nll, nll / ll);
            else
                std::printf("- | - | - |\n");
        }
    }
}

// GPU-to-GPU copy bandwidth between devices 0 and 1 (cudaMemcpyPeerAsync, 256 MiB): one direction,
// and both directions at once. Runs in a child process so the parent never initialises CUDA.
void print_peer_copy_bandwidth() {
#if defined(MOERL_HAVE_CUDA)
    const Json j = run_forked_ranks(1, [](int, int) -> Json {
        int count = 0;
        if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2)
            return {{"line", "GPU-to-GPU copy: fewer than 2 GPUs, not measured"}};
        int can01 = 0, can10 = 0;
        cudaDeviceCanAccessPeer(&can01, 0, 1);
        cudaDeviceCanAccessPeer(&can10, 1, 0);
        const size_t bytes = size_t{256} << 20;
        void *src[2], *dst[2];
        cudaStream_t st[2];
        cudaEvent_t ev[2][2];
        for (int d = 0; d < 2; ++d) {
            cudaSetDevice(d);
            if (can01 && can10) cudaDeviceEnablePeerAccess(1 - d, 0);
            cudaMalloc(&src[d], bytes);
            cudaMalloc(&dst[d], bytes);
            cudaMemset(src[d], 1, bytes);
            cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking);
            cudaEventCreate(&ev[d][0]);
            cudaEventCreate(&ev[d][1]);
        }
        // Copies device d's src into the other device's dst, iters times, on device d's stream.
        auto run = [&](bool both, int iters) {
            for (int d = 0; d < (both ? 2 : 1); ++d) {
                cudaSetDevice(d);
                cudaEventRecord(ev[d][0], st[d]);
                for (int i = 0; i < iters; ++i)
                    cudaMemcpyPeerAsync(dst[1 - d], 1 - d, src[d], d, bytes, st[d]);
                cudaEventRecord(ev[d][1], st[d]);
            }
            float ms = 0;
            for (int d = 0; d < (both ? 2 : 1); ++d) {
                cudaEventSynchronize(ev[d][1]);
                float t = 0;
                cudaEventElapsedTime(&t, ev[d][0], ev[d][1]);
                ms = std::max(ms, t);
            }
            return static_cast<double>(bytes) * iters / (ms * 1e6);  // GB/s per direction
        };
        run(true, 2);
        const double one = run(false, 10), both = run(true, 10);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess)
            return {{"line", std::string("GPU-to-GPU copy failed: ") + cudaGetErrorString(err)}};
        char line[256];
        std::snprintf(
            line, sizeof line,
            "GPU-to-GPU copy (cudaMemcpyPeerAsync, 256 MiB, GPU 0 <-> 1, peer access %s): %.0f GB/s one "
            "direction, %.0f GB/s per direction with both at once",
            can01 && can10 ? "on" : "off", one, both);
        return {{"line", line}};
    })[0];
    std::printf("%s\n", j.contains("error") ? ("GPU-to-GPU copy: " + j["error"].get<std::string>()).c_str()
                                            : j["line"].get<std::string>().c_str());
#endif
}

}  // namespace

void register_bench_ep(CLI::App& bench) {
    auto* cmd = bench.add_subcommand(
        "ep", "EP dispatch/combine per transport and rank count, with a Gloo all-to-all baseline");
    auto o = std::make_shared<BenchOpts>();
    cmd->add_option("--transport", o->transports, "transports: host, fabric/tcp, fabric/shm, cuda")
        ->delimiter(',');
    cmd->add_option("--ranks", o->ranks, "rank counts")->delimiter(',')->check(CLI::Range(1, 1024));
    cmd->add_option("--dtype", o->dtype, "bf16 or fp32");
    cmd->add_option("--iters", o->iters, "timed iterations (median reported)")->check(CLI::Range(1, 1 << 24));
    cmd->add_option("--tokens", o->big_tokens, "tokens per rank of the DeepSeek-V3-shaped case")
        ->check(CLI::Range(1, 1 << 24));
    cmd->add_flag("!--no-baseline", o->baseline,
                  "skip the baseline (Gloo all-to-all, or device copy for cuda)");
    cmd->add_option("--sms", o->num_sms, "SMs for the cuda kernels (Config.num_sms; 0 = default)")
        ->check(CLI::Range(0, 1024));
    cmd->add_flag("--async", o->async,
                  "cuda: calls skip their end-of-call synchronisation (Config.async); the benchmark "
                  "synchronises around every call itself");
    cmd->add_option("--dispatch", o->dispatch,
                    "dispatch formats: bf16 (the dtype) and/or fp8 (e4m3 + scales)")
        ->delimiter(',');
    cmd->callback([o] {
        const std::vector<BenchCase> cases = {{"decode", 128, 7168, 8, 256},
                                              {"dsv3", o->big_tokens, 7168, 8, 256}};
        for (const auto& d : o->dispatch)
            MOERL_CHECK(d == "fp8" || d == o->dtype, "--dispatch ", d, " is not supported, expected ",
                        o->dtype, " or fp8");
        std::printf(
            "dtype %s, %d timed iterations, median; GB/s = received rows x row bytes (fp8 dispatch: e4m3 + "
            "scales) / time, per rank; from peers: the rows other ranks sent (NVLink or network); baseline = "
            "c10d Gloo all-to-all of the same bytes (host memory) or a "
            "device-to-device copy of the same bytes on the rank's GPU (cuda, nccl)\n",
            o->dtype.c_str(), o->iters);
        const bool device = std::any_of(o->transports.begin(), o->transports.end(),
                                        [](const std::string& t) { return t == "cuda" || t == "nccl"; });
        if (device && *std::max_element(o->ranks.begin(), o->ranks.end()) > 1) print_peer_copy_bandwidth();
        std::printf(
            "\n| transport   |  W | case      | disp | tok/r | hidden |  K | E   | rows/r | dispatch us | "
            "GB/s | "
            "combine us | GB/s | from peers GB/s d / c | baseline us | GB/s | LL disp/comb us |\n");
        std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        std::vector<BenchResult> results;
        for (const auto& t : o->transports)
            for (int w : o->ranks)
                for (const auto& d : o->dispatch)
                    for (const auto& bc : cases) {
                        results.push_back(run_config(*o, t, bc, d == "fp8", w));
                        print_row(*o, bc, results.back());
                    }
        print_device_times(results);
        print_ratios(results);
    });
}

}  // namespace moerl::cli
