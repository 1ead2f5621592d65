// Fuzz target: a model's config.json (transformers 4.x and 5.x field names).
#include "fuzz_target.hpp"
#include "moerl/model/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    return moerl::fuzz::parse_or_refuse([&] {
        using moerl::model::ModelConfig;
        const ModelConfig c = ModelConfig::from_json_text(moerl::fuzz::as_text(data, size), "config.json");
        // What moerl writes back it must read back unchanged.
        const std::string text = c.to_json_text();
        moerl::fuzz::require(ModelConfig::from_json_text(text, "saved config.json").to_json_text() == text,
                             "config.json round trip");
    });
}
