// The AWS credential chain against local stand-ins (tests/dist/aws_standin.py) for STS, the container
// credentials endpoint and IMDSv2: the requests each source sends, the chain's order, refresh before
// expiry, clear errors without secrets, and the S3 store signing with the temporary credentials.
#include <gtest/gtest.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "dist_util.hpp"
#include "moerl/core/error.hpp"
#ifdef MOERL_HAVE_S3
#include "aws_credentials.hpp"
#include "s3_store.hpp"
#endif

namespace moerl::control {
namespace {

#ifdef MOERL_HAVE_S3
using namespace std::chrono_literals;
using dist_test::TempDir;
using dist_test::write_file;

const char* kRoleArn = "arn:aws:iam::123456789012:role/moerl-rollout";
const char* kWebToken = "eyJhbGciOiJSUzI1NiJ9.web-identity-token.sig";

// One stand-in server; requests() are the ones it received, in order.
class Standin {
  public:
    explicit Standin(const TempDir& dir, const std::vector<std::string>& flags = {})
        : port_(dist_test::free_port()), log_(dir / ("standin-" + std::to_string(port_) + ".jsonl")) {
        std::vector<std::string> argv{"python3", std::string(MOERL_SOURCE_DIR) + "/tests/dist/aws_standin.py",
                                      std::to_string(port_), log_};
        argv.insert(argv.end(), flags.begin(), flags.end());
        server_.start(argv, port_, log_ + ".out");
    }
    std::string url(const std::string& path = "") const {
        return "http://127.0.0.1:" + std::to_string(port_) + path;
    }
    std::vector<nlohmann::json> requests() const {
        std::vector<nlohmann::json> out;
        std::ifstream in(log_);
        std::string line;
        while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
        return out;
    }
    void stop() { server_.stop(); }

  private:
    int port_;
    std::string log_;
    dist_test::ServerProcess server_;
};

// Nothing configured, and no real instance metadata service asked.
aws::ChainSettings nothing() {
    aws::ChainSettings s;
    s.imds_disabled = true;
    s.connect_timeout = s.imds_connect_timeout = 1000ms;
    s.request_timeout = 3000ms;
    return s;
}

aws::ChainSettings web_identity(const TempDir& dir, const Standin& sts) {
    aws::ChainSettings s = nothing();
    write_file(dir / "token", std::string(kWebToken) + "\n");
    s.web_identity_token_file = dir / "token";
    s.role_arn = kRoleArn;
    s.role_session_name = "moerl-test";
    s.sts_endpoint = sts.url();
    return s;
}

// The message of the error `f` throws; fails the test when it throws none.
template <typename F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const moerl::Error& e) {
        return e.message();
    }
    ADD_FAILURE() << "no error";
    return "";
}

void expect_no_secret(const std::string& message) {
    for (const char* secret :
         {"standin-secret", "standin-token", "leaked-secret", kWebToken, "imds-session-token"})
        EXPECT_EQ(message.find(secret), std::string::npos) << "a secret in: " << message;
}

TEST(AwsCredentials, WebIdentityAssumesTheRoleWithTheTokenFile) {
    TempDir dir("creds");
    Standin sts(dir);
    aws::CredentialChain chain(web_identity(dir, sts));
    EXPECT_EQ(chain.source(), "web identity (STS AssumeRoleWithWebIdentity)");
    aws::Credentials c = chain.get();
    EXPECT_EQ(c.access_key_id, "ASIASTANDIN1");
    EXPECT_EQ(c.secret_access_key, "standin-secret-1");
    EXPECT_EQ(c.session_token, "standin-token-1");
    ASSERT_TRUE(c.expiration);
    EXPECT_GT(*c.expiration, aws::WallClock::now() + 3000s);
    auto reqs = sts.requests();
    ASSERT_EQ(reqs.size(), 1u);
    const auto& r = reqs[0];
    EXPECT_EQ(r["method"], "POST");
    EXPECT_EQ(r["path"], "/");
    EXPECT_EQ(r["headers"]["content-type"], "application/x-www-form-urlencoded");
    EXPECT_FALSE(r["headers"].contains("authorization")) << "AssumeRoleWithWebIdentity is not signed";
    EXPECT_EQ(r["form"]["Action"], "AssumeRoleWithWebIdentity");
    EXPECT_EQ(r["form"]["Version"], "2011-06-15");
    EXPECT_EQ(r["form"]["RoleArn"], kRoleArn);
    EXPECT_EQ(r["form"]["RoleSessionName"], "moerl-test");
    EXPECT_EQ(r["form"]["WebIdentityToken"], kWebToken) << "the file's token, without its line feed";
}

