// Element types the EP library moves, and host conversions for them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace moerl::ep {

enum class DType : uint8_t { kFloat32, kBFloat16, kFloat8E4M3 };

inline size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : (t == DType::kBFloat16 ? 2 : 1); }
std::string dtype_name(DType t);
// Parses "fp32"/"float32", "bf16"/"bfloat16", "fp8"/"e4m3"; throws naming the bad value.
DType parse_dtype(const std::string& name);

// Columns covered by one fp32 scale in fp8 dispatch.
constexpr int kFp8BlockCols = 128;
// Largest finite e4m3 magnitude.
constexpr float kFp8Max = 448.0f;

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

// Round to nearest even, NaN kept quiet.
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

uint8_t float_to_e4m3(float f);
float e4m3_to_float(uint8_t v);

// Reads element i of a row of the given type as float (fp32 or bf16).
inline float load_as_float(const void* row, size_t i, DType t) {
    if (t == DType::kFloat32) return static_cast<const float*>(row)[i];
    return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
}
inline void store_from_float(void* row, size_t i, float v, DType t) {
    if (t == DType::kFloat32)
        static_cast<float*>(row)[i] = v;
    else
        static_cast<uint16_t*>(row)[i] = float_to_bf16(v);
}

}  // namespace moerl::ep
