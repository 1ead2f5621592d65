// Fuzz target: the header of a safetensors file (8-byte length, JSON, data region), given as bytes.
#include "fuzz_target.hpp"
#include "moerl/model/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    return moerl::fuzz::parse_or_refuse([&] {
        const auto header = moerl::model::parse_safetensors_header(data, size, "fuzz.safetensors");
        for (const auto& t : header.tensors) {
            // An accepted tensor lies inside the file, so SafetensorsFile::data() stays in bounds.
            moerl::fuzz::require(header.data_offset + t.offset + t.nbytes <= size, "tensor inside the file");
            moerl::fuzz::require(t.numel() >= 0, "numel fits in int64");
        }
    });
}