TEST(AwsCredentials, ContainerEndpointSendsTheAuthorizationToken) {
    TempDir dir("creds");
    Standin agent(dir);
    aws::ChainSettings s = nothing();
    s.container_full_uri = agent.url("/creds");
    write_file(dir / "pod-identity-token", "pod-identity-token-1\n");
    s.container_token_file = dir / "pod-identity-token";
    s.container_token = "ignored-when-the-file-is-set";
    aws::CredentialChain chain(s);
    aws::Credentials c = chain.get();
    EXPECT_EQ(c.access_key_id, "ASIASTANDIN1");
    EXPECT_EQ(c.session_token, "standin-token-1");
    ASSERT_TRUE(c.expiration);
    // The token file is read again on each fetch: the agent rotates it.
    write_file(dir / "pod-identity-token", "pod-identity-token-2");
    chain.invalidate();
    chain.get();
    auto reqs = agent.requests();
    ASSERT_EQ(reqs.size(), 2u);
    EXPECT_EQ(reqs[0]["method"], "GET");
    EXPECT_EQ(reqs[0]["path"], "/creds");
    EXPECT_EQ(reqs[0]["headers"]["authorization"], "pod-identity-token-1");
    EXPECT_EQ(reqs[1]["headers"]["authorization"], "pod-identity-token-2");

    s.container_token_file.clear();
    s.container_token = "literal-token";
    aws::CredentialChain literal(s);
    literal.get();
    EXPECT_EQ(agent.requests().back()["headers"]["authorization"], "literal-token");
}

TEST(AwsCredentials, ContainerUrlRules) {
    aws::ChainSettings s = nothing();
    s.container_relative_uri = "/v2/credentials/abc";
    EXPECT_EQ(aws::container_url(s), "http://169.254.170.2/v2/credentials/abc");
    s.container_relative_uri.clear();
    for (const char* ok :
         {"http://169.254.170.23/v1/credentials", "http://[fd00:ec2::23]/v1/credentials",
          "http://127.0.0.1:8080/creds", "http://localhost/creds", "https://creds.example.com/x"}) {
        s.container_full_uri = ok;
        EXPECT_EQ(aws::container_url(s), ok);
    }
    s.container_full_uri = "http://creds.example.com/x";
    EXPECT_NE(error_of([&] { aws::container_url(s); }).find("expected https"), std::string::npos);
}

TEST(AwsCredentials, InstanceMetadataV2TokenThenRoleThenCredentials) {
    TempDir dir("creds");
    Standin imds(dir);
    aws::ChainSettings s = nothing();
    s.imds_disabled = false;
    s.imds_endpoint = imds.url();
    aws::CredentialChain chain(s);
    EXPECT_EQ(chain.source(), "instance metadata (IMDSv2)");
    aws::Credentials c = chain.get();
    EXPECT_EQ(c.access_key_id, "ASIASTANDIN1");
    EXPECT_EQ(c.session_token, "standin-token-1");
    auto reqs = imds.requests();
    ASSERT_EQ(reqs.size(), 3u);
    EXPECT_EQ(reqs[0]["method"], "PUT");
    EXPECT_EQ(reqs[0]["path"], "/latest/api/token");
    EXPECT_EQ(reqs[0]["headers"]["x-aws-ec2-metadata-token-ttl-seconds"], "21600");
    EXPECT_EQ(reqs[1]["path"], "/latest/meta-data/iam/security-credentials/");
    EXPECT_EQ(reqs[2]["path"], "/latest/meta-data/iam/security-credentials/moerl-node-role");
    for (int i : {1, 2}) EXPECT_EQ(reqs[i]["headers"]["x-aws-ec2-metadata-token"], "imds-session-token-1");
}

