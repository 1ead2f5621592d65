// The checkpoint store in a local directory: keys are relative paths under the root.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "backends.hpp"
#include "moerl/core/error.hpp"

namespace moerl::control {

namespace {

namespace fs = std::filesystem;

void check_key(const std::string& key) {
    MOERL_CHECK(!key.empty() && key.front() != '/' && key.find("..") == std::string::npos,
                "checkpoint store key '", key, "' must be a relative path without '..'");
}

// Copies src to dst atomically: a temporary file beside dst, then rename.
void copy_atomic(const fs::path& src, const fs::path& dst) {
    std::error_code ec;
    if (dst.has_parent_path()) fs::create_directories(dst.parent_path(), ec);
    MOERL_CHECK(!ec, "cannot create directory ", dst.parent_path().string(), ": ", ec.message());
    fs::path tmp = dst;
    tmp += ".tmp." + std::to_string(::getpid());
    fs::copy_file(src, tmp, fs::copy_options::overwrite_existing, ec);
    if (!ec) fs::rename(tmp, dst, ec);
    if (ec) {
        std::error_code ignored;  // a full disk: leave no partial file behind
        fs::remove(tmp, ignored);
        MOERL_FAIL("cannot copy ", src.string(), " to ", dst.string(), ": ", ec.message());
    }
}

class FileCheckpointStore final : public CheckpointStore {
  public:
    explicit FileCheckpointStore(const std::string& dir) : root_(fs::absolute(dir)) {
        MOERL_CHECK(!dir.empty(), "checkpoint store: empty directory");
        std::error_code ec;
        fs::create_directories(root_, ec);
        MOERL_CHECK(!ec, "checkpoint store: cannot create directory ", root_.string(), ": ", ec.message());
    }

    std::string uri() const override { return "file://" + root_.string(); }

    void put_file(const std::string& key, const std::string& local_path) override {
        check_key(key);
        MOERL_CHECK(fs::is_regular_file(local_path), "checkpoint store: ", local_path, " is not a file");
        copy_atomic(local_path, root_ / key);
    }

    void get_file(const std::string& key, const std::string& local_path) override {
        check_key(key);
        MOERL_CHECK(fs::is_regular_file(root_ / key), "checkpoint store ", uri(), ": no key '", key, "'");
        copy_atomic(root_ / key, local_path);
    }

    bool exists(const std::string& key) override {
        check_key(key);
        return fs::is_regular_file(root_ / key);
    }

    std::vector<std::string> list(const std::string& prefix) override {
        std::vector<std::string> out;
        std::error_code ec;
        for (auto it = fs::recursive_directory_iterator(root_, ec);
             !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
            if (!it->is_regular_file()) continue;
            std::string key = fs::relative(it->path(), root_).generic_string();
            if (key.find(".tmp.") != std::string::npos) continue;  // an upload in flight
            if (key.rfind(prefix, 0) == 0) out.push_back(key);
        }
        std::sort(out.begin(), out.end());
        return out;
    }

    void remove(const std::string& key) override {
        check_key(key);
        std::error_code ec;
        fs::remove(root_ / key, ec);
        MOERL_CHECK(!ec, "checkpoint store: cannot remove ", (root_ / key).string(), ": ", ec.message());
        // Directories the key leaves empty go too (a pruned checkpoint leaves nothing behind).
        for (fs::path dir = (root_ / key).parent_path();
             dir != root_ && dir.string().size() > root_.string().size(); dir = dir.parent_path()) {
            if (!fs::is_empty(dir, ec) || ec || !fs::remove(dir, ec)) break;
        }
    }

  private:
    fs::path root_;
};

}  // namespace

std::unique_ptr<CheckpointStore> make_file_checkpoint_store(const std::string& dir) {
    return std::make_unique<FileCheckpointStore>(dir);
}

}  // namespace moerl::control
