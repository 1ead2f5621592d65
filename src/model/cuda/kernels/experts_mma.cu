// Expert GEMMs on the tensor cores for decode batches of a few tokens per expert (bf16): a warp
// multiplies 16 rows of an expert's weights with up to 8 * kNTiles of its tokens per pass through
// mma.sync m16n8k16 (fp32 accumulation), streaming the weights from memory once per pass; the
// tokens sit in shared memory. Every pass is a block of its own (find_pass): a popular expert's
// passes run side by side (they read its weights at the same time, mostly through L2), not one
// after another behind the rest of the kernel. At batch 128 on an H100 this took gate/up from 409
// to 361 us and down from 201 to 152 with random routing, and from 439 to 180 and 172 to 95 with
// the skewed routing of a trained policy (decode_kernels_bench --skew 1.5: 40 experts active, the
// busiest with 128 rows).
//
// The k order inside a dot product is free, so each lane loads 16 contiguous bytes of a weight row
// (columns base + 8t .. base + 8t + 7 for lane group position t) and of a token, and the two 16-wide
// mma steps of a 32-column block take columns 8t + {0..3} and 8t + {4..7}: logical k = 2t + u maps to
// column 8t + 4j + u and k = 2t + 8 + u to 8t + 4j + 2 + u in both operands (j: the step, u: 0 or 1),
// so no shuffles are needed to build the fragments.
#include "routing.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kMmaWarps = 4;
constexpr int kMmaRowsPerBlock = 16 * kMmaWarps;

// Elements of padding after each token row in shared memory, so that the 8 rows one quarter warp
// reads start 64 bytes apart modulo 128 (no bank conflicts).
int token_pad(int cols) { return (cols / 32) % 2 == 0 ? 32 : 0; }

// kGated: act[s] = silu(in[s / row_div] gate^T) * (in[s / row_div] up^T) (w0 = gate, w1 = up);
// else y[s] = in[s] w0^T (fp32 out). Weights [E, out_rows, cols]; cols a multiple of 32. Rounding as
// in expert_rows_kernel (each product rounded to bf16 before the activation).
template <bool kGated, int kNTiles>
__global__ void __launch_bounds__(kMmaWarps * 32)
    expert_mma_kernel(const __nv_bfloat16* in, const __nv_bfloat16* w0, const __nv_bfloat16* w1, MoeRouting r,
                      int row_div, int cols, int out_rows, int pad, __nv_bfloat16* act, float* y) {
    griddep_wait();
    griddep_launch_dependents();
    extern __shared__ __align__(16) unsigned char mma_smem[];
    auto* tile = reinterpret_cast<__nv_bfloat16*>(mma_smem);  // [8 * kNTiles, cols + pad]
    const int stride = cols + pad;
    constexpr int kTokens = 8 * kNTiles;
    const ExpertPass pass = find_pass(r, kTokens);
    if (pass.expert < 0) return;
    const int e = pass.expert, first = pass.first, nt = pass.count;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = (blockIdx.x * kMmaWarps + warp) * 16;
    constexpr int kMats = kGated ? 2 : 1;
    const __nv_bfloat16* wr[kMats][2];  // rows row0 + g and row0 + g + 8 (the last row past the end)
#pragma unroll
    for (int m = 0; m < kMats; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = min(row0 + g + 8 * h, out_rows - 1);
            wr[m][h] = (m == 0 ? w0 : w1) + (static_cast<size_t>(e) * out_rows + row) * cols + 8 * t;
        }
    for (int i = threadIdx.x * 8; i < kTokens * cols; i += blockDim.x * 8) {
        const int j = i / cols, c = i % cols;
        uint4 v = make_uint4(0, 0, 0, 0);  // rows past the pass's tokens multiply as zeros
        if (j < nt) {
            const int src = r.expert_slots[first + j] / row_div;
            v = *reinterpret_cast<const uint4*>(in + static_cast<size_t>(src) * cols + c);
        }
        *reinterpret_cast<uint4*>(tile + j * stride + c) = v;
    }
    __syncthreads();
    if (row0 >= out_rows) return;
    float acc[kMats][kNTiles][4] = {};
    constexpr int kUnroll = 4;  // 32-column blocks whose weight loads are in flight together
    for (int base = 0; base < cols; base += 32 * kUnroll) {
        uint4 wa[kUnroll][kMats][2];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (base + 32 * u < cols)
#pragma unroll
                for (int m = 0; m < kMats; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        wa[u][m][h] = *reinterpret_cast<const uint4*>(wr[m][h] + base + 32 * u);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (base + 32 * u >= cols) break;
#pragma unroll
            for (int q = 0; q < kNTiles; ++q) {
                const uint4 b =
                    *reinterpret_cast<const uint4*>(tile + (q * 8 + g) * stride + base + 32 * u + 8 * t);
#pragma unroll
                for (int m = 0; m < kMats; ++m) {
                    const uint4& p = wa[u][m][0];  // row g
                    const uint4& s = wa[u][m][1];  // row g + 8
                    mma_bf16(acc[m][q], p.x, s.x, p.y, s.y, b.x, b.y);
                    mma_bf16(acc[m][q], p.z, s.z, p.w, s.w, b.z, b.w);
                }
            }
        }
    }
    for_each_mma_output<kNTiles>(row0, nt, out_rows, [&](int q, int i, int token, int row) {
        const size_t at = static_cast<size_t>(r.expert_slots[first + token]) * out_rows + row;
        const float v0 = round_to<__nv_bfloat16>(acc[0][q][i]);
        if constexpr (kGated) {
            const float v1 = round_to<__nv_bfloat16>(acc[kMats - 1][q][i]);
            act[at] = from_float<__nv_bfloat16>(round_to<__nv_bfloat16>(silu(v0)) * v1);
        } else {
            y[at] = v0;
        }
    });
}