TEST(AwsCredentials, ChainTakesTheFirstConfiguredSource) {
    TempDir dir("creds");
    Standin server(dir);
    aws::ChainSettings all = web_identity(dir, server);
    all.container_full_uri = server.url("/creds");
    all.imds_disabled = false;
    all.imds_endpoint = server.url();
    all.access_key_id = "AKIDENVIRONMENT";
    all.secret_access_key = "environment-secret";
    all.session_token = "environment-token";

    aws::Credentials c = aws::CredentialChain(all).get();
    EXPECT_EQ(c.access_key_id, "AKIDENVIRONMENT");
    EXPECT_EQ(c.session_token, "environment-token");
    EXPECT_FALSE(c.expiration);
    EXPECT_TRUE(server.requests().empty()) << "environment keys need no request";

    all.access_key_id = all.secret_access_key = all.session_token = "";
    aws::CredentialChain(all).get();
    EXPECT_EQ(server.requests().back()["method"], "POST") << "web identity before the container endpoint";
    const size_t n = server.requests().size();

    all.web_identity_token_file = all.role_arn = "";
    aws::CredentialChain(all).get();
    ASSERT_EQ(server.requests().size(), n + 1);
    EXPECT_EQ(server.requests().back()["path"], "/creds") << "the container endpoint before IMDS";

    all.container_full_uri = "";
    aws::CredentialChain(all).get();
    EXPECT_EQ(server.requests().back()["path"], "/latest/meta-data/iam/security-credentials/moerl-node-role");
}

TEST(AwsCredentials, RefreshesBeforeExpiryOnceForAllThreads) {
    TempDir dir("creds");
    // Valid 302 s, refreshed 300 s ahead: fresh for about 2 s.
    Standin sts(dir, {"--lifetime", "302"});
    aws::CredentialChain chain(web_identity(dir, sts));
    EXPECT_EQ(chain.get().access_key_id, "ASIASTANDIN1");
    EXPECT_EQ(chain.get().access_key_id, "ASIASTANDIN1");
    EXPECT_EQ(sts.requests().size(), 1u) << "fresh credentials are held, not fetched again";
    std::this_thread::sleep_for(3s);
    std::vector<std::thread> threads;
    std::atomic<int> second{0};
    for (int i = 0; i < 8; ++i)
        threads.emplace_back([&] {
            if (chain.get().access_key_id == "ASIASTANDIN2") ++second;
        });
    for (auto& t : threads) t.join();
    EXPECT_EQ(second.load(), 8);
    EXPECT_EQ(sts.requests().size(), 2u) << "eight threads, one refresh";

    // STS gone while the held credentials are still valid: they are used until they expire.
    sts.stop();
    std::this_thread::sleep_for(3s);
    EXPECT_EQ(chain.get().access_key_id, "ASIASTANDIN2");
    chain.invalidate();
    std::string e = error_of([&] { chain.get(); });
    EXPECT_NE(e.find("web identity"), std::string::npos) << e;
    EXPECT_NE(e.find("127.0.0.1"), std::string::npos) << "names the endpoint: " << e;
    expect_no_secret(e);
}

