// The local-directory store and checkpoint publish/fetch with sha256 verification.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"
#include "temp_dir.hpp"

using namespace moerl::control;
using moerl::control::test::TempDir;
namespace fs = std::filesystem;

namespace {
void write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
}
std::string read(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

TEST(Sha256, KnownValue) {
    TempDir t;
    write(t.path / "abc", "abc");
    EXPECT_EQ(sha256_file((t.path / "abc").string()),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(FileStore, PutGetListRemove) {
    TempDir t;
    auto store = make_checkpoint_store("file://" + (t.path / "store").string());
    write(t.path / "src.bin", "hello");
    store->put_file("run/a/x.bin", (t.path / "src.bin").string());
    store->put_file("run/b.bin", (t.path / "src.bin").string());
    EXPECT_TRUE(store->exists("run/a/x.bin"));
    EXPECT_FALSE(store->exists("run/none"));
    EXPECT_EQ(store->list("run/"), (std::vector<std::string>{"run/a/x.bin", "run/b.bin"}));
    store->get_file("run/b.bin", (t.path / "out.bin").string());
    EXPECT_EQ(read(t.path / "out.bin"), "hello");
    store->remove("run/b.bin");
    EXPECT_FALSE(store->exists("run/b.bin"));
    EXPECT_THROW(store->get_file("run/b.bin", (t.path / "o").string()), moerl::Error);
    EXPECT_THROW(store->put_file("../escape", (t.path / "src.bin").string()), moerl::Error);
}

TEST(Checkpoint, PublishFetchRoundTripWithCache) {
    TempDir t;
    write(t.path / "ckpt/config.json", "{}");
    write(t.path / "ckpt/model.safetensors", std::string(1000, 'w'));
    write(t.path / "ckpt/sub/optimizer.bin", "opt");
    auto store = make_checkpoint_store((t.path / "store").string());
    Manifest m = publish_checkpoint(*store, (t.path / "ckpt").string(), "v3", 3, 7);
    EXPECT_EQ(m.files.size(), 3u);
    EXPECT_TRUE(store->exists("v3/manifest.json"));
    Manifest f = fetch_checkpoint(*store, "v3", (t.path / "got").string(), (t.path / "cache").string());
    EXPECT_EQ(f.version, 3);
    EXPECT_EQ(f.step, 7);
    EXPECT_EQ(f.files, m.files);
    EXPECT_EQ(read(t.path / "got/sub/optimizer.bin"), "opt");
    EXPECT_TRUE(fs::exists(t.path / "cache/v3/model.safetensors"));
    // A second fetch is served from the cache.
    Manifest again = fetch_checkpoint(*store, "v3", (t.path / "got2").string(), (t.path / "cache").string());
    EXPECT_EQ(read(t.path / "got2/model.safetensors"), std::string(1000, 'w'));
}

TEST(Checkpoint, CorruptFileFailsClearly) {
    TempDir t;
    write(t.path / "ckpt/model.safetensors", "good weights");
    auto store = make_checkpoint_store((t.path / "store").string());
    publish_checkpoint(*store, (t.path / "ckpt").string(), "v1", 1, 1);
    write(t.path / "store/v1/model.safetensors", "evil weights");
    try {
        fetch_checkpoint(*store, "v1", (t.path / "got").string());
        FAIL() << "expected a sha256 mismatch";
    } catch (const moerl::Error& e) {
        std::string msg = e.what();
        EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
        EXPECT_NE(msg.find("sha256"), std::string::npos) << msg;
    }
}

TEST(Checkpoint, MissingManifestIsNotACheckpoint) {
    TempDir t;
    write(t.path / "store/v9/model.safetensors", "w");
    auto store = make_checkpoint_store((t.path / "store").string());
    EXPECT_THROW(fetch_checkpoint(*store, "v9", (t.path / "got").string()), moerl::Error);
}

TEST(Checkpoint, VerifyDirChecksEveryFileAgainstTheManifest) {
    TempDir t;
    const fs::path src = t.path / "src", dir = t.path / "dir";
    write(src / "config.json", "{}");
    write(src / "model.safetensors", std::string(4096, 'w'));
    auto store = make_checkpoint_store("file://" + (t.path / "store").string());
    publish_checkpoint(*store, src.string(), "ckpt-3", 3, 30);
    EXPECT_FALSE(verify_checkpoint_dir(src.string()).has_value());  // no manifest: nothing to check
    fetch_checkpoint(*store, "ckpt-3", dir.string());
    auto m = verify_checkpoint_dir(dir.string());
    ASSERT_TRUE(m.has_value());
    EXPECT_EQ(m->version, 3);
    EXPECT_EQ(m->files.size(), 2u);

    auto expect_refused = [&](const char* needle) {
        try {
            verify_checkpoint_dir(dir.string());
            ADD_FAILURE() << "a damaged checkpoint must be refused (" << needle << ")";
        } catch (const moerl::Error& e) {
            EXPECT_NE(e.message().find(needle), std::string::npos) << e.message();
        }
    };
    std::string bytes = read(dir / "model.safetensors");
    bytes[1000] ^= 1;  // one flipped bit, same size
    write(dir / "model.safetensors", bytes);
    expect_refused("model.safetensors");
    fetch_checkpoint(*store, "ckpt-3", dir.string());
    write(dir / "model-00002-of-00002.safetensors", "stale");
    expect_refused("model-00002-of-00002.safetensors");
    fs::remove(dir / "model-00002-of-00002.safetensors");
    std::string manifest = read(dir / "manifest.json");
    const auto at = manifest.find("\"sha256\": \"") + 11;
    manifest.replace(at, 64, std::string(64, '0'));
    write(dir / "manifest.json", manifest);
    expect_refused("sha256");
    fs::remove(dir / "config.json");
    expect_refused("missing");
}
