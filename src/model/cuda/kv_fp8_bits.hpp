// Internal: the FP8 KV cache's widening of e4m3 bytes to bf16 by bit moves, used by the tensor-core
// attention kernel and checked on the CPU (plain C++, host and device alike).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOERL_KV_FP8_FN __host__ __device__ __forceinline__
#else
#define MOERL_KV_FP8_FN inline
#endif

namespace moerl::model::cuda {

// bf16's exponent bias (127) is 120 above e4m3's (7): the widened value is the e4m3 value x 2^-120.
constexpr float kE4m3InBf16 = 0x1p120f;

// Bytes 0 and 1 of `word` to the low bytes of its two 16-bit halves.
MOERL_KV_FP8_FN uint32_t spread_e4m3_pair(uint32_t word) { return (word & 0xffu) | ((word & 0xff00u) << 8); }

// Two e4m3 bytes spread by spread_e4m3_pair to a bf16x2 word holding each value x 2^-120 exactly:
// the sign to bit 15, the 4 exponent and 3 mantissa bits to bits 10..4 (e4m3 subnormals land on bf16
// subnormals, zero on zero). No conversion instructions.
MOERL_KV_FP8_FN uint32_t widen_e4m3_pair(uint32_t spread) {
    return ((spread & 0x00800080u) << 8) | ((spread & 0x007f007fu) << 4);
}

// 8 e4m3 bytes (lo: bytes 0-3, hi: bytes 4-7, the first in the low byte) to 8 bf16 in the same
// order, two a word, each value x 2^-120.
MOERL_KV_FP8_FN void widen_e4m3x8(uint32_t lo, uint32_t hi, uint32_t (&out)[4]) {
    out[0] = widen_e4m3_pair(spread_e4m3_pair(lo));
    out[1] = widen_e4m3_pair(spread_e4m3_pair(lo >> 16));
    out[2] = widen_e4m3_pair(spread_e4m3_pair(hi));
    out[3] = widen_e4m3_pair(spread_e4m3_pair(hi >> 16));
}

}  // namespace moerl::model::cuda

#undef MOERL_KV_FP8_FN
