// Layout kernels: per-rank and per-expert counts from topk_idx, validated on the device, and the
// normal-mode notify phase (counts written into every peer's count slot). The normal layout runs one
// block per tile of tokens; the low-latency one is a single block.
#include <algorithm>

#include "common.cuh"

namespace moerl::ep::cuda {

namespace {

// Tile states of the decoupled look-back: the tile's own count (kAggregate) or the count of all tiles
// up to it (kInclusive), tagged with the call's seq in the high word so that stale words never match.
constexpr unsigned long long kAggregate = 1, kInclusive = 2;
constexpr int kLayoutWarps = kLayoutTile / 32;

__device__ __forceinline__ unsigned long long tile_word(unsigned seq, unsigned long long kind, int count) {
    return (static_cast<unsigned long long>(seq) << 32) | (kind << 30) | static_cast<unsigned>(count);
}

// Rows of the tiles before `tile` for rank r, by one warp: a window of 32 predecessors per step, from
// the nearest back to the first inclusive one. Predecessors took earlier tickets, so they are running
// and publish their aggregates without waiting on anything: the spin ends.
__device__ __forceinline__ int warp_look_back(const unsigned long long* tile_state, int world, int tile,
                                              int r, unsigned seq, int lane) {
    int sum = 0;
    int next = tile - 1;  // nearest predecessor not yet summed
    while (true) {
        const int j = next - lane;
        const unsigned long long v = j >= 0 ? *reinterpret_cast<const volatile unsigned long long*>(
                                                  tile_state + static_cast<size_t>(j) * world + r)
                                            : tile_word(seq, kInclusive, 0);
        const bool ready = (v >> 32) == seq;
        const bool inclusive = ready && ((v >> 30) & 3) == kInclusive;
        const unsigned ready_mask = __ballot_sync(kFullMask, ready);
        const unsigned inclusive_mask = __ballot_sync(kFullMask, inclusive);
        const int count = ready ? static_cast<int>(v & 0x3fffffffu) : 0;
        if (inclusive_mask != 0) {
            const int stop = __ffs(inclusive_mask) - 1;
            const unsigned upto = (2u << stop) - 1u;  // lanes 0..stop
            if ((ready_mask & upto) == upto)
                return sum + __reduce_add_sync(kFullMask, lane <= stop ? count : 0);
        } else if (ready_mask == kFullMask) {
            sum += __reduce_add_sync(kFullMask, count);
            next -= 32;
        }
    }
}

// Thread i of tile b handles token b * kLayoutTile + i. Each tile counts its rows per rank and entries
// per expert in shared memory, finds the rows of earlier tiles per rank by decoupled look-back, writes
// send_pos and adds its counts to the global totals; the last tile to finish writes the summaries and
// runs the notify phase.
__global__ void __launch_bounds__(kLayoutTile) layout_kernel(LayoutArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, L = rt.num_local_experts, K = rt.top_k, T = a.num_tokens;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const LayoutScratch& g = a.scratch;
    __shared__ int expert_count[kMaxExperts];
    __shared__ int warp_rank_count[kLayoutWarps][kMaxRanks];  // per warp, then exclusive prefix in the tile
    __shared__ int tile_count[kMaxRanks];                     // rows of this tile per rank
    __shared__ int tile_base[kMaxRanks];                      // rows of earlier tiles per rank
    __shared__ int tile;
    __shared__ int is_last;
    if (tid == 0) tile = static_cast<int>(atomicAdd(&g.counters[0], 1u));  // tiles in start order
    for (int i = tid; i < W * L; i += blockDim.x) expert_count[i] = 0;
    __syncthreads();

    const int t = tile * kLayoutTile + tid;
    unsigned long long mask = 0;  // ranks token t goes to
    if (t < T)
        for_each_routed_expert(a.topk_idx, t, K, rt.num_experts, a.sig.error, a.sig.error_mirror, [&](int e) {
            atomicAdd(&expert_count[e], 1);
            mask |= 1ull << (e / L);
        });
    for (int r = 0; r < W; ++r) {
        const unsigned b = __ballot_sync(kFullMask, (mask >> r) & 1);
        if (lane == 0) warp_rank_count[warp][r] = __popc(b);
    }
    __syncthreads();
    if (tid < W) {
        int run = 0;
        for (int w = 0; w < kLayoutWarps; ++w) {
            const int c = warp_rank_count[w][tid];
            warp_rank_count[w][tid] = run;
            run += c;
        }
        tile_count[tid] = run;
        tile_base[tid] = 0;
        // tile_state [tiles, W]: this tile's aggregate (the first tile's is inclusive already)
        *reinterpret_cast<volatile unsigned long long*>(g.tile_state + static_cast<size_t>(tile) * W + tid) =
            tile_word(a.seq, tile == 0 ? kInclusive : kAggregate, run);
    }
    __syncthreads();
    if (tile > 0) {
        for (int r = warp; r < W; r += kLayoutWarps) {
            const int before = warp_look_back(g.tile_state, W, tile, r, a.seq, lane);
            if (lane == 0) {
                tile_base[r] = before;
                *reinterpret_cast<volatile unsigned long long*>(g.tile_state + static_cast<size_t>(tile) * W +
                                                                r) =
                    tile_word(a.seq, kInclusive, before + tile_count[r]);
            }
        }
        __syncthreads();
    }
    for (int r = 0; r < W; ++r) {
        const bool in = (mask >> r) & 1;
        const unsigned b = __ballot_sync(kFullMask, in);
        if (t < T)
            a.send_pos[static_cast<size_t>(t) * W + r] =
                in ? tile_base[r] + warp_rank_count[warp][r] + __popc(b & lanemask_lt()) : -1;
    }
    for (int i = tid; i < W * L; i += blockDim.x)
        if (expert_count[i] != 0) atomicAdd(&g.expert_total[i], expert_count[i]);
    if (tid < W && tile_count[tid] != 0) atomicAdd(&g.rank_total[tid], tile_count[tid]);

    // The last tile to finish: totals into shared memory (the global ones back to zero for the next call).
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(&g.counters[1], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int i = tid; i < W * L; i += blockDim.x) expert_count[i] = atomicExch(&g.expert_total[i], 0);
    if (tid < W) tile_base[tid] = atomicExch(&g.rank_total[tid], 0);  // now: rows per rank, all tiles
    if (tid == 0) {
        g.counters[0] = 0;
        g.counters[1] = 0;
    }
    __syncthreads();
    const int* rank_rows = tile_base;

    // send_summary [W, 1+L]
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
        const int r = i / (1 + L), j = i % (1 + L);
        const int v = j == 0 ? rank_rows[r] : expert_count[r * L + j - 1];
        a.send_summary[i] = v;
        if (a.self_only) a.recv_summary[i] = v;
    }
    if (a.self_only && tid == 0) {
        a.recv_src_offset[0] = 0;
        a.recv_src_offset[1] = rank_rows[0];
    }
    const Signals& s = a.sig;
    if (s.peers == nullptr || a.self_only) return;

