#include "moerl/ep/store.hpp"

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "moerl/core/error.hpp"

namespace moerl::ep {

namespace {

namespace fs = std::filesystem;

class FileStore final : public Store {
  public:
    explicit FileStore(std::string dir) : dir_(std::move(dir)) { fs::create_directories(dir_); }

    void set(const std::string& key, const std::vector<uint8_t>& value) override {
        const fs::path path = path_of(key);
        fs::create_directories(path.parent_path());
        std::random_device rd;
        const fs::path tmp = path.string() + ".tmp" + std::to_string(rd());
        {
            std::ofstream f(tmp, std::ios::binary);
            MOERL_CHECK(f.good(), "file store: cannot write ", tmp.string());
            f.write(reinterpret_cast<const char*>(value.data()), static_cast<std::streamsize>(value.size()));
            MOERL_CHECK(f.good(), "file store: short write to ", tmp.string());
        }
        fs::rename(tmp, path);  // readers see the whole value or nothing
    }

    std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
        const fs::path path = path_of(key);
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        auto pause = std::chrono::microseconds(50);
        while (true) {
            std::ifstream f(path, std::ios::binary);
            if (f.good()) {
                return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)),
                                            std::istreambuf_iterator<char>());
            }
            if (std::chrono::steady_clock::now() > deadline)
                throw TimeoutError("file store: key '" + key + "' did not appear within " +
                                       std::to_string(timeout.count()) + " ms",
                                   __FILE__, __LINE__);
            std::this_thread::sleep_for(pause);
            pause = std::min(pause * 2, std::chrono::microseconds(5000));
        }
    }

  private:
    fs::path path_of(const std::string& key) const {
        std::string safe = key;
        for (char& c : safe)
            if (c == '/' || c == ':') c = '_';
        return fs::path(dir_) / safe;
    }
    std::string dir_;
};

}  // namespace

std::unique_ptr<Store> make_file_store(const std::string& dir) { return std::make_unique<FileStore>(dir); }

std::vector<std::vector<uint8_t>> all_gather(Store& store, const std::string& prefix, int rank,
                                             int world_size, const std::vector<uint8_t>& mine,
                                             std::chrono::milliseconds timeout) {
    store.set(prefix + "/" + std::to_string(rank), mine);
    std::vector<std::vector<uint8_t>> out(world_size);
    for (int r = 0; r < world_size; ++r) {
        try {
            out[r] = r == rank ? mine : store.get(prefix + "/" + std::to_string(r), timeout);
        } catch (const TimeoutError& e) {
            throw TimeoutError("bootstrap '" + prefix + "': rank " + std::to_string(r) +
                                   " never arrived (waited " + std::to_string(timeout.count()) + " ms)",
                               __FILE__, __LINE__);
        }
    }
    return out;
}

}  // namespace moerl::ep
