#include "moerl/ep/dtype.hpp"

#include <cmath>

#include "moerl/core/error.hpp"

namespace moerl::ep {

std::string dtype_name(DType t) {
    switch (t) {
        case DType::kFloat32:
            return "fp32";
        case DType::kBFloat16:
            return "bf16";
        case DType::kFloat8E4M3:
            return "fp8";
    }
    return "?";
}

DType parse_dtype(const std::string& name) {
    if (name == "fp32" || name == "float32" || name == "float") return DType::kFloat32;
    if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
    if (name == "fp8" || name == "e4m3" || name == "float8_e4m3fn") return DType::kFloat8E4M3;
    MOERL_FAIL("unknown dtype '", name, "', expected one of fp32, bf16, fp8");
}

// e4m3 (fn variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff are NaN.
float e4m3_to_float(uint8_t v) {
    const int sign = v >> 7;
    const int exp = (v >> 3) & 0xf;
    const int man = v & 0x7;
    float out;
    if (exp == 0xf && man == 0x7) return std::nanf("");
    if (exp == 0)
        out = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
    else
        out = std::ldexp(1.0f + man / 8.0f, exp - 7);
    return sign ? -out : out;
}

uint8_t float_to_e4m3(float f) {
    if (std::isnan(f)) return 0x7f;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0;
    float a = std::fabs(f);
    if (a >= kFp8Max) return sign | 0x7e;        // saturate to 448
    if (a < std::ldexp(1.0f, -10)) return sign;  // below half the smallest subnormal
    int e;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    int exp = e - 1 + 7;
    if (exp <= 0) {
        // subnormal: value = man * 2^-9
        int man = static_cast<int>(std::nearbyint(std::ldexp(a, 9)));
        if (man >= 8) return sign | 0x08;
        return sign | static_cast<uint8_t>(man);
    }
    float scaled = std::ldexp(a, -(e - 1));  // in [1, 2)
    int man = static_cast<int>(std::nearbyint((scaled - 1.0f) * 8.0f));
    if (man == 8) {
        man = 0;
        ++exp;
    }
    if (exp > 15 || (exp == 15 && man == 7)) return sign | 0x7e;
    return sign | static_cast<uint8_t>(exp << 3) | static_cast<uint8_t>(man);
}

}  // namespace moerl::ep
