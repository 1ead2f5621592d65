// A run's layout in the checkpoint store: published checkpoints, pruning, the store-backed policy
// registry and the run-done marker.
#include "moerl/control/run_store.hpp"

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
// A policy directory as the trainer writes it.
std::string policy_dir(const fs::path& root, int version) {
    const fs::path dir = root / ("v" + std::to_string(version));
    fs::create_directories(dir);
    std::ofstream(dir / "model.safetensors") << "weights of v" << version;
    return dir.string();
}
}  // namespace

TEST(RunStore, OnlyCheckpointsWithAManifestArePublished) {
    TempDir t;
    auto store = make_checkpoint_store("file://" + (t.path / "store").string());
    const std::string src = policy_dir(t.path / "src", 0);
    publish_checkpoint(*store, src, "ckpt-00000002", 2, 2);
    publish_checkpoint(*store, src, "ckpt-00000001", 1, 1);
    store->put_file("ckpt-00000003/model.safetensors", src + "/model.safetensors");  // no manifest yet
    EXPECT_EQ(published_checkpoints(*store, "ckpt-"),
              (std::vector<std::string>{"ckpt-00000001", "ckpt-00000002"}));
    EXPECT_TRUE(published_checkpoints(*store, "policy-v").empty());
    prune_checkpoints(*store, "ckpt-", 1);
    EXPECT_EQ(published_checkpoints(*store, "ckpt-"), (std::vector<std::string>{"ckpt-00000002"}));
    EXPECT_TRUE(store->list("ckpt-00000001/").empty());
    // Nothing of the pruned checkpoint stays behind, not even its directory.
    EXPECT_FALSE(fs::exists(t.path / "store" / "ckpt-00000001"));
    EXPECT_TRUE(fs::exists(t.path / "store" / "ckpt-00000002"));
}

TEST(StorePolicyRegistry, PublishesThroughTheStoreAndKeepsTheNewest) {
    TempDir t;
    auto store = make_checkpoint_store("file://" + (t.path / "store").string());
    StorePolicyRegistry reg(make_registry("embedded", "store-registry-" + std::to_string(::getpid())), *store,
                            2);
    EXPECT_FALSE(reg.latest());
    for (int v = 0; v < 4; ++v) reg.publish(v, "file://" + policy_dir(t.path / "policy", v));
    auto latest = reg.latest();
    ASSERT_TRUE(latest);
    EXPECT_EQ(latest->first, 3);
    EXPECT_EQ(latest->second, "store:" + policy_checkpoint_name(3));
    EXPECT_EQ(policy_checkpoint_name(3), "policy-v00000003");
    EXPECT_EQ(published_checkpoints(*store, "policy-v"),
              (std::vector<std::string>{"policy-v00000002", "policy-v00000003"}));
    // What a rollout worker fetches is what the trainer wrote.
    const fs::path got = t.path / "fetched";
    fetch_checkpoint(*store, policy_checkpoint_name(3), got.string());
    std::ifstream in(got / "model.safetensors");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "weights of v3");
    EXPECT_THROW(reg.publish(3, "file://" + policy_dir(t.path / "policy", 3)), moerl::Error);
    EXPECT_THROW(StorePolicyRegistry(make_registry("embedded", "store-registry-keep"), *store, 1),
                 moerl::Error);
}

TEST(RunStore, RunDoneMarker) {
    TempDir t;
    auto store = make_checkpoint_store("file://" + (t.path / "store").string());
    EXPECT_FALSE(run_done(*store));
    write_run_done(*store, R"({"next_step": 5})", (t.path / "tmp").string());
    EXPECT_TRUE(run_done(*store));
    EXPECT_TRUE(fs::is_empty(t.path / "tmp"));
}
