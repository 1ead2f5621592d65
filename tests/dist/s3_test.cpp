// The S3 checkpoint store against s3rver (MOERL_TEST_S3_ENDPOINT and AWS_ACCESS_KEY_ID /
// AWS_SECRET_ACCESS_KEY, set by scripts/test-servers.sh; skipped when unset). Tests that stop the server
// start an s3rver of their own from node_modules/.bin/s3rver.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "dist_util.hpp"
#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"
#ifdef MOERL_HAVE_S3
#include "s3_store.hpp"
#include "s3_text.hpp"
#endif

namespace moerl::control {
namespace {

using namespace std::chrono_literals;
using dist_test::read_file;
using dist_test::TempDir;
using dist_test::unique_name;
using dist_test::write_file;

#ifdef MOERL_HAVE_S3

std::string endpoint() { return dist_test::env_or("MOERL_TEST_S3_ENDPOINT"); }
std::string bucket() { return dist_test::env_or("MOERL_TEST_S3_BUCKET", "moerl-test"); }

#define REQUIRE_S3()                                                                                        \
    do {                                                                                                    \
        if (endpoint().empty())                                                                             \
            GTEST_SKIP() << "MOERL_TEST_S3_ENDPOINT is not set (see scripts/test-servers.sh)";              \
        if (dist_test::env_or("AWS_ACCESS_KEY_ID").empty()) GTEST_SKIP() << "AWS_ACCESS_KEY_ID is not set"; \
    } while (0)

s3::Options test_options(const std::string& at) {
    s3::Options o = s3::Options::from_env();
    o.endpoint = at;
    o.backoff = 50ms;
    o.max_attempts = 3;
    return o;
}

std::string run_uri() { return "s3://" + bucket() + "/" + unique_name("run"); }

TEST(S3Options, SettingsFromTheUriQuery) {
    s3::Options o;
    EXPECT_EQ(o.read_uri_settings("s3://b/p"), "s3://b/p");
    EXPECT_EQ(o.read_uri_settings("s3://b/p?part_mb=16&attempts=2&backoff_ms=10&multipart_mb=32"),
              "s3://b/p");
    EXPECT_EQ(o.part_size, 16ull << 20);
    EXPECT_EQ(o.multipart_threshold, 32ull << 20);
    EXPECT_EQ(o.max_attempts, 2);
    EXPECT_EQ(o.backoff, 10ms);
    for (const char* bad :
         {"s3://b/p?parts=3", "s3://b/p?part_mb=0", "s3://b/p?attempts=two", "s3://b/p?backoff_ms"}) {
        try {
            s3::Options().read_uri_settings(bad);
            ADD_FAILURE() << bad << " must be refused";
        } catch (const moerl::Error& e) {
            EXPECT_NE(e.message().find(bad), std::string::npos) << e.message();
        }
    }
}

TEST(S3Store, RoundTripListAndRemove) {
    REQUIRE_S3();
    TempDir dir("s3");
    auto store = s3::make_store(run_uri(), test_options(endpoint()));
    const std::string data = dist_test::random_bytes(100000, 1);
    write_file(dir / "a.bin", data);
    write_file(dir / "empty", "");
    store->put_file("ckpt-1/model.safetensors", dir / "a.bin");
    store->put_file("ckpt-1/sub dir/odd+name=1&x.json", dir / "a.bin");
    store->put_file("ckpt-2/empty", dir / "empty");
    EXPECT_TRUE(store->exists("ckpt-1/model.safetensors"));
    EXPECT_FALSE(store->exists("ckpt-1/missing"));

    std::vector<std::string> expected{"ckpt-1/model.safetensors", "ckpt-1/sub dir/odd+name=1&x.json"};
    EXPECT_EQ(store->list("ckpt-1/"), expected);
    EXPECT_EQ(store->list("").size(), 3u);

    store->get_file("ckpt-1/sub dir/odd+name=1&x.json", dir / "out/deep/b.bin");
    EXPECT_EQ(read_file(dir / "out/deep/b.bin"), data);
    store->get_file("ckpt-2/empty", dir / "empty.out");
    EXPECT_EQ(read_file(dir / "empty.out"), "");

    store->remove("ckpt-1/model.safetensors");
    store->remove("ckpt-1/model.safetensors");  // removing what is gone is fine
    EXPECT_FALSE(store->exists("ckpt-1/model.safetensors"));
    try {
        store->get_file("ckpt-1/model.safetensors", dir / "gone");
        ADD_FAILURE() << "get_file of a removed key must fail";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("ckpt-1/model.safetensors"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("404"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("NoSuchKey"), std::string::npos) << e.message();
    }
    EXPECT_FALSE(std::filesystem::exists(dir / "gone"));
    for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
        EXPECT_EQ(entry.path().filename().string().find(".part-"), std::string::npos)
            << "temp file left behind";
}

TEST(S3Store, MultipartRoundTrip) {
    REQUIRE_S3();
    TempDir dir("s3");
    auto options = test_options(endpoint());
    options.multipart_threshold = 1 << 20;  // parts are 5 MiB (S3's minimum): 5 + 5 + 2 MiB + 123 bytes
    auto store = s3::make_store(run_uri(), options);
    const std::string data = dist_test::random_bytes((12 << 20) + 123, 2);
    write_file(dir / "big", data);
    store->put_file("big/weights.safetensors", dir / "big");
    store->get_file("big/weights.safetensors", dir / "big.out");
    EXPECT_EQ(sha256_file(dir / "big.out"), sha256_file(dir / "big"));
    EXPECT_EQ(std::filesystem::file_size(dir / "big.out"), data.size());
}

TEST(S3Store, ListFollowsContinuationTokens) {
    REQUIRE_S3();
    TempDir dir("s3");
    auto options = test_options(endpoint());
    options.list_page_size = 2;
    auto store = s3::make_store(run_uri(), options);
    write_file(dir / "f", "x");
    std::vector<std::string> expected;
    for (int i = 0; i < 7; ++i) {
        expected.push_back("many/" + std::to_string(i));
        store->put_file(expected.back(), dir / "f");
    }
    EXPECT_EQ(store->list("many/"), expected);
}

TEST(S3Store, CorruptedObjectIsDetectedByItsChecksum) {
    REQUIRE_S3();
    TempDir dir("s3");
    auto options = test_options(endpoint());
    options.multipart_threshold = 1 << 20;
    auto store = s3::make_store(run_uri(), options);
    std::filesystem::create_directories(dir.path() / "ckpt/shards");
    write_file(dir / "ckpt/config.json", R"({"hidden_size": 64})");
    write_file(dir / "ckpt/shards/model-00001.safetensors", dist_test::random_bytes((6 << 20) + 5, 3));
    Manifest published = publish_checkpoint(*store, (dir.path() / "ckpt").string(), "v1", 1, 10);
    EXPECT_TRUE(store->exists("v1/manifest.json"));

    Manifest fetched = fetch_checkpoint(*store, "v1", dir / "fetched", dir / "cache");
    EXPECT_EQ(fetched.version, 1);
    EXPECT_EQ(fetched.files, published.files);
    EXPECT_EQ(read_file(dir / "fetched/shards/model-00001.safetensors"),
              read_file(dir / "ckpt/shards/model-00001.safetensors"));

    // The same size, one byte changed: only the checksum can tell.
    std::string bad = read_file(dir / "ckpt/config.json");
    bad[3] = static_cast<char>(bad[3] ^ 1);
    write_file(dir / "bad.json", bad);
    store->put_file("v1/config.json", dir / "bad.json");
    try {
        fetch_checkpoint(*store, "v1", dir / "fetched-again");
        ADD_FAILURE() << "a corrupted object must be detected";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("config.json"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("sha256"), std::string::npos) << e.message();
    }
}

std::string s3rver_path() {
    auto path =
        dist_test::env_or("MOERL_TEST_S3RVER", std::string(MOERL_SOURCE_DIR) + "/node_modules/.bin/s3rver");
    return std::filesystem::exists(path) ? path : "";
}

// An s3rver of the test's own on a free port, with its data in `dir` (kept across restarts).
struct OwnS3rver {
    explicit OwnS3rver(const TempDir& dir) : dir_(dir), port(dist_test::free_port()) {}
    void start() {
        // s3rver's list continuation tokens use DES: only in OpenSSL's legacy provider on Node >= 17.
        server.start({"/usr/bin/env", "NODE_OPTIONS=--openssl-legacy-provider", s3rver_path(), "--directory",
                      dir_ / "data", "--address", "127.0.0.1", "--port", std::to_string(port), "--silent",
                      "--configure-bucket", "own"},
                     port, dir_ / "s3rver.log");
    }
    std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port); }
    const TempDir& dir_;
    int port;
    dist_test::ServerProcess server;
};

TEST(S3Store, ServerGoingAwayGivesAClearErrorAfterRetries) {
    REQUIRE_S3();
    if (s3rver_path().empty()) GTEST_SKIP() << "node_modules/.bin/s3rver not found (npm install)";
    TempDir dir("s3own");
    OwnS3rver s3(dir);
    s3.start();
    auto options = test_options(s3.endpoint());
    options.max_attempts = 3;
    options.connect_timeout = 1000ms;
    auto store = s3::make_store("s3://own/run", options);
    write_file(dir / "small", "hello");
    store->put_file("a/small", dir / "small");
    s3.server.stop();
    auto start = std::chrono::steady_clock::now();
    try {
        store->put_file("a/after-crash", dir / "small");
        ADD_FAILURE() << "put_file must fail while the server is away";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("s3://own/run/a/after-crash"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("after 3 attempts"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find(s3.endpoint()), std::string::npos) << e.message();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
    EXPECT_THROW(store->exists("a/small"), moerl::Error);
}

TEST(S3Store, UploadSurvivesAServerRestartMidUpload) {
    REQUIRE_S3();
    if (s3rver_path().empty()) GTEST_SKIP() << "node_modules/.bin/s3rver not found (npm install)";
    TempDir dir("s3own");
    OwnS3rver s3(dir);
    s3.start();
    auto options = test_options(s3.endpoint());
    options.multipart_threshold = 1 << 20;
    options.max_attempts = 10;  // 50 ms doubling: about 25 s of retries in all
    options.connect_timeout = 1000ms;
    auto store = s3::make_store("s3://own/run", options);
    const std::string data = dist_test::random_bytes(40 << 20, 4);  // 8 parts
    write_file(dir / "big", data);

    std::exception_ptr error;
    std::atomic<bool> finished{false};
    std::thread upload([&] {
        try {
            store->put_file("ckpt/big", dir / "big");
        } catch (...) {
            error = std::current_exception();
        }
        finished = true;
    });
    // Stop the server once its first part has landed (s3rver writes uploads/ID/N.md5 after part N),
    // not after a fixed sleep: how long 40 MiB takes depends on the machine.
    auto a_part_is_up = [&] {
        std::error_code ec;
        for (auto it = std::filesystem::recursive_directory_iterator(dir / "data", ec);
             !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec))
            if (it->path().extension() == ".md5" &&
                it->path().string().find("._S3rver_uploads/") != std::string::npos)
                return true;
        return false;
    };
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!a_part_is_up() && !finished.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(1ms);
    s3.server.stop();
    EXPECT_FALSE(finished.load())
        << "the upload ended before the server was stopped: the test proves nothing";
    std::this_thread::sleep_for(1500ms);
    s3.start();
    upload.join();
    if (error) std::rethrow_exception(error);
    store->get_file("ckpt/big", dir / "big.out");
    EXPECT_EQ(sha256_file(dir / "big.out"), sha256_file(dir / "big"));
}

TEST(S3Store, ObjectsAreReadableByTheAwsCli) {
    REQUIRE_S3();
    if (std::system("command -v aws >/dev/null 2>&1 && aws --version >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "the aws command is not installed (apt-get install awscli)";
    TempDir dir("s3aws");
    auto options = test_options(endpoint());
    options.multipart_threshold = 1 << 20;
    const std::string prefix = unique_name("aws");
    auto store = s3::make_store("s3://" + bucket() + "/" + prefix, options);
    write_file(dir / "big", dist_test::random_bytes((11 << 20) + 7, 5));
    write_file(dir / "small", "small object");
    store->put_file("m/big", dir / "big");
    store->put_file("m/small", dir / "small");
    const std::string aws = "timeout 120 aws --endpoint-url " + endpoint() + " --region us-east-1 s3 ";
    for (const char* name : {"big", "small"}) {
        std::string cmd = aws + "cp s3://" + bucket() + "/" + prefix + "/m/" + name + " " + (dir / "cli-") +
                          name + " >" + (dir / "aws.log") + " 2>&1";
        ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << read_file(dir / "aws.log");
        EXPECT_EQ(read_file(dir / (std::string("cli-") + name)), read_file(dir / name)) << name;
    }
    // And the other way: what the CLI uploads (multipart above its own 8 MiB threshold) reads back here.
    write_file(dir / "cli-up", dist_test::random_bytes((9 << 20) + 1, 6));
    std::string cmd = aws + "cp " + (dir / "cli-up") + " s3://" + bucket() + "/" + prefix + "/from-cli >" +
                      (dir / "aws.log") + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << read_file(dir / "aws.log");
    store->get_file("from-cli", dir / "from-cli.out");
    EXPECT_EQ(read_file(dir / "from-cli.out"), read_file(dir / "cli-up"));
    std::vector<std::string> expected{"from-cli", "m/big", "m/small"};
    EXPECT_EQ(store->list(""), expected);
}

// Every kind of request the store sends, with awkward keys, verified by botocore's SigV4 (s3rver
// accepts any signature, so it cannot catch a wrongly signed request).
TEST(S3Store, RequestsCarryValidSigV4Signatures) {
    if (std::system("python3 -c 'import botocore' >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "python3 with botocore (awscli) is not installed";
    TempDir dir("s3sig");
    const int port = dist_test::free_port();
    dist_test::ServerProcess checker;
    checker.start({"python3", std::string(MOERL_SOURCE_DIR) + "/tests/dist/sigv4_check.py",
                   std::to_string(port), "AKIDTEST", "secret/with+chars", "eu-west-1"},
                  port, dir / "checker.log");
    s3::Options o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(port);
    o.region = "eu-west-1";
    o.access_key_id = "AKIDTEST";
    o.secret_access_key = "secret/with+chars";
    o.max_attempts = 1;
    o.multipart_threshold = 1 << 20;
    auto store = s3::make_store("s3://bucket/pre fix", o);
    write_file(dir / "small", "hello");
    write_file(dir / "big", std::string((5 << 20) + 1, 'x'));
    EXPECT_NO_THROW(store->put_file("a b/c+d=e&f~g(1).txt", dir / "small"));
    EXPECT_NO_THROW(store->put_file("big", dir / "big"));  // CreateMultipartUpload, UploadPart, Complete
    EXPECT_NO_THROW(store->list("x/y z&"));
    EXPECT_NO_THROW(store->exists("k"));
    EXPECT_NO_THROW(store->remove("k"));
    EXPECT_NO_THROW(store->get_file("k", dir / "out"));
}

TEST(S3Text, CanonicalQueryAndEncoding) {
    EXPECT_EQ(s3::uri_encode("a b/c+d~e", true), "a%20b/c%2Bd~e");
    EXPECT_EQ(s3::uri_encode("a/b", false), "a%2Fb");
    EXPECT_EQ(s3::canonical_query({{"uploadId", "x y"}, {"partNumber", "2"}, {"uploads", ""}}),
              "partNumber=2&uploadId=x%20y&uploads=");
    EXPECT_EQ(s3::xml_text("<R><Key>a&amp;b&#x41;&#66;</Key></R>", "Key"), "a&bAB");
    EXPECT_EQ(s3::sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(S3Store, ConfigurationErrorsAreClear) {
    s3::Options o;
    o.endpoint = "http://127.0.0.1:1";
    try {
        s3::make_store("s3://b/p", o);
        ADD_FAILURE() << "missing credentials must fail";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("AWS_ACCESS_KEY_ID"), std::string::npos) << e.message();
    }
    o.access_key_id = o.secret_access_key = "k";
    EXPECT_THROW(s3::make_store("s3:///p", o), moerl::Error);
    o.endpoint = "127.0.0.1:1";
    EXPECT_THROW(s3::make_store("s3://b/p", o), moerl::Error);
}

#else
TEST(S3Store, NotBuilt) { GTEST_SKIP() << "built without libcurl"; }
#endif

}  // namespace
}  // namespace moerl::control