TEST(AwsCredentials, ClearErrorsWithoutSecrets) {
    TempDir dir("creds");
    {
        Standin malformed(dir, {"--mode", "malformed"});
        std::string e = error_of([&] { aws::CredentialChain(web_identity(dir, malformed)).get(); });
        EXPECT_NE(e.find("lacks Credentials"), std::string::npos) << e;
        expect_no_secret(e);
        aws::ChainSettings s = nothing();
        s.container_full_uri = malformed.url("/creds");
        s.container_token = "pod-token";
        e = error_of([&] { aws::CredentialChain(s).get(); });
        EXPECT_NE(e.find("not a JSON object"), std::string::npos) << e;
        expect_no_secret(e);
        EXPECT_EQ(e.find("pod-token"), std::string::npos) << e;
    }
    {
        Standin refusing(dir, {"--mode", "error"});
        std::string e = error_of([&] { aws::CredentialChain(web_identity(dir, refusing)).get(); });
        EXPECT_NE(e.find("HTTP 400 InvalidIdentityToken"), std::string::npos) << e;
        EXPECT_NE(e.find(kRoleArn), std::string::npos) << e;
        expect_no_secret(e);
        aws::ChainSettings s = nothing();
        s.container_full_uri = refusing.url("/creds");
        e = error_of([&] { aws::CredentialChain(s).get(); });
        EXPECT_NE(e.find("HTTP 403 AccessDenied"), std::string::npos) << e;
    }
    // Endpoint down: names the source and the address.
    aws::ChainSettings s = nothing();
    s.imds_disabled = false;
    s.imds_endpoint = "http://127.0.0.1:" + std::to_string(dist_test::free_port());
    std::string e = error_of([&] { aws::CredentialChain(s).get(); });
    EXPECT_NE(e.find("no AWS credentials"), std::string::npos) << e;
    EXPECT_NE(e.find("instance metadata"), std::string::npos) << e;
    EXPECT_NE(e.find(s.imds_endpoint), std::string::npos) << e;
    // Settings that cannot work.
    e = error_of([&] { aws::CredentialChain(nothing()).get(); });
    EXPECT_NE(e.find("AWS_EC2_METADATA_DISABLED"), std::string::npos) << e;
    aws::ChainSettings half = nothing();
    half.access_key_id = "AKID";
    e = error_of([&] { aws::CredentialChain{half}; });
    EXPECT_NE(e.find("AWS_SECRET_ACCESS_KEY"), std::string::npos) << e;
    half = nothing();
    half.web_identity_token_file = dir / "missing-token";
    e = error_of([&] { aws::CredentialChain{half}; });
    EXPECT_NE(e.find("AWS_ROLE_ARN"), std::string::npos) << e;
    half.role_arn = kRoleArn;
    e = error_of([&] { aws::CredentialChain(half).get(); });
    EXPECT_NE(e.find("missing-token"), std::string::npos) << e;
    EXPECT_EQ(aws::mask("ASIASTANDIN12345"), "ASIA…2345");
}

TEST(AwsCredentials, SettingsFromTheEnvironment) {
    const char* vars[] = {"AWS_ACCESS_KEY_ID",
                          "AWS_SECRET_ACCESS_KEY",
                          "AWS_SESSION_TOKEN",
                          "AWS_WEB_IDENTITY_TOKEN_FILE",
                          "AWS_ROLE_ARN",
                          "AWS_ROLE_SESSION_NAME",
                          "AWS_ENDPOINT_URL_STS",
                          "AWS_ENDPOINT_URL",
                          "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                          "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                          "AWS_EC2_METADATA_DISABLED",
                          "AWS_EC2_METADATA_SERVICE_ENDPOINT"};
    std::map<std::string, std::string> saved;
    for (const char* v : vars) {
        if (const char* x = std::getenv(v)) saved[v] = x;
        ::unsetenv(v);
    }
    aws::ChainSettings s = aws::ChainSettings::from_env("eu-west-1");
    EXPECT_EQ(s.sts_endpoint, "https://sts.eu-west-1.amazonaws.com");
    EXPECT_EQ(s.imds_endpoint, "http://169.254.169.254");
    EXPECT_FALSE(s.imds_disabled);
    ::setenv("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks.amazonaws.com/serviceaccount/token", 1);
    ::setenv("AWS_ROLE_ARN", kRoleArn, 1);
    ::setenv("AWS_ENDPOINT_URL_STS", "http://127.0.0.1:1", 1);
    ::setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://169.254.170.23/v1/credentials", 1);
    ::setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "/var/run/secrets/pods.eks.amazonaws.com/token", 1);
    ::setenv("AWS_EC2_METADATA_DISABLED", "true", 1);
    ::setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://[fd00:ec2::254]", 1);
    s = aws::ChainSettings::from_env("eu-west-1");
    EXPECT_EQ(s.web_identity_token_file, "/var/run/secrets/eks.amazonaws.com/serviceaccount/token");
    EXPECT_EQ(s.role_arn, kRoleArn);
    EXPECT_EQ(s.sts_endpoint, "http://127.0.0.1:1");
    EXPECT_EQ(s.container_full_uri, "http://169.254.170.23/v1/credentials");
    EXPECT_EQ(s.container_token_file, "/var/run/secrets/pods.eks.amazonaws.com/token");
    EXPECT_TRUE(s.imds_disabled);
    EXPECT_EQ(s.imds_endpoint, "http://[fd00:ec2::254]");
    for (const char* v : vars) ::unsetenv(v);
    for (const auto& [k, v] : saved) ::setenv(k.c_str(), v.c_str(), 1);
}

