// Standalone tokenizer benchmark (no LibTorch); `moerl bench tokenizer` runs the same code.
#include <iostream>

#include "moerl/core/error.hpp"
#include "tokenizer_bench.hpp"

int main(int argc, char** argv) {
    CLI::App app{"tokenizer_bench: encode MB/s beside Hugging Face's tokenizers"};
    moerl::bench::TokenizerBenchOptions opts;
    moerl::bench::add_tokenizer_bench_options(app, opts);
    CLI11_PARSE(app, argc, argv);
    try {
        return moerl::bench::run_tokenizer_bench(opts);
    } catch (const std::exception& e) {
        std::cerr << "tokenizer_bench: error: " << e.what() << "\n";
        return 1;
    }
}
