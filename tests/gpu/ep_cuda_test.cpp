// The cuda and nccl EP engines against the host reference: every rank runs the same calls on a host
// Buffer and a device Buffer with the same inputs and compares outputs and handles. Ranks are forked
// processes sharing one GPU (cuda) or one GPU each (nccl). The parent never initialises CUDA.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>

#include "cuda/stream.hpp"
#include "mismatches.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "ranks.hpp"
#include "reference.hpp"

namespace moerl::test {
namespace {

#define CK(call) \
    MOERL_CHECK((call) == cudaSuccess, #call, " failed: ", cudaGetErrorString(cudaGetLastError()))

// Visible devices, probed in a child so the parent stays free of CUDA.
int device_count() {
    static int count = -1;
    if (count >= 0) return count;
    count = 0;
    for (int n = 1; n <= 8; ++n) {
        auto r = run_ranks(1, [n](int) {
            int c = 0;
            if (cudaGetDeviceCount(&c) != cudaSuccess || c < n) throw std::runtime_error("fewer");
        });
        if (r[0].exit_code != 0) break;
        count = n;
    }
    return count;
}

// The counts of a dispatch handle against the host reference's (the host vectors are checked apart:
// asynchronous mode leaves them empty).
void expect_same_counts(Mismatches& m, const ep::Handle& got, const ep::Handle& want) {
    m.expect(got.num_tokens == want.num_tokens, "num_tokens");
    m.expect(got.num_recv_per_src == want.num_recv_per_src, "num_recv_per_src");
    m.expect(got.recv_src_offset == want.recv_src_offset, "recv_src_offset");
    m.expect(got.num_send_per_rank == want.num_send_per_rank, "num_send_per_rank");
    m.expect(got.num_recv_tokens_per_expert == want.num_recv_tokens_per_expert, "num_recv_tokens_per_expert");
}

// Device memory filled from / read back to host vectors.
struct Dev {
    void* p = nullptr;
    size_t bytes = 0;
    explicit Dev(size_t n, int poison = 0) : bytes(std::max<size_t>(n, 16)) {
        CK(cudaMalloc(&p, bytes));
        CK(cudaMemset(p, poison, bytes));
    }
    template <typename T>
    Dev(const std::vector<T>& v) : Dev(v.size() * sizeof(T)) {
        if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    ~Dev() { cudaFree(p); }
    template <typename T>
    T* as() const {
        return static_cast<T*>(p);
    }
    template <typename T>
    std::vector<T> read(size_t n) const {
        std::vector<T> out(n);
        CK(cudaDeviceSynchronize());
        if (n) CK(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
        return out;
    }
    void poison(int v) { CK(cudaMemset(p, v, bytes)); }
};

// A new non-blocking stream (the tests make it current for the engines with a StreamGuard).
cudaStream_t new_stream() {
    cudaStream_t stream = nullptr;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
}

// The calls record() queues on `stream`, captured in a CUDA graph (this thread only) and instantiated.
class Graph {
  public:
    template <typename F>
    Graph(cudaStream_t stream, F&& record) : stream_(stream) {
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        record();
        CK(cudaStreamEndCapture(stream, &graph_));
        CK(cudaGraphInstantiate(&exec_, graph_, 0));
    }
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
    ~Graph() {
        if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
        if (graph_ != nullptr) cudaGraphDestroy(graph_);
    }
    // Runs the graph once and waits for it.
    void replay() const {
        CK(cudaGraphLaunch(exec_, stream_));
        CK(cudaStreamSynchronize(stream_));
    }
    // Frees the graph now, checking that it can be.
    void destroy() {
        CK(cudaGraphExecDestroy(exec_));
        exec_ = nullptr;
        CK(cudaGraphDestroy(graph_));
        graph_ = nullptr;
    }

  private:
    cudaStream_t stream_;
    cudaGraph_t graph_ = nullptr;
    cudaGraphExec_t exec_ = nullptr;
};

struct Case {
    std::string transport;
    int world;
    ep::DType dtype;
    int num_experts;
    int top_k;
    bool fp8 = false;
    int hidden = 72;
    int max_tokens = 40;
    int num_sms = 8;
    int empty_every = 0;  // > 0: tokens t with t % empty_every == 1 name no expert (all ids -1)
    bool crowd = false;   // every token of every rank names expert 0 in all entries (crowd_one_expert)
};

void PrintTo(const Case& c, std::ostream* os) {
    *os << c.transport << " world=" << c.world << " " << ep::dtype_name(c.dtype) << (c.fp8 ? "+fp8" : "")
        << " experts=" << c.num_experts << " top_k=" << c.top_k << " hidden=" << c.hidden
        << " max_tokens=" << c.max_tokens << (c.crowd ? " crowd" : "");
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
    const Case& c = info.param;
    std::string transport = c.transport;  // "cuda-fabric/shm" -> "cuda_fabric_shm"
    for (char& ch : transport)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    return transport + "_w" + std::to_string(c.world) + "_" + ep::dtype_name(c.dtype) +
           (c.fp8 ? "_fp8" : "") + "_e" + std::to_string(c.num_experts) + "_k" + std::to_string(c.top_k) +
           "_h" + std::to_string(c.hidden) + "_t" + std::to_string(c.max_tokens) +
           (c.empty_every > 0 ? "_empty" + std::to_string(c.empty_every) : "") + (c.crowd ? "_crowd" : "");
}

// Tokens t with t % every == 1 % every lose all their experts (every one of them for every = 1; none for
// every <= 0).
void clear_experts(RankInput& in, int top_k, int every) {
    if (every <= 0) return;
    for (int t = 1 % every; t < in.num_tokens; t += every)
        for (int k = 0; k < top_k; ++k) in.topk_idx[static_cast<size_t>(t) * top_k + k] = -1;
}

ep::Config make_config(const Case& tc, int rank, const std::string& transport, bool async = false) {
    ep::Config c;
    c.world_size = tc.world;
    c.rank = rank;
    c.num_experts = tc.num_experts;
    c.hidden = tc.hidden;
    c.top_k = tc.top_k;
    c.max_tokens_per_rank = tc.max_tokens;
    c.dtype = tc.dtype;
    c.fp8_dispatch = tc.fp8;
    c.timeout_s = 30;
    c.num_sms = tc.num_sms;
    c.job_id = "gpu";
    c.set_transport(transport);
    c.async = async;
    return c;
}

// Dequantized value j of an fp8 row, or the plain value.
float value_at(const ep::Config& c, const uint8_t* row, const float* scales, int j) {
    if (!c.fp8_dispatch) return ep::load_as_float(row, j, c.dtype);
    return ep::e4m3_to_float(row[j]) * scales[j / ep::kFp8BlockCols];
}

// Data rows: bit-identical, or with fp8 within one e4m3 step of the host's quantization.
void compare_rows(Mismatches& m, const ep::Config& c, const std::string& what, const uint8_t* got,
                  const float* got_scales, const uint8_t* want, const float* want_scales) {
    const int H = c.hidden;
    if (!c.fp8_dispatch) {
        m.expect(std::memcmp(got, want, H * c.element_bytes()) == 0, what + ": data differs");
        return;
    }
    const int nb = H / ep::kFp8BlockCols;
    for (int b = 0; b < nb; ++b)
        m.expect(std::fabs(got_scales[b] - want_scales[b]) <= 1e-6f * std::fabs(want_scales[b]),
                 what + ": scale " + std::to_string(b));
    for (int j = 0; j < H; ++j) {
        const float g = value_at(c, got, got_scales, j), w = value_at(c, want, want_scales, j);
        m.expect(std::fabs(g - w) <= 0.07f * std::fabs(w) + want_scales[j / ep::kFp8BlockCols] * 1.01f,
                 what + " col " + std::to_string(j) + ": got " + std::to_string(g) + ", want " +
                     std::to_string(w));
    }
}

void compare_floats(Mismatches& m, const ep::Config& c, const std::string& what, const uint8_t* got,
                    const uint8_t* want, int rows) {
    const float tol = 3 * tolerance(c.dtype);
    for (int t = 0; t < rows; ++t)
        for (int j = 0; j < c.hidden; ++j) {
            const size_t i = static_cast<size_t>(t) * c.hidden + j;
            const float g = ep::load_as_float(got, i, c.dtype), w = ep::load_as_float(want, i, c.dtype);
            m.expect(std::fabs(g - w) <= tol * (std::fabs(w) + 1e-2f),
                     what + " row " + std::to_string(t) + " col " + std::to_string(j) + ": got " +
                         std::to_string(g) + ", want " + std::to_string(w));
        }
}

// One rank: for several rounds of fresh data, every call on the host reference and on the device
// engine, outputs poisoned first, results compared.
void conformance(const Case& tc, int rank, uint64_t seed, const std::string& dir) {
    // The handles' host copies (send_pos, recv_src_token) are compared: Config.async stays off.
    auto store = ep::make_file_store(dir);
    const ep::Config hc = make_config(tc, rank, "host");
    const ep::Config dc = make_config(tc, rank, tc.transport);
    ep::Buffer host(hc, store.get());
    ep::Buffer dev(dc, store.get());
    MOERL_CHECK(dev.on_device(), "the ", tc.transport, " buffer is not on the device");
    const ep::Config& c = hc;
    const int W = c.world_size, K = c.top_k, H = c.hidden, L = c.num_local_experts();
    const int max_recv = c.max_recv_tokens();
    const int nb = std::max(1, H / ep::kFp8BlockCols);
    const size_t out_row = c.fp8_dispatch ? H : H * c.element_bytes();
    const size_t y_row = H * c.element_bytes();
    const int rows_per_expert = c.low_latency_rows_per_expert();
    const int ll_rows = L * rows_per_expert;

    for (int round = 0; round < 3; ++round) {
        const std::string tag = " (rank " + std::to_string(rank) + ", round " + std::to_string(round) + ")";
        RankInput in = make_input(c, seed + round, rank, W > 1 ? (round % W) : -1);
        clear_experts(in, K, tc.empty_every);
        if (tc.crowd) crowd_one_expert(c, in, rank, 0);
        const int T = in.num_tokens;
        Dev x(in.x), idx(in.topk_idx), w(in.topk_weights);

        // --- normal dispatch ---
        std::vector<uint8_t> h_x(static_cast<size_t>(max_recv) * out_row);
        std::vector<float> h_scales(static_cast<size_t>(max_recv) * nb);
        std::vector<int64_t> h_idx(static_cast<size_t>(max_recv) * K);
        std::vector<float> h_w(static_cast<size_t>(max_recv) * K);
        ep::DispatchOutput h_out{{h_x.data(), max_recv, H},
                                 {h_scales.data(), max_recv, nb},
                                 {h_idx.data(), max_recv, K},
                                 {h_w.data(), max_recv, K}};
        ep::Handle hh = host.dispatch(x_view(c, in), idx_view(c, in), weights_view(c, in), h_out);
        const int R = hh.num_recv_tokens();

        Dev d_x(h_x.size(), 0xAB), d_scales(h_scales.size() * 4, 0xC7), d_idx(h_idx.size() * 8, 0x5A),
            d_w(h_w.size() * 4, 0x6B);
        ep::DispatchOutput d_out{{d_x.p, max_recv, H},
                                 {d_scales.as<float>(), max_recv, nb},
                                 {d_idx.as<int64_t>(), max_recv, K},
                                 {d_w.as<float>(), max_recv, K}};
        ep::View<const void> dxv{x.p, T, H};
        ep::View<const int64_t> div{idx.as<int64_t>(), T, K};
        ep::View<const float> dwv{w.as<float>(), T, K};
        ep::Handle dh = dev.dispatch(dxv, div, dwv, d_out);

        auto check_dispatch = [&](const std::string& what, const ep::Handle& got) {
            Mismatches m(what + tag);
            expect_same_counts(m, got, hh);
            m.expect(got.send_pos == hh.send_pos, "send_pos");
            m.expect(got.recv_src_token == hh.recv_src_token, "recv_src_token");
            m.done();
            const auto gx = d_x.read<uint8_t>(static_cast<size_t>(R) * out_row);
            const auto gs = d_scales.read<float>(static_cast<size_t>(R) * nb);
            const auto gi = d_idx.read<int64_t>(static_cast<size_t>(R) * K);
            const auto gw = d_w.read<float>(static_cast<size_t>(R) * K);
            for (int i = 0; i < R; ++i) {
                const std::string where = "row " + std::to_string(i);
                compare_rows(m, c, where, gx.data() + i * out_row, gs.data() + static_cast<size_t>(i) * nb,
                             h_x.data() + i * out_row, h_scales.data() + static_cast<size_t>(i) * nb);
                for (int k = 0; k < K; ++k) {
                    m.expect(gi[i * K + k] == h_idx[i * K + k], where + ": topk id k=" + std::to_string(k));
                    m.expect(gw[i * K + k] == h_w[i * K + k], where + ": weight k=" + std::to_string(k));
                }
            }
            m.done();
        };
        check_dispatch(tc.transport + " dispatch", dh);

        // A reused handle: no count exchange, same result.
        d_x.poison(0xCD);
        d_idx.poison(0x33);
        dh = dev.dispatch(dxv, div, dwv, d_out, &dh);
        check_dispatch(tc.transport + " dispatch with a reused handle", dh);

        // --- normal combine: y = recv rows scaled by the sum of their local weights ---
        if (!c.fp8_dispatch) {
            std::vector<uint8_t> y(static_cast<size_t>(std::max(R, 1)) * y_row);
            for (int i = 0; i < R; ++i) {
                float scale = 0.0f;
                for (int k = 0; k < K; ++k) scale += h_w[static_cast<size_t>(i) * K + k];
                for (int j = 0; j < H; ++j)
                    ep::store_from_float(
                        y.data() + i * y_row, j,
                        (1.0f + scale) * ep::load_as_float(h_x.data() + i * out_row, j, c.dtype), c.dtype);
            }
            std::vector<uint8_t> h_comb(static_cast<size_t>(std::max(T, 1)) * y_row);
            host.combine({y.data(), R, H}, hh, {h_comb.data(), T, H});
            Dev d_y(y), d_comb(h_comb.size(), 0xEE);
            dev.combine({d_y.p, R, H}, dh, {d_comb.p, T, H});
            Mismatches m(tc.transport + " combine" + tag);
            compare_floats(m, c, "combine", d_comb.read<uint8_t>(static_cast<size_t>(T) * y_row).data(),
                           h_comb.data(), T);
            m.done();
        }

        // --- low-latency dispatch and combine ---
        std::vector<uint8_t> hl_x(static_cast<size_t>(ll_rows) * out_row);
        std::vector<float> hl_scales(static_cast<size_t>(ll_rows) * nb);
        std::vector<int> hl_count(L);
        ep::LowLatencyHandle hl = host.low_latency_dispatch(
            x_view(c, in), idx_view(c, in),
            {{hl_x.data(), ll_rows, H}, {hl_scales.data(), ll_rows, nb}, hl_count.data()});
        Dev dl_x(hl_x.size(), 0x5A), dl_scales(hl_scales.size() * 4, 0xC3), dl_count(L * 4, 0xFF);
        ep::LowLatencyOutput dl_out{
            {dl_x.p, ll_rows, H}, {dl_scales.as<float>(), ll_rows, nb}, dl_count.as<int>()};
        ep::LowLatencyHandle dl = dev.low_latency_dispatch(dxv, div, dl_out);
        {
            Mismatches m(tc.transport + " low_latency_dispatch" + tag);
            m.expect(dl.num_tokens == hl.num_tokens, "num_tokens");
            m.expect(dl.recv_count == hl.recv_count, "handle recv_count");
            m.expect(dl.recv_range == hl.recv_range, "recv_range");
            m.expect(dl.recv_src_token == hl.recv_src_token, "recv_src_token");
            m.expect(dl.topk_idx == hl.topk_idx, "topk_idx");
            m.expect(dl_count.read<int>(L) == hl_count, "recv_count output");
            const auto gx = dl_x.read<uint8_t>(hl_x.size());
            const auto gs = dl_scales.read<float>(hl_scales.size());
            for (int l = 0; l < L; ++l)
                for (int i = 0; i < hl_count[l]; ++i) {
                    const size_t row = static_cast<size_t>(l) * rows_per_expert + i;
                    compare_rows(m, c, "expert " + std::to_string(l) + " row " + std::to_string(i),
                                 gx.data() + row * out_row, gs.data() + row * nb, hl_x.data() + row * out_row,
                                 hl_scales.data() + row * nb);
                }
            m.done();
        }
        if (!c.fp8_dispatch) {
            std::vector<uint8_t> h_comb(static_cast<size_t>(std::max(T, 1)) * y_row);
            host.low_latency_combine({hl_x.data(), ll_rows, H}, idx_view(c, in), weights_view(c, in), hl,
                                     {h_comb.data(), T, H});
            Dev d_comb(h_comb.size(), 0x11);
            dev.low_latency_combine({dl_x.p, ll_rows, H}, div, dwv, dl, {d_comb.p, T, H});
            Mismatches m(tc.transport + " low_latency_combine" + tag);
            compare_floats(m, c, "low_latency_combine",
                           d_comb.read<uint8_t>(static_cast<size_t>(T) * y_row).data(), h_comb.data(), T);
            m.done();
        }
    }
    CK(cudaDeviceSynchronize());
    dev.destroy();
    host.destroy();
}

class DeviceConformance : public testing::TestWithParam<Case> {};

TEST_P(DeviceConformance, MatchesHostReference) {
    const Case tc = GetParam();
    const int devices = device_count();
    if (devices == 0) GTEST_SKIP() << "no CUDA device";
    if (tc.transport == "nccl" && devices < tc.world)
        GTEST_SKIP() << "nccl needs one GPU per rank: " << tc.world << " ranks, " << devices << " GPUs";
    const uint64_t seed = std::random_device{}();
    const std::string dir = unique_dir("gpu");
    auto results = run_ranks(
        tc.world, [&](int rank) { conformance(tc, rank, seed, dir); }, std::chrono::seconds(240));
    for (int r = 0; r < tc.world; ++r)
        EXPECT_EQ(results[r].exit_code, 0)
            << "rank " << r << " (seed " << seed << "): " << results[r].message;
    std::filesystem::remove_all(dir);
}

std::vector<Case> cases() {
    using ep::DType;
    std::vector<Case> out = {
        {"cuda", 1, DType::kFloat32, 4, 2},
        // One rank: the fused dispatch kernel (one block per tile of tokens).
        {"cuda", 1, DType::kBFloat16, 16, 8},
        {"cuda", 1, DType::kBFloat16, 16, 8, true, 256},               // fp8
        {"cuda", 1, DType::kBFloat16, 8, 2, false, 70},                // rows not 16-byte multiples
        {"cuda", 1, DType::kFloat32, 4, 1, false, 72, 40, 8, 2},       // every other token without experts
        {"cuda", 1, DType::kFloat32, 8, 4, false, 72, 300, 64, 3},     // tiles of a few tokens
        {"cuda", 1, DType::kBFloat16, 16, 8, false, 512, 1500, 2, 3},  // tiles of several 512-token groups
        {"cuda", 2, DType::kFloat32, 8, 4},
        {"cuda", 2, DType::kBFloat16, 8, 4},
        {"cuda", 3, DType::kBFloat16, 10, 3},
        {"cuda", 4, DType::kFloat32, 16, 8},
        {"cuda", 4, DType::kBFloat16, 16, 8},
        {"cuda", 8, DType::kBFloat16, 64, 8},
        {"cuda", 8, DType::kFloat32, 32, 6},
        {"cuda", 3, DType::kBFloat16, 12, 4, true, 256},
        {"cuda", 8, DType::kBFloat16, 64, 8, true, 384},
        {"cuda", 2, DType::kBFloat16, 8, 2, false, 70},              // rows not 16-byte multiples
        {"cuda", 2, DType::kBFloat16, 16, 8, false, 512, 1500, 24},  // several layout chunks
        {"nccl", 2, DType::kBFloat16, 8, 4},
        {"nccl", 2, DType::kFloat32, 8, 4},
        {"nccl", 2, DType::kBFloat16, 16, 4, true, 256},
        // One expert gets every token of every rank, each token naming it top_k times.
        {"cuda", 1, DType::kBFloat16, 16, 8, true, 256, 40, 8, 0, true},
        {"cuda", 2, DType::kBFloat16, 8, 4, false, 72, 40, 8, 0, true},
        {"nccl", 2, DType::kBFloat16, 8, 4, false, 72, 40, 8, 0, true},
        // Packed rows over libfabric, each exchange's writes queued by a kernel on the write proxy
        // (tcp and shm stand in for EFA; where their libfabric cannot register GPU memory, the
        // region is pinned host memory the kernels reach across PCIe).
        {"cuda-fabric/shm", 1, DType::kFloat32, 4, 2},
        {"cuda-fabric/tcp", 2, DType::kBFloat16, 8, 4},
        {"cuda-fabric/shm", 2, DType::kFloat32, 8, 4, false, 72, 40, 8, 2},
        {"cuda-fabric/tcp", 3, DType::kBFloat16, 12, 4, true, 256},
        {"cuda-fabric/shm", 4, DType::kBFloat16, 16, 8},
        {"cuda-fabric/tcp", 2, DType::kBFloat16, 8, 4, false, 72, 40, 8, 0, true},
    };
    return out;
}

INSTANTIATE_TEST_SUITE_P(Engines, DeviceConformance, testing::ValuesIn(cases()), case_name);

// Rank 0's input of exactly num_tokens tokens (num_tokens < 0: as drawn): the draw from `seed`, then
// draws from seed + 100, seed + 200, ... appended until there are enough, cut to num_tokens.
RankInput input_of_size(const ep::Config& c, uint64_t seed, int num_tokens) {
    RankInput in = make_input(c, seed, 0);
    if (num_tokens < 0) return in;
    for (int more = 1; in.num_tokens < num_tokens; ++more) {
        const RankInput next = make_input(c, seed + 100 * more, 0);
        in.x.insert(in.x.end(), next.x.begin(), next.x.end());
        in.topk_idx.insert(in.topk_idx.end(), next.topk_idx.begin(), next.topk_idx.end());
        in.topk_weights.insert(in.topk_weights.end(), next.topk_weights.begin(), next.topk_weights.end());
        in.num_tokens += next.num_tokens;
    }
    in.num_tokens = num_tokens;
    in.x.resize(static_cast<size_t>(num_tokens) * c.hidden * c.element_bytes());
    in.topk_idx.resize(static_cast<size_t>(num_tokens) * c.top_k);
    in.topk_weights.resize(static_cast<size_t>(num_tokens) * c.top_k);
    return in;
}

// One rank with Config.async: dispatch returns once the kernel has published the counts, maybe
// before the rows are copied. Counts, rows, a reused handle and combine match the host reference for
// no tokens, tokens without experts only, tiles of more than one 512-token group, one token, and recv_x
// at an address that is not 16-byte aligned (the general path).
TEST(OneRank, AsyncDispatchMatchesHostReference) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    const Case tc{"cuda", 1, ep::DType::kBFloat16, 32, 4, false, 128, 1400, 2};
    const uint64_t seed = std::random_device{}();
    const std::string dir = unique_dir("gpuasync");
    auto results = run_ranks(1, [&](int) {
        auto store = ep::make_file_store(dir);
        const ep::Config c = make_config(tc, 0, "host");
        ep::Buffer host(c, store.get());
        ep::Buffer dev(make_config(tc, 0, "cuda", true), store.get());
        const int K = c.top_k, H = c.hidden, maxT = c.max_tokens_per_rank;
        const size_t row = H * c.element_bytes();
        for (int round = 0; round < 6; ++round) {
            const std::string tag = " (round " + std::to_string(round) + ")";
            const int sizes[6] = {0, maxT, maxT, 1, -1, maxT};  // -1: as drawn
            RankInput in = input_of_size(c, seed + round, sizes[round]);
            if (round == 1) clear_experts(in, K, 1);  // every token without experts
            if (round == 2) clear_experts(in, K, 2);
            const int T = in.num_tokens;
            std::vector<uint8_t> h_x(static_cast<size_t>(maxT) * row);
            std::vector<int64_t> h_idx(static_cast<size_t>(maxT) * K);
            std::vector<float> h_w(static_cast<size_t>(maxT) * K);
            ep::DispatchOutput h_out{
                {h_x.data(), maxT, H}, {}, {h_idx.data(), maxT, K}, {h_w.data(), maxT, K}};
            const ep::Handle hh = host.dispatch(x_view(c, in), idx_view(c, in), weights_view(c, in), h_out);
            const int R = hh.num_recv_tokens();

            Dev x(in.x), idx(in.topk_idx), w(in.topk_weights);
            const size_t shift = round == 5 ? 2 : 0;  // round 5: recv_x 2-byte aligned only
            Dev d_x(h_x.size() + 16, 0xAB), d_idx(h_idx.size() * 8, 0x5A), d_w(h_w.size() * 4, 0x6B);
            uint8_t* recv_x = d_x.as<uint8_t>() + shift;
            ep::DispatchOutput d_out{
                {recv_x, maxT, H}, {}, {d_idx.as<int64_t>(), maxT, K}, {d_w.as<float>(), maxT, K}};
            ep::View<const void> dxv{x.p, T, H};
            ep::View<const int64_t> div{idx.as<int64_t>(), T, K};
            ep::View<const float> dwv{w.as<float>(), T, K};
            auto check = [&](const std::string& what, const ep::Handle& got) {
                Mismatches m(what + tag);
                expect_same_counts(m, got, hh);
                m.expect(got.send_pos.empty() && got.recv_src_token.empty(),
                         "asynchronous mode: host vectors other than the counts stay empty");
                std::vector<uint8_t> gx(static_cast<size_t>(R) * row);
                CK(cudaDeviceSynchronize());
                if (R > 0) CK(cudaMemcpy(gx.data(), recv_x, gx.size(), cudaMemcpyDeviceToHost));
                const auto gi = d_idx.read<int64_t>(static_cast<size_t>(R) * K);
                const auto gw = d_w.read<float>(static_cast<size_t>(R) * K);
                for (int i = 0; i < R; ++i) {
                    m.expect(std::memcmp(gx.data() + i * row, h_x.data() + i * row, row) == 0,
                             "row " + std::to_string(i) + ": data differs");
                    for (int k = 0; k < K; ++k) {
                        m.expect(gi[i * K + k] == h_idx[i * K + k], "row " + std::to_string(i) + ": topk id");
                        m.expect(gw[i * K + k] == h_w[i * K + k], "row " + std::to_string(i) + ": weight");
                    }
                }
                m.done();
            };
            const ep::Handle dh = dev.dispatch(dxv, div, dwv, d_out);
            check("dispatch", dh);
            d_x.poison(0xCD);
            d_idx.poison(0x33);
            check("dispatch with a reused handle", dev.dispatch(dxv, div, dwv, d_out, &dh));

            // combine with y = the received rows: each token gets its row back, or zeros.
            std::vector<uint8_t> h_comb(static_cast<size_t>(std::max(T, 1)) * row);
            host.combine({h_x.data(), R, H}, hh, {h_comb.data(), T, H});
            Dev d_y(h_x), d_comb(h_comb.size(), 0xEE);
            dev.combine({d_y.p, R, H}, dh, {d_comb.p, T, H});
            Mismatches m("combine" + tag);
            compare_floats(m, c, "combine", d_comb.read<uint8_t>(static_cast<size_t>(T) * row).data(),
                           h_comb.data(), T);
            m.done();
        }
        CK(cudaDeviceSynchronize());
        dev.destroy();
        host.destroy();
    });
    EXPECT_EQ(results[0].exit_code, 0) << "seed " << seed << ": " << results[0].message;
    std::filesystem::remove_all(dir);
}

// One rank, 3000 tokens on as many tiles as the device has SMs (num_sms 1024 is capped there): every
// token routed, one unrouted token first, last or in the middle (every later row moves), and none
// routed. Each pattern in the default and in the asynchronous mode; the handles of all patterns stay
// alive until the end, when each combine must still match (a later dispatch must not take the device
// state of a live handle).
TEST(OneRank, ManyTilesAllOrSomeTokensRouted) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    const Case tc{"cuda", 1, ep::DType::kBFloat16, 16, 4, false, 64, 3000, 1024};
    const uint64_t seed = std::random_device{}();
    for (const bool async : {false, true}) {
        const std::string mode = async ? "async" : "synchronous";
        const std::string dir = unique_dir("gpumany");
        auto results = run_ranks(1, [&](int) {
            auto store = ep::make_file_store(dir);
            const ep::Config c = make_config(tc, 0, "host");
            ep::Buffer host(c, store.get());
            ep::Buffer dev(make_config(tc, 0, "cuda", async), store.get());
            const int K = c.top_k, H = c.hidden, T = c.max_tokens_per_rank;
            const size_t row = H * c.element_bytes();
            const RankInput in = input_of_size(c, seed, T);
            const std::vector<int> unrouted_tokens[5] = {{}, {0}, {T - 1}, {T / 2}, {}};
            struct Done {
                ep::Handle host, dev;
                std::vector<uint8_t> recv;  // the host's received rows
            };
            std::vector<Done> done;
            std::vector<std::unique_ptr<Dev>> inputs;
            for (int p = 0; p < 5; ++p) {
                const std::string tag = " (pattern " + std::to_string(p) + ", " + mode + ")";
                RankInput pin = in;
                for (int t = 0; t < T; ++t) {
                    int64_t* ids = pin.topk_idx.data() + static_cast<size_t>(t) * K;
                    bool routed = false;
                    for (int k = 0; k < K; ++k) routed |= ids[k] >= 0;
                    if (!routed) ids[0] = t % c.num_experts;
                }
                for (int t : unrouted_tokens[p])
                    std::fill_n(pin.topk_idx.data() + static_cast<size_t>(t) * K, K, -1);
                if (p == 4) clear_experts(pin, K, 1);
                std::vector<uint8_t> h_x(static_cast<size_t>(T) * row);
                std::vector<int64_t> h_idx(static_cast<size_t>(T) * K);
                ep::DispatchOutput h_out{{h_x.data(), T, H}, {}, {h_idx.data(), T, K}, {}};
                ep::Handle hh = host.dispatch(x_view(c, pin), idx_view(c, pin), weights_view(c, pin), h_out);
                const int R = hh.num_recv_tokens();
                const int want_rows = p == 0 ? T : p == 4 ? 0 : T - 1;
                MOERL_CHECK(R == want_rows, "pattern ", p, ": the host reference received ", R, " rows");

                inputs.push_back(std::make_unique<Dev>(pin.x));
                const Dev& x = *inputs.back();
                inputs.push_back(std::make_unique<Dev>(pin.topk_idx));
                const Dev& idx = *inputs.back();
                Dev d_x(h_x.size(), 0xAB), d_idx(h_idx.size() * 8, 0x5A);
                ep::DispatchOutput d_out{{d_x.p, T, H}, {}, {d_idx.as<int64_t>(), T, K}, {}};
                ep::Handle dh = dev.dispatch({x.p, T, H}, {idx.as<int64_t>(), T, K}, {}, d_out);
                Mismatches m("dispatch" + tag);
                m.expect(dh.num_recv_tokens() == R, "rows: " + std::to_string(dh.num_recv_tokens()));
                m.expect(dh.num_recv_tokens_per_expert == hh.num_recv_tokens_per_expert,
                         "num_recv_tokens_per_expert");
                if (!async) {
                    m.expect(dh.send_pos == hh.send_pos, "send_pos");
                    m.expect(dh.recv_src_token == hh.recv_src_token, "recv_src_token");
                }
                const auto gx = d_x.read<uint8_t>(static_cast<size_t>(R) * row);
                const auto gi = d_idx.read<int64_t>(static_cast<size_t>(R) * K);
                for (int i = 0; i < R; ++i) {
                    m.expect(std::memcmp(gx.data() + i * row, h_x.data() + i * row, row) == 0,
                             "row " + std::to_string(i) + ": data differs");
                    for (int k = 0; k < K; ++k)
                        m.expect(gi[i * K + k] == h_idx[i * K + k], "row " + std::to_string(i) + ": topk id");
                }
                m.done();
                h_x.resize(static_cast<size_t>(R) * row);
                done.push_back({std::move(hh), std::move(dh), std::move(h_x)});
            }
            // combine with y = the received rows: each token gets its row back, or zeros.
            for (size_t p = 0; p < done.size(); ++p) {
                const int R = done[p].host.num_recv_tokens();
                std::vector<uint8_t> h_comb(static_cast<size_t>(T) * row);
                host.combine({done[p].recv.data(), R, H}, done[p].host, {h_comb.data(), T, H});
                Dev d_y(done[p].recv), d_comb(h_comb.size(), 0xEE);
                dev.combine({d_y.p, R, H}, done[p].dev, {d_comb.p, T, H});
                Mismatches m("combine (pattern " + std::to_string(p) + ", " + mode + ")");
                compare_floats(m, c, "combine", d_comb.read<uint8_t>(h_comb.size()).data(), h_comb.data(), T);
                m.done();
            }
            CK(cudaDeviceSynchronize());
            dev.destroy();
            host.destroy();
        });
        EXPECT_EQ(results[0].exit_code, 0) << mode << ", seed " << seed << ": " << results[0].message;
        std::filesystem::remove_all(dir);
    }
}

// One rank: dispatch with a reused handle + combine captured in a CUDA graph and replayed equal the eager
// calls; a dispatch without a handle refuses to be captured.
TEST(CudaGraph, OneRankReusedHandleReplayMatchesEager) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    const Case tc{"cuda", 1, ep::DType::kBFloat16, 16, 4, false, 256, 200, 16, 3};
    const uint64_t seed = std::random_device{}();
    const std::string dir = unique_dir("graph1");
    auto results = run_ranks(1, [&](int) {
        auto store = ep::make_file_store(dir);
        const ep::Config c = make_config(tc, 0, "cuda");
        ep::Buffer dev(c, store.get());
        const int K = c.top_k, H = c.hidden, maxT = c.max_tokens_per_rank;
        const size_t row = H * c.element_bytes();
        const cudaStream_t stream = new_stream();
        ep::cuda::StreamGuard guard(stream);
        RankInput in = make_input(c, seed, 0);
        clear_experts(in, K, tc.empty_every);
        const int T = in.num_tokens;
        Dev x(in.x), idx(in.topk_idx), w(in.topk_weights);
        Dev recv(static_cast<size_t>(maxT) * row, 0x5A), out_eager(T * row), out_graph(T * row, 0x77);
        ep::View<const void> xv{x.p, T, H};
        ep::View<const int64_t> iv{idx.as<int64_t>(), T, K};
        ep::View<const float> wv{w.as<float>(), T, K};
        ep::DispatchOutput out{{recv.p, maxT, H}};
        const ep::Handle h = dev.dispatch(xv, iv, wv, out);
        const int R = h.num_recv_tokens();
        dev.combine({recv.p, R, H}, h, {out_eager.p, T, H});
        CK(cudaStreamSynchronize(stream));
        const auto eager_recv = recv.read<uint8_t>(static_cast<size_t>(R) * row);
        const auto eager = out_eager.read<uint8_t>(T * row);

        std::string refused;
        Graph graph(stream, [&] {
            try {
                dev.dispatch(xv, iv, wv, out);
            } catch (const Error& e) {
                refused = e.what();
            }
            dev.dispatch(xv, iv, wv, out, &h);
            dev.combine({recv.p, R, H}, h, {out_graph.p, T, H});
        });
        MOERL_CHECK(refused.find("cannot be captured") != std::string::npos,
                    "a dispatch without a handle during capture: expected a refusal, got '", refused, "'");
        for (int replay = 0; replay < 3; ++replay) {
            recv.poison(0x5A);
            out_graph.poison(0x77);
            graph.replay();
            MOERL_CHECK(recv.read<uint8_t>(static_cast<size_t>(R) * row) == eager_recv, "replay ", replay,
                        ": the captured dispatch differs from the eager one");
            MOERL_CHECK(out_graph.read<uint8_t>(T * row) == eager, "replay ", replay,
                        ": the captured combine differs from the eager one");
        }
        // Eager dispatches still work after the replays.
        MOERL_CHECK(dev.dispatch(xv, iv, wv, out).num_recv_tokens() == R, "eager dispatch after the replays");
        graph.destroy();
        dev.destroy();
    });
    EXPECT_EQ(results[0].exit_code, 0) << "seed " << seed << ": " << results[0].message;
    std::filesystem::remove_all(dir);
}

// A low-latency dispatch + combine captured in a CUDA graph and replayed equals the eager calls.
TEST(CudaGraph, LowLatencyReplayMatchesEager) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    const Case tc{"cuda", 2, ep::DType::kBFloat16, 8, 4, false, 128, 64};
    const uint64_t seed = std::random_device{}();
    const std::string dir = unique_dir("graph");
    auto results = run_ranks(2, [&](int rank) {
        auto store = ep::make_file_store(dir);
        const ep::Config c = make_config(tc, rank, "cuda");
        ep::Buffer dev(c, store.get());
        const int K = c.top_k, H = c.hidden, L = c.num_local_experts();
        const int ll_rows = L * c.low_latency_rows_per_expert();
        const size_t row = H * c.element_bytes();
        const cudaStream_t stream = new_stream();
        ep::cuda::StreamGuard guard(stream);
        const RankInput in = make_input(c, seed, rank);
        const int T = in.num_tokens;
        Dev x(in.x), idx(in.topk_idx), w(in.topk_weights);
        Dev recv(static_cast<size_t>(ll_rows) * row, 0x5A), count(L * 4), out_eager(T * row),
            out_graph(T * row, 0x77);
        ep::View<const void> xv{x.p, T, H};
        ep::View<const int64_t> iv{idx.as<int64_t>(), T, K};
        ep::View<const float> wv{w.as<float>(), T, K};
        ep::LowLatencyOutput lo{{recv.p, ll_rows, H}, {}, count.as<int>()};
        // The expert output is the received rows themselves (y = recv_x).
        ep::LowLatencyHandle h = dev.low_latency_dispatch(xv, iv, lo);
        dev.low_latency_combine({recv.p, ll_rows, H}, iv, wv, h, {out_eager.p, T, H});
        CK(cudaStreamSynchronize(stream));
        const auto eager = out_eager.read<uint8_t>(T * row);
        const auto eager_recv = recv.read<uint8_t>(static_cast<size_t>(ll_rows) * row);

        Graph graph(stream, [&] {
            ep::LowLatencyHandle gh = dev.low_latency_dispatch(xv, iv, lo);
            dev.low_latency_combine({recv.p, ll_rows, H}, iv, wv, gh, {out_graph.p, T, H});
        });
        for (int replay = 0; replay < 3; ++replay) {
            recv.poison(0x5A);
            out_graph.poison(0x77);
            graph.replay();
            MOERL_CHECK(out_graph.read<uint8_t>(T * row) == eager, "replay ", replay,
                        ": the captured combine differs from the eager one");
            const auto got_recv = recv.read<uint8_t>(static_cast<size_t>(ll_rows) * row);
            for (int l = 0; l < L; ++l) {
                const size_t n = static_cast<size_t>(h.recv_count[l]) * row;
                const size_t off = static_cast<size_t>(l) * c.low_latency_rows_per_expert() * row;
                MOERL_CHECK(std::memcmp(got_recv.data() + off, eager_recv.data() + off, n) == 0, "replay ",
                            replay, ": the captured dispatch differs for expert ", l);
            }
        }
        // Eager calls still work after the replays (epochs stayed in step).
        dev.low_latency_dispatch(xv, iv, lo);
        graph.destroy();
        dev.destroy();
    });
    for (int r = 0; r < 2; ++r)
        EXPECT_EQ(results[r].exit_code, 0)
            << "rank " << r << " (seed " << seed << "): " << results[r].message;
    std::filesystem::remove_all(dir);
}

// An expert id out of range on one rank: that rank gets an error naming the entry; the peer completes;
// both keep working afterwards.
void expect_expert_id_out_of_range_reported(const std::string& transport) {
    const Case tc{transport, 2, ep::DType::kFloat32, 8, 2, false, 16, 8};
    const std::string dir = unique_dir("gpubad");
    auto results = run_ranks(2, [&](int rank) {
        auto store = ep::make_file_store(dir);
        const ep::Config c = make_config(tc, rank, transport);
        ep::Buffer dev(c, store.get());
        std::vector<float> xs(8 * 16, 1.0f);
        std::vector<int64_t> ids(8 * 2, 1);
        if (rank == 0) ids[3 * 2 + 1] = 300;  // topk_idx[3,1]
        Dev x(xs), idx(ids), recv(2 * 8 * 16 * 4), ll(4 * 2 * 8 * 16 * 4);
        ep::DispatchOutput out{{recv.p, 16, 16}};
        std::string msg;
        try {
            dev.dispatch({x.p, 8, 16}, {idx.as<int64_t>(), 8, 2}, {}, out);
        } catch (const Error& e) {
            msg = e.what();
        }
        if (rank == 0)
            MOERL_CHECK(msg.find("topk_idx[3,1] = 300") != std::string::npos,
                        "dispatch: expected an error naming "
                        "topk_idx[3,1] = 300, got '",
                        msg, "'");
        else
            MOERL_CHECK(msg.empty(), "rank 1 had valid input but got: ", msg);
        msg.clear();
        try {
            dev.low_latency_dispatch({x.p, 8, 16}, {idx.as<int64_t>(), 8, 2}, {{ll.p, 4 * 16, 16}});
        } catch (const Error& e) {
            msg = e.what();
        }
        if (rank == 0)
            MOERL_CHECK(msg.find("topk_idx[3,1] = 300") != std::string::npos,
                        "low_latency_dispatch: expected an error naming topk_idx[3,1] = 300, got '", msg,
                        "'");
        // Valid input afterwards: counts as expected (expert 1 lives on rank 0: 8 tokens from each rank).
        std::vector<int64_t> good(8 * 2, 1);
        Dev gidx(good);
        ep::Handle h = dev.dispatch({x.p, 8, 16}, {gidx.as<int64_t>(), 8, 2}, {}, out);
        MOERL_CHECK(h.num_recv_tokens() == (rank == 0 ? 16 : 0), "after bad input: rank ", rank, " received ",
                    h.num_recv_tokens(), " rows");
        dev.destroy();
    });
    for (int r = 0; r < 2; ++r)
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].message;
    std::filesystem::remove_all(dir);
}