TEST(AwsCredentials, Iso8601Expiration) {
    auto t = aws::parse_iso8601("2026-12-02T01:00:00Z");
    ASSERT_TRUE(t);
    EXPECT_EQ(aws::WallClock::to_time_t(*t), 1796173200);
    EXPECT_EQ(aws::parse_iso8601("2026-12-02T01:00:00.123Z"), t);
    EXPECT_EQ(aws::parse_iso8601("2026-12-02T01:00:00+00:00"), t);
    for (const char* bad : {"", "2026-12-02", "2026-12-02T01:00:00", "2026-13-02T01:00:00Z", "tomorrow"})
        EXPECT_FALSE(aws::parse_iso8601(bad)) << bad;
}

// The S3 store with IRSA credentials: every request signed with them and carrying the session
// token as a signed x-amz-security-token header (checked by botocore); then a round trip on s3rver
// (which checks the access key id, not the signature).
TEST(AwsCredentials, S3StoreSignsWithTemporaryCredentials) {
    if (std::system("python3 -c 'import botocore' >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "python3 with botocore (awscli) is not installed";
    TempDir dir("creds");
    Standin sts(dir);
    const int port = dist_test::free_port();
    dist_test::ServerProcess checker;
    checker.start({"python3", std::string(MOERL_SOURCE_DIR) + "/tests/dist/sigv4_check.py",
                   std::to_string(port), "ASIASTANDIN1", "standin-secret-1", "us-east-1", "standin-token-1"},
                  port, dir / "checker.log");
    s3::Options o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(port);
    o.max_attempts = 1;
    o.credentials = std::make_shared<aws::CredentialChain>(web_identity(dir, sts));
    auto store = s3::make_store("s3://bucket/irsa", o);
    write_file(dir / "small", "hello");
    EXPECT_NO_THROW(store->put_file("a/b.txt", dir / "small"));
    EXPECT_NO_THROW(store->list("a/"));
    EXPECT_NO_THROW(store->exists("a/b.txt"));
    EXPECT_EQ(sts.requests().size(), 1u) << "one STS call for all requests";

    // The checker refuses a request whose token is not the one it expects.
    const int other_port = dist_test::free_port();
    dist_test::ServerProcess other;
    other.start(
        {"python3", std::string(MOERL_SOURCE_DIR) + "/tests/dist/sigv4_check.py", std::to_string(other_port),
         "ASIASTANDIN1", "standin-secret-1", "us-east-1", "another-token"},
        other_port, dir / "other.log");
    o.endpoint = "http://127.0.0.1:" + std::to_string(other_port);
    EXPECT_THROW(s3::make_store("s3://bucket/irsa", o)->put_file("a/b.txt", dir / "small"), moerl::Error);
}

TEST(AwsCredentials, S3RoundTripWithTemporaryCredentials) {
    const std::string endpoint = dist_test::env_or("MOERL_TEST_S3_ENDPOINT");
    if (endpoint.empty()) GTEST_SKIP() << "MOERL_TEST_S3_ENDPOINT is not set (see scripts/test-servers.sh)";
    TempDir dir("creds");
    // s3rver knows only the key id it was started with: STS hands that one out.
    Standin sts(dir, {"--key", dist_test::env_or("AWS_ACCESS_KEY_ID", "S3RVER"), "--secret",
                      dist_test::env_or("AWS_SECRET_ACCESS_KEY", "S3RVER")});
    s3::Options o;
    o.endpoint = endpoint;
    o.max_attempts = 2;
    o.credentials = std::make_shared<aws::CredentialChain>(web_identity(dir, sts));
    write_file(dir / "small", "hello");
    auto real = s3::make_store("s3://" + dist_test::env_or("MOERL_TEST_S3_BUCKET", "moerl-test") + "/" +
                                   dist_test::unique_name("irsa"),
                               o);
    real->put_file("ckpt/x.bin", dir / "small");
    real->get_file("ckpt/x.bin", dir / "back");
    EXPECT_EQ(dist_test::read_file(dir / "back"), "hello");
    EXPECT_EQ(real->list(""), std::vector<std::string>{"ckpt/x.bin"});
    EXPECT_EQ(sts.requests().size(), 1u);
}

#else
TEST(AwsCredentials, NotBuilt) { GTEST_SKIP() << "built without libcurl"; }
#endif

}  // namespace
}  // namespace moerl::control
