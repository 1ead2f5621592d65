// Checkpoint publish and fetch through a CheckpointStore: files first, manifest.json last;
// readers verify every file's sha256 against the manifest.
#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "digest.hpp"
#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/json.hpp"

namespace moerl::control {

namespace {

namespace fs = std::filesystem;
constexpr const char* kManifest = "manifest.json";

std::string manifest_to_json(const Manifest& m) {
    nlohmann::json j;
    j["version"] = m.version;
    j["step"] = m.step;
    j["files"] = nlohmann::json::object();
    for (const auto& [name, f] : m.files) j["files"][name] = {{"sha256", f.first}, {"bytes", f.second}};
    return j.dump(2);
}

std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    MOERL_CHECK(in, "cannot read ", path);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

// A private scratch file name, unique per process and call.
std::string scratch_path(const std::string& tag) {
    static std::atomic<uint64_t> counter{0};
    return (fs::temp_directory_path() /
            ("moerl-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" + tag))
        .string();
}

void verify(const std::string& path, const std::string& what,
            const std::pair<std::string, uint64_t>& expect) {
    const uint64_t bytes = fs::file_size(path);
    MOERL_CHECK(bytes == expect.second, what, " has ", bytes, " bytes, but the manifest says ",
                expect.second);
    const std::string sha = sha256_file(path);
    MOERL_CHECK(sha == expect.first, what, " has sha256 ", sha, ", but the manifest says ", expect.first,
                " (corrupt or partially written)");
}

}  // namespace

Manifest manifest_from_json(const std::string& text, const std::string& source) {
    using nlohmann::json;
    Manifest m;
    try {
        const json j = parse_json(text, source);
        MOERL_CHECK(j.is_object(), source, ": expected a JSON object");
        // Integer fields only: get<int64_t>() of a float such as 1e300 would not fit.
        for (auto [key, out] : {std::pair{"version", &m.version}, std::pair{"step", &m.step}}) {
            MOERL_CHECK(j.at(key).is_number_integer(), source, ": ", key, " must be an integer, got ",
                        j.at(key).dump());
            *out = j.at(key).get<int64_t>();
        }
        for (const auto& [name, f] : j.at("files").items()) {
            // The name becomes a path under the checkpoint directory: it must stay inside it.
            bool inside = !name.empty() && name.front() != '/';
            for (const auto& part : fs::path(name)) inside = inside && part != ".." && part != ".";
            MOERL_CHECK(inside, source, ": files: \"", name,
                        "\" is not a relative path inside the checkpoint");
            const std::string& sha = f.at("sha256").get_ref<const std::string&>();
            MOERL_CHECK(sha.size() == 64 && sha.find_first_not_of("0123456789abcdef") == std::string::npos,
                        source, ": files.", name, ".sha256 must be 64 lower-case hex digits, got \"", sha,
                        "\"");
            MOERL_CHECK(f.at("bytes").is_number_unsigned(), source, ": files.", name,
                        ".bytes must be a non-negative integer, got ", f.at("bytes").dump());
            m.files[name] = {sha, f.at("bytes").get<uint64_t>()};
        }
    } catch (const nlohmann::json::exception& e) {
        MOERL_FAIL(source, ": not a valid checkpoint manifest: ", e.what());
    }
    return m;
}

std::string sha256_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    MOERL_CHECK(in, "sha256: cannot open ", path);
    Digest digest(EVP_sha256());
    std::vector<char> buf(1 << 20);
    while (in) {
        in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
        if (in.gcount() > 0) digest.update(buf.data(), static_cast<size_t>(in.gcount()));
    }
    return digest.hex();
}

