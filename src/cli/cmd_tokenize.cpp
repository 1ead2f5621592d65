// `moerl tokenize` (JSONL text <-> ids through a Hugging Face tokenizer) and `moerl bench tokenizer`.
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.hpp"
#include "moerl/core/error.hpp"
#include "moerl/text/tokenizer.hpp"
#include "tokenizer/tokenizer_bench.hpp"

namespace moerl::cli {

namespace {

struct TokenizeOptions {
    std::string tokenizer;
    bool decode = false;
    bool no_special = false;
    bool skip_special = false;
};

// Reads JSONL from stdin: {"text": ...} -> {"ids": [...]}, or with --decode {"ids": [...]} -> {"text": ...}.
void run_tokenize(const TokenizeOptions& o) {
    text::Tokenizer tok = text::Tokenizer::load(o.tokenizer);
    std::ios::sync_with_stdio(false);
    std::string line;
    std::vector<int32_t> ids;
    for (size_t line_no = 1; std::getline(std::cin, line); ++line_no) {
        if (line.empty()) continue;
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::parse_error& e) {
            MOERL_FAIL("stdin line ", line_no, ": not valid JSON: ", e.what());
        }
        if (o.decode) {
            MOERL_CHECK(j.is_object() && j.contains("ids") && j["ids"].is_array(), "stdin line ", line_no,
                        ": expected {\"ids\": [...]}");
            ids.clear();
            for (const auto& v : j["ids"]) {
                MOERL_CHECK(v.is_number_integer(), "stdin line ", line_no, ": ids must be integers, got ",
                            v.dump());
                ids.push_back(v.get<int32_t>());
            }
            std::cout << nlohmann::json{{"text", tok.decode(ids, o.skip_special)}}.dump(
                             -1, ' ', false, nlohmann::json::error_handler_t::replace)
                      << "\n";
        } else {
            MOERL_CHECK(j.is_object() && j.contains("text") && j["text"].is_string(), "stdin line ", line_no,
                        ": expected {\"text\": \"...\"}");
            try {
                ids = tok.encode(j["text"].get_ref<const std::string&>(), !o.no_special);
            } catch (const Error& e) {
                MOERL_FAIL("stdin line ", line_no, ": ", e.message());
            }
            std::cout << nlohmann::json{{"ids", ids}}.dump() << "\n";
        }
    }
}

}  // namespace

void register_tokenize_commands(CLI::App& app, CLI::App& bench) {
    auto opts = std::make_shared<TokenizeOptions>();
    CLI::App* cmd =
        app.add_subcommand("tokenize", "JSONL {\"text\"} on stdin -> {\"ids\"} on stdout (--decode: back)");
    cmd->add_option("--tokenizer", opts->tokenizer, "tokenizer.json or a directory holding it")->required();
    cmd->add_flag("--decode", opts->decode, "read {\"ids\": [...]} lines and write {\"text\": ...}");
    cmd->add_flag("--no-special", opts->no_special, "encode without the post-processor's special tokens");
    cmd->add_flag("--skip-special", opts->skip_special, "decode without special tokens");
    cmd->callback([opts] { run_tokenize(*opts); });

    auto bopts = std::make_shared<moerl::bench::TokenizerBenchOptions>();
    CLI::App* b = bench.add_subcommand("tokenizer", "Tokenizer encode MB/s beside Hugging Face's tokenizers");
    moerl::bench::add_tokenizer_bench_options(*b, *bopts);
    b->callback([bopts] {
        int rc = moerl::bench::run_tokenizer_bench(*bopts);
        MOERL_CHECK(rc == 0, "bench tokenizer failed");
    });
}

}  // namespace moerl::cli
