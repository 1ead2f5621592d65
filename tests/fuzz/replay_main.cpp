// A main() for the fuzz targets without libFuzzer: runs every file under the given files or
// directories through LLVMFuzzerTestOneInput once, so the seed corpus and the saved regression
// inputs are checked by every build (g++ included). Fails when it finds no input at all.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace fs = std::filesystem;

static void run_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
    std::fprintf(stderr, "replay %s (%zu bytes)\n", path.c_str(), bytes.size());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

int main(int argc, char** argv) {
    size_t count = 0;
    for (int i = 1; i < argc; ++i) {
        const fs::path arg = argv[i];
        if (!fs::exists(arg)) continue;  // a target may have no regression inputs yet
        if (fs::is_regular_file(arg)) {
            run_file(arg);
            ++count;
            continue;
        }
        std::vector<fs::path> files;
        for (const auto& e : fs::recursive_directory_iterator(arg)) {
            if (e.is_regular_file()) files.push_back(e.path());
        }
        std::sort(files.begin(), files.end());
        for (const auto& f : files) run_file(f);
        count += files.size();
    }
    std::fprintf(stderr, "%zu inputs replayed\n", count);
    return count > 0 ? 0 : 1;
}