    // Notify: summary for rank r -> r's count slot `rank`; then read every source's summary here.
    const unsigned long long epoch = current_epoch(s, kChCount);
    if (!block_wait_slots_free(s, kChCount, epoch)) return;
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
        const int r = i / (1 + L), j = i % (1 + L);
        auto* slot = reinterpret_cast<int*>(s.peers[r] + a.count_offset + s.rank * a.count_slot_bytes);
        slot[j] = j == 0 ? rank_rows[r] : expert_count[r * L + j - 1];
    }
    block_signal_data(s, kChCount);
    if (!block_wait_data(s, kChCount, epoch, 1)) return;
    // local + src * count_slot_bytes: the summary source src sent here
    const uint8_t* local = s.peers[s.rank] + a.count_offset;
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
        const int src = i / (1 + L), j = i % (1 + L);
        a.recv_summary[i] = reinterpret_cast<const volatile int*>(local + src * a.count_slot_bytes)[j];
    }
    if (tid == 0) {  // from the slots, not recv_summary (which may be host memory)
        int run = 0;
        a.recv_src_offset[0] = 0;
        for (int src = 0; src < W; ++src) {
            run += reinterpret_cast<const volatile int*>(local + src * a.count_slot_bytes)[0];
            a.recv_src_offset[src + 1] = run;
        }
    }
    __syncthreads();  // this block's reads of the slots are done
    block_release_slots(s, kChCount, epoch);
}

