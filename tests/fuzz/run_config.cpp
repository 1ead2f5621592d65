// Fuzz target: the YAML run configuration of `moerl run CONFIG.yaml`.
#include "fuzz_target.hpp"
#include "moerl/rl/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    return moerl::fuzz::parse_or_refuse([&] {
        const auto c = moerl::rl::RunConfig::from_yaml_text(moerl::fuzz::as_text(data, size), "fuzz.yaml");
        moerl::fuzz::require(c.steps >= 1 && c.group_size >= 2 && c.ep_ranks >= 1, "validated limits hold");
        (void)c.max_new_tokens();
        (void)c.lr_at(c.steps - 1);
    });
}
