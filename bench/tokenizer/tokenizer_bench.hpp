// `moerl bench tokenizer` / tokenizer_bench: encode MB/s on one core on English, code and CJK text
// beside Hugging Face's tokenizers (the npm Rust binding, one thread) in the same run, and batch
// encode with 1..N threads.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace moerl::bench {

struct TokenizerBenchOptions {
    std::string tokenizer;              // tokenizer.json or its directory; default: Qwen3 from node_modules
    std::string source_dir;             // where README.md, src/ and node_modules are
    std::vector<int> threads = {1, 2};  // batch encode thread counts
    double min_seconds = 1.0;           // time per measurement (repeated until reached)
    std::string node = "node";          // for the reference; "" skips it
};

void add_tokenizer_bench_options(CLI::App& app, TokenizerBenchOptions& opts);
int run_tokenizer_bench(const TokenizerBenchOptions& opts);

}  // namespace moerl::bench