// One block; entries i = t*K + k in chunks of kLayoutThreads, the warps of a chunk take turns so that
// positions within an expert follow token order. A token goes once to each expert: an id repeated in its
// top-k takes no position of its own and shares the row of the id's first entry.
__global__ void __launch_bounds__(kLayoutThreads, 1) ll_layout_kernel(LLLayoutArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, L = rt.num_local_experts, K = rt.top_k;
    const int N = a.num_tokens * K;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    __shared__ int expert_count[kMaxExperts];
    for (int i = tid; i < W * L; i += blockDim.x) expert_count[i] = 0;
    __syncthreads();
    for (int chunk = 0; chunk < N; chunk += kLayoutThreads) {
        const int i = chunk + tid;
        int e = -1;  // the entry's expert, -1 for none, out of range or an earlier entry's repeat
        if (i < N) {
            const long long v = a.topk_idx[i];
            if (v < -1 || v >= rt.num_experts) {
                report_bad_id(a.error, a.error_mirror, i / K, i % K, v);
                a.topk32[i] = -1;
            } else {
                a.topk32[i] = static_cast<int>(v);
                e = static_cast<int>(v);
                for (int j = i - i % K; j < i && e >= 0; ++j)
                    if (a.topk_idx[j] == v) e = -1;
            }
        }
        const unsigned same = __match_any_sync(kFullMask, e);
        const int leader = __ffs(same) - 1;
        int base = 0;
        for (int w = 0; w < kLayoutThreads / 32; ++w) {
            if (w == warp && lane == leader && e >= 0) {
                base = expert_count[e];
                expert_count[e] = base + __popc(same);
            }
            __syncthreads();
        }
        base = __shfl_sync(kFullMask, base, leader);
        if (i < N) a.pos_in_expert[i] = e >= 0 ? base + __popc(same & lanemask_lt()) : -1;
    }
    __syncthreads();
    // Repeats take the position of the first entry with their id (written above, never rewritten here).
    for (int i = tid; i < N; i += blockDim.x) {
        const int e = a.topk32[i];
        if (e < 0 || a.pos_in_expert[i] >= 0) continue;
        for (int j = i - i % K; j < i; ++j)
            if (a.topk32[j] == e) {
                a.pos_in_expert[i] = a.pos_in_expert[j];
                break;
            }
    }
    for (int i = tid; i < W * L; i += blockDim.x) a.expert_count[i] = expert_count[i];
    if (tid < W) {
        int run = 0;
        for (int l = 0; l < L; ++l) {
            a.expert_offset[tid * L + l] = run;
            run += expert_count[tid * L + l];
        }
        a.send_rows[tid] = run;
    }
}

// Thread t counts token t: its entries per expert, and once per rank that any of them lives on.
// An id outside -1..E-1 counts nowhere and is reported by its entry, the lowest one winning.
__global__ void __launch_bounds__(kTopkLayoutThreads) topk_layout_kernel(TopkLayoutArgs a) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= a.num_tokens) return;
    const int W = a.world, E = a.num_experts, K = a.top_k;
    const int per_rank = (E + W - 1) / W;
    unsigned long long ranks = 0;
    for (int k = 0; k < K; ++k) {
        const long long e = a.topk_idx[static_cast<long long>(t) * K + k];
        if (e < -1 || e >= E) {
            atomicMin(&a.counts[W + E], t * K + k);
        } else if (e >= 0) {
            atomicAdd(&a.counts[W + e], 1);
            ranks |= 1ull << (static_cast<int>(e) / per_rank);
        }
    }
    for (int r = 0; r < W; ++r) {
        const bool in = (ranks >> r) & 1ull;
        a.in_rank[static_cast<long long>(t) * W + r] = in;
        if (in) atomicAdd(&a.counts[r], 1);
    }
}

}  // namespace

void launch_layout(const LayoutArgs& a, cudaStream_t stream) {
    const int tiles = std::max(1, (a.num_tokens + kLayoutTile - 1) / kLayoutTile);
    layout_kernel<<<tiles, kLayoutTile, 0, stream>>>(a);
}

void launch_topk_layout(const TopkLayoutArgs& a, cudaStream_t stream) {
    const size_t counts = static_cast<size_t>(a.world) + a.num_experts;
    cudaMemsetAsync(a.counts, 0, counts * sizeof(int), stream);
    cudaMemsetAsync(a.counts + counts, 0x7f, sizeof(int), stream);  // kTopkLayoutNoBadEntry
    if (a.num_tokens > 0)
        topk_layout_kernel<<<(a.num_tokens + kTopkLayoutThreads - 1) / kTopkLayoutThreads, kTopkLayoutThreads,
                             0, stream>>>(a);
}

void launch_ll_layout(const LLLayoutArgs& a, cudaStream_t stream) {
    ll_layout_kernel<<<1, kLayoutThreads, 0, stream>>>(a);
}

}  // namespace moerl::ep::cuda
