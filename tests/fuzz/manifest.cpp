// Fuzz target: a checkpoint's manifest.json.
#include <filesystem>

#include "fuzz_target.hpp"
#include "moerl/control/control.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    return moerl::fuzz::parse_or_refuse([&] {
        const auto m = moerl::control::manifest_from_json(moerl::fuzz::as_text(data, size), "manifest.json");
        for (const auto& [name, file] : m.files) {
            // fetch_checkpoint writes each file under the checkpoint directory: no way out of it.
            const std::filesystem::path path(name);
            moerl::fuzz::require(!name.empty() && path.is_relative(), "relative file name");
            for (const auto& part : path) moerl::fuzz::require(part != "..", "no .. component");
            moerl::fuzz::require(file.first.size() == 64, "sha256 is 64 hex digits");
        }
    });
}