Manifest publish_checkpoint(CheckpointStore& store, const std::string& local_dir, const std::string& name,
                            int64_t version, int64_t step) {
    MOERL_CHECK(fs::is_directory(local_dir), "publish_checkpoint: ", local_dir, " is not a directory");
    MOERL_CHECK(!name.empty(), "publish_checkpoint: empty checkpoint name");
    Manifest m;
    m.version = version;
    m.step = step;
    std::vector<std::string> rels;
    for (const auto& e : fs::recursive_directory_iterator(local_dir)) {
        if (!e.is_regular_file()) continue;
        std::string rel = fs::relative(e.path(), local_dir).generic_string();
        if (rel != kManifest) rels.push_back(rel);
    }
    std::sort(rels.begin(), rels.end());
    const bool existed = store.exists(name + "/" + kManifest);
    std::vector<std::string> uploaded;
    const std::string tmp = scratch_path(kManifest);
    try {
        for (const auto& rel : rels) {
            const std::string path = (fs::path(local_dir) / rel).string();
            m.files[rel] = {sha256_file(path), fs::file_size(path)};
            store.put_file(name + "/" + rel, path);
            uploaded.push_back(name + "/" + rel);
        }
        // The manifest goes last: until it exists, readers ignore the checkpoint.
        {
            std::ofstream out(tmp, std::ios::binary);
            out << manifest_to_json(m);
            MOERL_CHECK(out.good(), "publish_checkpoint: cannot write ", tmp);
        }
        store.put_file(name + "/" + kManifest, tmp);
    } catch (...) {
        // Best effort (a full disk): no half-uploaded checkpoint left behind, unless it replaced
        // a published one (whose manifest then no longer matches and is refused by readers).
        std::error_code ec;
        fs::remove(tmp, ec);
        if (!existed) {
            for (const auto& key : uploaded) {
                try {
                    store.remove(key);
                } catch (const std::exception&) {
                }
            }
        }
        throw;
    }
    fs::remove(tmp);
    return m;
}

Manifest fetch_checkpoint(CheckpointStore& store, const std::string& name, const std::string& local_dir,
                          const std::string& cache_dir) {
    const std::string key = name + "/" + kManifest;
    MOERL_CHECK(store.exists(key), "checkpoint '", name, "' in ", store.uri(),
                " has no manifest.json (not published, or still being written)");
    const std::string tmp = scratch_path(kManifest);
    store.get_file(key, tmp);
    const std::string text = read_text(tmp);
    fs::remove(tmp);
    Manifest m = manifest_from_json(text, store.uri() + "/" + key);
    fs::create_directories(local_dir);
    for (const auto& [rel, expect] : m.files) {
        const std::string dst = (fs::path(local_dir) / rel).string();
        const std::string what = "checkpoint '" + name + "' file " + rel;
        if (fs::path(dst).has_parent_path()) fs::create_directories(fs::path(dst).parent_path());
        if (!cache_dir.empty()) {
            const fs::path cached = fs::path(cache_dir) / name / rel;
            bool hit = fs::is_regular_file(cached) && fs::file_size(cached) == expect.second &&
                       sha256_file(cached.string()) == expect.first;
            if (!hit) {
                fs::create_directories(cached.parent_path());
                store.get_file(name + "/" + rel, cached.string());
                verify(cached.string(), what, expect);
            }
            fs::copy_file(cached, dst, fs::copy_options::overwrite_existing);
        } else {
            store.get_file(name + "/" + rel, dst);
            verify(dst, what, expect);
        }
    }
    std::ofstream(fs::path(local_dir) / kManifest, std::ios::binary) << text;
    return m;
}

std::optional<Manifest> verify_checkpoint_dir(const std::string& dir) {
    const fs::path manifest_path = fs::path(dir) / kManifest;
    if (!fs::exists(manifest_path)) return std::nullopt;
    const Manifest m = manifest_from_json(read_text(manifest_path.string()), manifest_path.string());
    MOERL_CHECK(!m.files.empty(), manifest_path.string(), " lists no files");
    for (const auto& [rel, expect] : m.files) {
        const fs::path path = fs::path(dir) / rel;
        MOERL_CHECK(fs::is_regular_file(path), "checkpoint ", dir, ": ", rel,
                    " is listed in manifest.json but missing");
        verify(path.string(), "checkpoint " + dir + " file " + rel, expect);
    }
    for (const auto& entry : fs::directory_iterator(dir)) {
        const std::string name = entry.path().filename().string();
        MOERL_CHECK(entry.path().extension() != ".safetensors" || m.files.count(name) != 0, "checkpoint ",
                    dir, ": ", name, " is not listed in manifest.json (left from another checkpoint?)");
    }
    return m;
}

}  // namespace moerl::control