template <bool kGated, int kNTiles>
void launch_mma(const void* in, const void* w0, const void* w1, const MoeRouting& r, int row_div, int cols,
                int out_rows, int slots, int max_active, void* act, float* y, const Launch& launch) {
    const int pad = token_pad(cols);
    const size_t smem = sizeof(__nv_bfloat16) * 8 * kNTiles * (cols + pad);
    auto kernel = expert_mma_kernel<kGated, kNTiles>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    launch_kernel(kernel,
                  dim3((out_rows + kMmaRowsPerBlock - 1) / kMmaRowsPerBlock,
                       pass_blocks(slots, max_active, 8 * kNTiles)),
                  kMmaWarps * 32, smem, launch, static_cast<const __nv_bfloat16*>(in),
                  static_cast<const __nv_bfloat16*>(w0), static_cast<const __nv_bfloat16*>(w1), r, row_div,
                  cols, out_rows, pad, static_cast<__nv_bfloat16*>(act), y);
}

// Two token tiles a pass (16 tokens) once a batch gives experts that many on average.
template <bool kGated>
void launch_mma_tiles(const void* in, const void* w0, const void* w1, const MoeRouting& r, int B, int K,
                      int E, int row_div, int cols, int out_rows, int max_active, void* act, float* y,
                      const Launch& launch) {
    if (max_active == 0 || B == 0) return;
    if (static_cast<int64_t>(B) * K >= 12LL * E)
        launch_mma<kGated, 2>(in, w0, w1, r, row_div, cols, out_rows, B * K, max_active, act, y, launch);
    else
        launch_mma<kGated, 1>(in, w0, w1, r, row_div, cols, out_rows, B * K, max_active, act, y, launch);
}

}  // namespace

bool moe_tensor_cores_supported(int dtype, int H, int I) { return dtype == 1 && H % 32 == 0 && I % 32 == 0; }

void launch_moe_gate_up_mma(const void* h, const void* gate, const void* up, const MoeRouting& r, int B,
                            int K, int E, int H, int I, int max_active, void* act, const Launch& launch) {
    launch_mma_tiles<true>(h, gate, up, r, B, K, E, K, H, I, max_active, act, nullptr, launch);
}

void launch_moe_down_mma(const void* act, const void* down, const MoeRouting& r, int B, int K, int E, int H,
                         int I, int max_active, float* y, const Launch& launch) {
    launch_mma_tiles<false>(act, down, nullptr, r, B, K, E, 1, I, H, max_active, nullptr, y, launch);
}

}  // namespace moerl::model::cuda
