// Internal: the S3 checkpoint store's settings, for callers (tests, tools) that set them directly.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "aws_credentials.hpp"
#include "moerl/control/control.hpp"

namespace moerl::control::s3 {

struct Options {
    // Endpoint such as http://127.0.0.1:9000 (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL; default
    // https://s3.REGION.amazonaws.com). Objects are addressed path-style: ENDPOINT/bucket/key.
    std::string endpoint;
    std::string region = "us-east-1";  // AWS_REGION, else AWS_DEFAULT_REGION
    // Fixed keys (tests, tools); when empty, `credentials` supplies them.
    std::string access_key_id;
    std::string secret_access_key;
    std::string session_token;
    // The credential chain (aws_credentials.hpp): environment keys, IRSA web identity, container
    // endpoint (EKS Pod Identity), IMDSv2; from_env() sets it.
    std::shared_ptr<aws::CredentialChain> credentials;
    // Files larger than this go up as a multipart upload (the URI's multipart_mb, default 8, >= 1).
    uint64_t multipart_threshold = 8ull << 20;
    // Part size of a multipart upload; at least 5 MiB as S3 requires, and large enough for at most
    // 10000 parts (part_mb, default 8).
    uint64_t part_size = 8ull << 20;
    // Tries per request before the error is raised; retried on 5xx, 429 and connection errors
    // (attempts, default 6, >= 1; raise it for a flaky endpoint).
    int max_attempts = 6;
    // First backoff between tries, doubled each time up to 10 s (backoff_ms, default 250).
    std::chrono::milliseconds backoff{250};
    std::chrono::milliseconds connect_timeout{5000};
    // A transfer slower than 1 byte/s for this long counts as a connection error.
    std::chrono::milliseconds stall_timeout{30000};
    int list_page_size = 1000;  // max-keys of ListObjectsV2 (1..1000)

    // Endpoint and region from the standard AWS environment variables, credentials from the chain.
    static Options from_env();
    // Applies the settings of an s3://bucket/prefix?name=value&... URI (multipart_mb, part_mb,
    // attempts, backoff_ms); returns the URI without its query. An unknown name is an error.
    std::string read_uri_settings(const std::string& uri);
    void validate() const;  // throws moerl::Error naming the bad field
};

std::unique_ptr<CheckpointStore> make_store(const std::string& uri, const Options& options);

}  // namespace moerl::control::s3