TEST(BadInput, ExpertIdOutOfRangeIsReported) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    expect_expert_id_out_of_range_reported("cuda");
}

TEST(BadInput, ExpertIdOutOfRangeIsReportedOverFabric) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    expect_expert_id_out_of_range_reported("cuda-fabric/tcp");
}

// cuda-fabric: a peer that dies after joining makes the next call fail at the deadline with an
// error naming the call and the peer, instead of hanging.
TEST(CudaFabric, DeadPeerIsAnErrorNamingIt) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    Case tc{"cuda-fabric/tcp", 2, ep::DType::kFloat32, 8, 2, false, 16, 8};
    const std::string dir = unique_dir("gpudead");
    auto results = run_ranks(2, [&](int rank) {
        auto store = ep::make_file_store(dir);
        ep::Config c = make_config(tc, rank, tc.transport);
        c.timeout_s = 3;
        ep::Buffer dev(c, store.get());
        if (rank == 1) std::_Exit(0);  // gone without a word, its endpoint closed by the kernel
        std::vector<float> xs(8 * 16, 1.0f);
        std::vector<int64_t> ids(8 * 2, 5);  // expert 5 lives on rank 1
        Dev x(xs), idx(ids), recv(2 * 8 * 16 * 4);
        ep::DispatchOutput out{{recv.p, 16, 16}};
        std::string msg;
        const auto start = std::chrono::steady_clock::now();
        try {
            dev.dispatch({x.p, 8, 16}, {idx.as<int64_t>(), 8, 2}, {}, out);
        } catch (const Error& e) {
            msg = e.what();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        MOERL_CHECK(msg.find("dispatch") != std::string::npos && msg.find("rank 1") != std::string::npos,
                    "expected an error naming dispatch and rank 1, got '", msg, "'");
        MOERL_CHECK(s < 20, "the error took ", s, " s with a 3 s timeout");
    });
    for (int r = 0; r < 2; ++r)
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].message;
    std::filesystem::remove_all(dir);
}

