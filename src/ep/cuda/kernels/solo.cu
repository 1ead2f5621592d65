// Normal mode with one rank, one kernel each way. Dispatch is a permute of x: block b counts the tokens
// of tile b that name a valid expert, publishes that count and adds the counts of the earlier tiles; a
// count that is not published in time (its block may not have started: blocks need not be resident at
// once) it counts itself from topk_idx, so no block waits on another for long and no ticket is taken.
// Then the block copies its rows, while its first warp adds the block to the call's arrivals; the last
// block to arrive writes the summaries, which the host reads from mapped memory: no layout kernel, no
// copy on the stream, no gap between two kernels. While a block counts and sums, the first rows of its
// tile are already on their way into L2. The constants below are the winners of the sweeps in
// bench/RESULTS.md ("EP on one H200"). Combine is the inverse gather: each block loads the send_pos of
// its tokens at once, so that no warp waits on it before its row loads.
#include <cstdio>

#include "common.cuh"

namespace moerl::ep::cuda {

namespace {

constexpr int kSoloWarps = kDataThreads / 32;
constexpr int kLookBackWords = 4;  // tile_state words per lane in flight
constexpr int kSoloUnroll = 16;    // 16-byte loads in flight per lane in the row copy
constexpr int kPrefetchRows = 16;  // rows at the start of each tile asked into L2 while the block counts
// How long a block waits for an earlier tile's count before it counts that tile itself.
constexpr unsigned long long kLookBackPatienceNs = 20000;

// A tile_state word: the call's seq in the high half (stale words never match), the tile's count below.
__device__ __forceinline__ unsigned long long tile_word(unsigned seq, int count) {
    return (static_cast<unsigned long long>(seq) << 32) | static_cast<unsigned>(count);
}

__device__ __forceinline__ unsigned long long load_volatile(const unsigned long long* p) {
    return *reinterpret_cast<const volatile unsigned long long*>(p);
}

// First token of tile j of `tiles` over T tokens (tile sizes differ by at most one).
__device__ __forceinline__ int tile_begin(int j, int T, int tiles) {
    return static_cast<int>(static_cast<long long>(j) * T / tiles);
}

// Whether token t names an expert in [0, E); other ids name none.
__device__ __forceinline__ bool names_expert(const int64_t* topk_idx, int t, int K, int E) {
    bool any = false;
    for (int k = 0; k < K; ++k) {
        const long long e = topk_idx[static_cast<size_t>(t) * K + k];
        any |= e >= 0 && e < E;
    }
    return any;
}

// Tokens of tile `tile` that name a valid expert, counted by one warp from topk_idx (all lanes get it).
__device__ __forceinline__ int warp_count_tile(const SoloDispatchArgs& a, int tile, int lane) {
    const int t0 = tile_begin(tile, a.num_tokens, a.tiles), t1 = tile_begin(tile + 1, a.num_tokens, a.tiles);
    int count = 0;
    for (int t = t0 + lane; t < t1; t += 32)
        count += names_expert(a.topk_idx, t, a.rt.top_k, a.rt.num_experts) ? 1 : 0;
    return __reduce_add_sync(kFullMask, count);
}

// Tokens with a valid expert in the tiles before `tile`, by one warp (all lanes get the sum). A count
// still unpublished kLookBackPatienceNs after the first look is counted by the warp itself.
__device__ __forceinline__ int warp_rows_before(const SoloDispatchArgs& a, int tile, int lane) {
    const unsigned long long* tile_state = a.scratch.tile_state;
    const unsigned seq = a.seq;
    const unsigned long long start = global_timer_ns();
    int sum = 0;
    for (int base = 0; base < tile; base += 32 * kLookBackWords) {
        unsigned long long v[kLookBackWords];
#pragma unroll
        for (int u = 0; u < kLookBackWords; ++u) {
            const int i = base + u * 32 + lane;
            v[u] = i < tile ? load_volatile(tile_state + i) : tile_word(seq, 0);
        }
#pragma unroll
        for (int u = 0; u < kLookBackWords; ++u) {
            const unsigned long long* word = tile_state + base + u * 32 + lane;
            while ((v[u] >> 32) != seq && global_timer_ns() - start < kLookBackPatienceNs)
                v[u] = load_volatile(word);
            for (unsigned late = __ballot_sync(kFullMask, (v[u] >> 32) != seq); late != 0; late &= late - 1) {
                const int src = __ffs(late) - 1;
                const int count = warp_count_tile(a, base + u * 32 + src, lane);
                if (lane == src) v[u] = tile_word(seq, count);
            }
            sum += static_cast<int>(v[u] & 0xffffffffu);
        }
    }
    return __reduce_add_sync(kFullMask, sum);
}

// Asks L2 for `bytes` from p, spread over the block (a hint; no data is consumed).
__device__ __forceinline__ void block_prefetch_l2(const uint8_t* p, size_t bytes) {
    for (size_t off = threadIdx.x * size_t{128}; off < bytes; off += kDataThreads * size_t{128})
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

// Part `part` of `parts` of a row copy: a contiguous range of 16-byte units (bounds on 128-byte steps),
// kSoloUnroll loads in flight per lane. The source is the caller's x, which nothing writes during the
// kernel. Rows that are not 16-byte multiples take 4- or 1-byte accesses, split the same way.
__device__ __forceinline__ void warp_copy_part(uint8_t* dst, const uint8_t* src, int bytes, int part,
                                               int parts, int lane) {
    const uintptr_t align =
        reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
    if ((align & 15) != 0) {
        const int unit = (align & 3) == 0 ? 4 : 1;
        const int n = bytes / unit;
        const int lo = static_cast<int>(static_cast<long long>(n) * part / parts);
        const int hi = static_cast<int>(static_cast<long long>(n) * (part + 1) / parts);
        if (unit == 4) {
            for (int i = lo + lane; i < hi; i += 32)
                reinterpret_cast<int*>(dst)[i] = reinterpret_cast<const int*>(src)[i];
        } else {
            for (int i = lo + lane; i < hi; i += 32) dst[i] = src[i];
        }
        return;
    }
    const int n = bytes / 16;
    const int lo = part == 0 ? 0 : static_cast<int>(static_cast<long long>(n) * part / parts) & ~7;
    const int hi =
        part == parts - 1 ? n : static_cast<int>(static_cast<long long>(n) * (part + 1) / parts) & ~7;
    auto* d = reinterpret_cast<int4*>(dst);
    const auto* s = reinterpret_cast<const int4*>(src);
    for (int i0 = lo; i0 < hi; i0 += 32 * kSoloUnroll) {
        int4 v[kSoloUnroll];
        load_units(v, s, i0, hi, lane);
        store_units(d, v, i0, hi, lane);
    }
}

// Part `part` of `parts` of token t into output row i: data (or e4m3 + scales), and with part 0 the
// token's ids and weights (one rank owns every expert, so local ids are the global ones). Ids and
// weights are loaded first, so that they travel with the row's first loads.
__device__ __forceinline__ void warp_write_row(const SoloDispatchArgs& a, int t, int i, int part, int parts,
                                               int lane) {
    const Routing& rt = a.rt;
    const int K = rt.top_k;
    const bool meta = part == 0 && lane < K;
    const size_t entry = static_cast<size_t>(t) * K + lane;
    const long long e = meta ? a.topk_idx[entry] : -1;
    const float w = meta && a.topk_weights != nullptr ? a.topk_weights[entry] : 0.0f;
    const size_t x_row_bytes = row_bytes_of(rt);
    const auto* src = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(t) * x_row_bytes;
    auto* dst = static_cast<uint8_t*>(a.recv_x) + static_cast<size_t>(i) * a.row.data_bytes;
    if (rt.fp8) {
        const int num_scales = rt.hidden / kFp8Cols;
        warp_quantize_row(
            dst, a.recv_x_scales != nullptr ? a.recv_x_scales + static_cast<size_t>(i) * num_scales : nullptr,
            reinterpret_cast<const __nv_bfloat16*>(src), rt.hidden, lane, part, parts);
    } else {
        warp_copy_part(dst, src, static_cast<int>(x_row_bytes), part, parts, lane);
    }
    if (meta) {
        const bool valid = e >= 0 && e < rt.num_experts;
        if (a.recv_topk_idx != nullptr) a.recv_topk_idx[static_cast<size_t>(i) * K + lane] = valid ? e : -1;
        if (a.recv_topk_weights != nullptr)
            a.recv_topk_weights[static_cast<size_t>(i) * K + lane] = valid ? w : 0.0f;
    }
}

// One warp of every block, once the block's counts are in the totals: adds the block to the call's
// arrivals; in the last block to arrive it writes the summaries, resets the scratch for the next call
// and then publishes counts_ready. The other warps of the block copy rows meanwhile.
__device__ __forceinline__ void warp_arrive(const SoloDispatchArgs& a, int lane) {
    const LayoutScratch& g = a.scratch;
    const int L = a.rt.num_local_experts;
    unsigned last = 0;
    if (lane == 0) {
        __threadfence();  // the block's totals and error reports (before the block's barrier) first
        last = atomicAdd(&g.counters[1], 1u) == gridDim.x - 1 ? 1u : 0u;
    }
    if (__shfl_sync(kFullMask, last, 0) == 0) return;
    __threadfence();
    const int total_rows = __shfl_sync(kFullMask, lane == 0 ? atomicExch(&g.rank_total[0], 0) : 0, 0);
    // summary [2, 1+L]: what this rank sends, then what it receives (the same with one rank)
    constexpr int kBatch = 8;  // exchanges in flight per lane
    for (int i0 = 0; i0 < L; i0 += 32 * kBatch) {
        int v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = i0 + u * 32 + lane;
            v[u] = i < L ? atomicExch(&g.expert_total[i], 0) : 0;
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = i0 + u * 32 + lane;
            if (i >= L) continue;
            a.summary[1 + i] = v[u];
            a.summary[1 + L + 1 + i] = v[u];
        }
    }
    if (lane == 0) {
        a.summary[0] = total_rows;
        a.summary[1 + L] = total_rows;
        a.recv_src_offset[0] = 0;
        a.recv_src_offset[1] = total_rows;
        g.counters[1] = 0;
    }
    __threadfence_system();
    __syncwarp();
    if (lane == 0) *reinterpret_cast<volatile unsigned*>(a.counts_ready) = a.seq;
}

__global__ void __launch_bounds__(kDataThreads) solo_dispatch_kernel(SoloDispatchArgs a) {
    const Routing rt = a.rt;
    const int K = rt.top_k, E = rt.num_experts;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const LayoutScratch& g = a.scratch;
    const size_t x_row_bytes = row_bytes_of(rt);
    __shared__ int expert_count[kMaxExperts];
    __shared__ int rows[kDataThreads];  // output row of each token of the current group, or -1
    __shared__ int warp_count[kSoloWarps];
    __shared__ int tile_count, tile_base;
    const int tile = static_cast<int>(blockIdx.x);
    const int t0 = tile_begin(tile, a.num_tokens, a.tiles), t1 = tile_begin(tile + 1, a.num_tokens, a.tiles);
    // The first ids of the thread's first token are on their way before anything else.
    long long first_ids[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
    if (t0 + tid < t1) load_ids(first_ids, a.topk_idx, t0 + tid, 0, K);
    // x [T, H]: the tile's first rows are contiguous. Asked for now, not after the count is published
    // (that delays the look-back: bench/RESULTS.md).
    block_prefetch_l2(static_cast<const uint8_t*>(a.x) + static_cast<size_t>(t0) * x_row_bytes,
                      static_cast<size_t>(min(t1 - t0, kPrefetchRows)) * x_row_bytes);
    if (tid == 0) tile_count = 0;
    for (int i = tid; i < E; i += kDataThreads) expert_count[i] = 0;
    __syncthreads();

    // Count the tile: tokens with a valid expert, entries per expert; ids out of range are reported
    // and dropped.
    int count = 0;
    bool first_valid = false;  // token t0 + tid, the thread's token in the first group below
    for (int t = t0 + tid; t < t1; t += kDataThreads) {
        bool any = false;
        for_each_routed_expert(
            a.topk_idx, t, K, E, a.error, a.error_mirror,
            [&](int e) {
                atomicAdd(&expert_count[e], 1);
                any = true;
            },
            first_ids, t == t0 + tid);
        count += any ? 1 : 0;
        if (t == t0 + tid) first_valid = any;
    }
    count = __reduce_add_sync(kFullMask, count);
    if (lane == 0 && count != 0) atomicAdd(&tile_count, count);
    __syncthreads();

    // Publish the tile's count, add it to the totals, and sum the counts of the tiles before it.
    // tile_state [tiles]: seq << 32 | count
    if (tid == 0) {
        *reinterpret_cast<volatile unsigned long long*>(g.tile_state + tile) = tile_word(a.seq, tile_count);
        if (tile_count != 0) atomicAdd(&g.rank_total[0], tile_count);
    }
    for (int i = tid; i < E; i += kDataThreads)
        if (expert_count[i] != 0) atomicAdd(&g.expert_total[i], expert_count[i]);
    if (warp == 0) {
        const int before = warp_rows_before(a, tile, lane);
        if (lane == 0) tile_base = before;
    }
    __syncthreads();

    // Rows, in groups of one token per thread: the block's offset plus the valid tokens before it in the
    // tile; then the warps copy the group's rows, `parts` warps per row (parts of one row on neighbouring
    // warps). Warp 0 first adds the block to the arrivals (warp_arrive), after the first group's rows.
    int base = tile_base;
    for (int g0 = t0; g0 < t1; g0 += kDataThreads) {
        const int t = g0 + tid;
        const bool valid = t < t1 && (g0 == t0 ? first_valid : names_expert(a.topk_idx, t, K, E));
        const unsigned ballot = __ballot_sync(kFullMask, valid);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        int row = base + __popc(ballot & lanemask_lt()), group_rows = 0;
        for (int w = 0; w < kSoloWarps; ++w) {
            if (w < warp) row += warp_count[w];
            group_rows += warp_count[w];
        }
        if (!valid) row = -1;
        // Rows index host-mapped vectors of max_tokens_per_rank entries: a row past the tokens is a bug.
        if (valid && row >= a.num_tokens) {
            printf("moerl: one-rank dispatch: token %d got row %d, but there are only %d tokens\n", t, row,
                   a.num_tokens);
            __trap();
        }
        if (t < t1) {
            a.send_pos[t] = row;
            if (a.host_send_pos != nullptr) a.host_send_pos[t] = row;
        }
        if (valid) {
            a.recv_src_token[row] = t;
            if (a.host_recv_src_token != nullptr) a.host_recv_src_token[row] = t;
        }
        rows[tid] = row;
        __syncthreads();
        if (g0 == t0 && warp == 0) warp_arrive(a, lane);
        const int n = min(kDataThreads, t1 - g0);
        const int parts = max(1, kSoloWarps / n);  // more warps a row while a group has fewer rows than warps
        for (int item = warp; item < n * parts; item += kSoloWarps) {
            const int j = item / parts, part = item - j * parts;
            const int i = rows[j];
            if (i < 0 || i >= a.max_rows) continue;  // the host reports the short output
            warp_write_row(a, g0 + j, i, part, parts, lane);
        }
        base += group_rows;
        __syncthreads();  // rows and warp_count are rewritten by the next group
    }
    if (t0 == t1 && warp == 0) warp_arrive(a, lane);  // an empty tile (no tokens at all)
}

// out[t] = y[send_pos[t]] through the same fp32 sum as combine_recv_kernel (zeros for a token that was
// not dispatched); block b takes tile b (tile_begin). kVec: 16-byte accesses.
template <int kDType, bool kVec>
__global__ void __launch_bounds__(kDataThreads) solo_combine_kernel(SoloCombineArgs a) {
    constexpr int kUnroll = 8;  // 16-byte loads in flight per lane
    const int H = a.rt.hidden, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t row_bytes = static_cast<size_t>(H) * (kDType == 0 ? 4 : 2);
    const int n = kVec ? H / Vec16<kDType>::kElems : H;
    const int num_groups = kVec ? (n + 32 * kUnroll - 1) / (32 * kUnroll) : (n + 31) / 32;  // per warp pass
    __shared__ int pos[kDataThreads];  // send_pos of the tokens of the current group
    const int b = static_cast<int>(blockIdx.x);
    const int t0 = tile_begin(b, a.num_tokens, a.tiles), t1 = tile_begin(b + 1, a.num_tokens, a.tiles);
    for (int g0 = t0; g0 < t1; g0 += kDataThreads) {
        const int count = min(kDataThreads, t1 - g0);
        if (tid < count) pos[tid] = a.send_pos[g0 + tid];
        __syncthreads();
        // Fewer tokens than warps: the warps of a row take every parts-th column group.
        const int parts = max(1, min(kSoloWarps / count, num_groups));
        for (int item = warp; item < count * parts; item += kSoloWarps) {
            const int j = item / parts, part = item % parts;
            const int p = pos[j];
            // y [R, H]: row p came from token g0 + j
            const uint8_t* src =
                static_cast<const uint8_t*>(a.y) + static_cast<size_t>(max(p, 0)) * row_bytes;
            auto row_of = [&](int, float& w) -> const uint8_t* {
                w = 1.0f;
                return src;
            };
            uint8_t* out = static_cast<uint8_t*>(a.out) + static_cast<size_t>(g0 + j) * row_bytes;
            warp_sum_rows<kDType, kVec>(out, p >= 0 ? 1 : 0, row_of, H, part, parts, lane);
        }
        __syncthreads();  // pos is rewritten by the next group
    }
}

}  // namespace

void launch_solo_dispatch(const SoloDispatchArgs& a, cudaStream_t stream) {
    solo_dispatch_kernel<<<a.tiles, kDataThreads, 0, stream>>>(a);
}

void launch_solo_combine(const SoloCombineArgs& a, cudaStream_t stream) {
    const int tiles = a.tiles;
    const size_t row_bytes = row_bytes_of(a.rt);
    const bool vec =
        ((row_bytes | reinterpret_cast<uintptr_t>(a.y) | reinterpret_cast<uintptr_t>(a.out)) & 15) == 0;
    with_dtype_and_vec(a.rt.dtype, vec, [&](auto dtype, auto vec_tag) {
        solo_combine_kernel<decltype(dtype)::value, decltype(vec_tag)::value>
            <<<tiles, kDataThreads, 0, stream>>>(a);
    });
}

}  // namespace moerl::ep::cuda
