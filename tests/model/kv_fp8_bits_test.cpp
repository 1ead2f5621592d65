// The FP8 KV cache's widening of e4m3 bytes to bf16 (cuda/kv_fp8_bits.hpp), the code the tensor-core
// attention kernel runs, checked on the CPU against the EP library's e4m3 decoder: every byte but the
// NaNs comes out as its value x 2^-120 exactly (zeros, subnormals, both signs, the largest), and 8
// bytes keep their order.
#include "cuda/kv_fp8_bits.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moerl/ep/dtype.hpp"

namespace moerl::model::cuda {
namespace {

double bf16_bits_to_double(uint32_t half) {
    const uint32_t bits = half << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

TEST(KvFp8Bits, EveryByteWidensToItsValueTimesAPowerOfTwo) {
    int checked = 0;
    for (uint32_t b = 0; b < 256; ++b) {
        if ((b & 0x7fu) == 0x7fu) continue;  // e4m3's NaNs: never stored (the quantiser saturates)
        // The byte in each position of a pair: low half and high half.
        const uint32_t lo = widen_e4m3_pair(spread_e4m3_pair(b));
        const uint32_t hi = widen_e4m3_pair(spread_e4m3_pair(b << 8));
        const double want = std::ldexp(static_cast<double>(ep::e4m3_to_float(static_cast<uint8_t>(b))), -120);
        EXPECT_EQ(bf16_bits_to_double(lo & 0xffffu), want) << "byte " << b << " in the low half";
        EXPECT_EQ(lo >> 16, 0u) << "byte " << b << ": the high half of a pair whose high byte is 0";
        EXPECT_EQ(bf16_bits_to_double(hi >> 16), want) << "byte " << b << " in the high half";
        EXPECT_EQ(std::ldexp(want, 120), static_cast<double>(ep::e4m3_to_float(static_cast<uint8_t>(b))));
        ++checked;
    }
    EXPECT_EQ(checked, 254);
    // The range's ends: 448 and the smallest subnormal, 2^-9.
    EXPECT_EQ(bf16_bits_to_double(widen_e4m3_pair(spread_e4m3_pair(0x7eu))), std::ldexp(448.0, -120));
    EXPECT_EQ(bf16_bits_to_double(widen_e4m3_pair(spread_e4m3_pair(0x81u))), -std::ldexp(1.0, -129));
}

TEST(KvFp8Bits, EightBytesKeepTheirOrder) {
    const uint8_t bytes[8] = {0x38, 0xb8, 0x01, 0x7e,
                              0x00, 0x40, 0xc4, 0x3c};  // 1, -1, 2^-9, 448, 0, 2, -3, 1.5
    uint32_t lo, hi;
    std::memcpy(&lo, bytes, 4);  // little-endian: byte 0 is the low byte, as the kernel loads them
    std::memcpy(&hi, bytes + 4, 4);
    uint32_t out[4];
    widen_e4m3x8(lo, hi, out);
    for (int i = 0; i < 8; ++i) {
        const uint32_t half = (out[i / 2] >> (16 * (i % 2))) & 0xffffu;
        EXPECT_EQ(std::ldexp(bf16_bits_to_double(half), 120),
                  static_cast<double>(ep::e4m3_to_float(bytes[i])))
            << "element " << i;
    }
    EXPECT_EQ(ep::e4m3_to_float(bytes[6]), -3.0f);
}

}  // namespace
}  // namespace moerl::model::cuda