// One rank: an expert id out of range is reported by the one-kernel dispatch, which drops the entry;
// later dispatches work and count from zero again.
TEST(BadInput, OneRankExpertIdOutOfRangeIsReported) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    const Case tc{"cuda", 1, ep::DType::kFloat32, 8, 2, false, 16, 8};
    const std::string dir = unique_dir("gpubad1");
    auto results = run_ranks(1, [&](int) {
        auto store = ep::make_file_store(dir);
        const ep::Config c = make_config(tc, 0, "cuda");
        ep::Buffer dev(c, store.get());
        std::vector<float> xs(8 * 16, 1.0f);
        std::vector<int64_t> ids(8 * 2, 1);
        ids[3 * 2 + 1] = 300;  // topk_idx[3,1]
        Dev x(xs), idx(ids), recv(8 * 16 * 4);
        ep::DispatchOutput out{{recv.p, 8, 16}};
        std::string msg;
        try {
            dev.dispatch({x.p, 8, 16}, {idx.as<int64_t>(), 8, 2}, {}, out);
        } catch (const Error& e) {
            msg = e.what();
        }
        MOERL_CHECK(msg.find("topk_idx[3,1] = 300") != std::string::npos,
                    "dispatch: expected an error naming topk_idx[3,1] = 300, got '", msg, "'");
        // Valid input afterwards, twice: 8 rows, 16 entries for expert 1.
        std::vector<int64_t> good(8 * 2, 1);
        good[5 * 2] = -1;
        good[5 * 2 + 1] = -1;  // token 5 names no expert
        Dev gidx(good);
        for (int call = 0; call < 2; ++call) {
            ep::Handle h = dev.dispatch({x.p, 8, 16}, {gidx.as<int64_t>(), 8, 2}, {}, out);
            MOERL_CHECK(h.num_recv_tokens() == 7 && h.num_recv_tokens_per_expert[1] == 14,
                        "after bad input, call ", call, ": ", h.num_recv_tokens(), " rows, ",
                        h.num_recv_tokens_per_expert[1], " entries for expert 1");
            const std::vector<int> pos = {0, 1, 2, 3, 4, -1, 5, 6};
            MOERL_CHECK(h.send_pos == pos, "after bad input, call ", call, ": send_pos differs");
        }
        dev.destroy();
    });
    EXPECT_EQ(results[0].exit_code, 0) << results[0].message;
    std::filesystem::remove_all(dir);
}

// The nccl engine refuses two ranks on one GPU with a clear error.
TEST(Nccl, RefusesTwoRanksOnOneGpu) {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    const std::string dir = unique_dir("ncclone");
    auto results = run_ranks(2, [&](int rank) {
        auto store = ep::make_file_store(dir);
        ep::Config c = make_config({"nccl", 2, ep::DType::kFloat32, 8, 2}, rank, "nccl");
        c.device = 0;  // both ranks on GPU 0, however many there are
        try {
            ep::Buffer dev(c, store.get());
        } catch (const Error& e) {
            MOERL_CHECK(std::string(e.what()).find("one GPU per rank") != std::string::npos,
                        "unexpected error: ", e.what());
            return;
        }
        MOERL_FAIL("the nccl engine accepted two ranks on one GPU");
    });
    for (int r = 0; r < 2; ++r)
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].message;
    std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moerl::test
