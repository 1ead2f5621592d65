// Internal: AWS credentials as a pod on EKS (or any AWS host) gets them, for the S3 store. The chain
// takes the first source whose settings are present, in the order the AWS SDKs use:
//   1. environment keys      AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY [, AWS_SESSION_TOKEN]
//   2. web identity (IRSA)   AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN [+ AWS_ROLE_SESSION_NAME]:
//                            STS AssumeRoleWithWebIdentity (an unsigned form POST) at the regional
//                            endpoint, or AWS_ENDPOINT_URL_STS / AWS_ENDPOINT_URL
//   3. container endpoint    AWS_CONTAINER_CREDENTIALS_FULL_URI (EKS Pod Identity) or _RELATIVE_URI
//                            (ECS, under http://169.254.170.2), with AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE
//                            or AWS_CONTAINER_AUTHORIZATION_TOKEN as the Authorization header
//   4. instance metadata     IMDSv2 (session token, role name, role credentials) at
//                            AWS_EC2_METADATA_SERVICE_ENDPOINT (default http://169.254.169.254), unless
//                            AWS_EC2_METADATA_DISABLED=true
// A source whose settings are present but that fails is an error: the chain does not fall through
// to the next one (that would hide a broken IRSA setup behind a node's broader role).
// Temporary credentials are refreshed `refresh_before` ahead of their expiry. No error message
// holds a secret key, a session token or a web identity token.
#pragma once

#include <chrono>
#include <mutex>
#include <optional>
#include <string>

namespace moerl::control::aws {

using WallClock = std::chrono::system_clock;

struct Credentials {
    std::string access_key_id;
    std::string secret_access_key;
    std::string session_token;                        // empty for long-term keys
    std::optional<WallClock::time_point> expiration;  // none: they do not expire
    std::string source;                               // e.g. "web identity (STS)", for messages
};

// Where the chain looks; from_env() reads the variables above.
struct ChainSettings {
    std::string access_key_id, secret_access_key, session_token;
    std::string web_identity_token_file, role_arn;
    std::string role_session_name;  // default moerl-<unix time>
    std::string sts_endpoint;       // default https://sts.REGION.amazonaws.com
    std::string container_full_uri, container_relative_uri;
    std::string container_token, container_token_file;
    bool imds_disabled = false;
    std::string imds_endpoint = "http://169.254.169.254";
    // Per request: connecting and the whole transfer. The instance metadata service answers on the
    // host itself: a short connect timeout keeps a host without one from waiting long.
    std::chrono::milliseconds connect_timeout{2000}, request_timeout{10000};
    std::chrono::milliseconds imds_connect_timeout{1000};
    // Temporary credentials are replaced this long before they expire (the SDKs' default: 5 min).
    std::chrono::seconds refresh_before{300};

    static ChainSettings from_env(const std::string& region);
};

class CredentialChain {
  public:
    explicit CredentialChain(ChainSettings settings);

    // Valid credentials, fetched on first use and again once they are within refresh_before of
    // expiry; one fetch at a time, shared by all threads. When a refresh fails while the held
    // credentials have not expired yet, those are returned and the refresh is tried again after
    // a few seconds. Throws moerl::Error naming the source and what was wrong.
    Credentials get();
    // Forgets the held credentials (e.g. after S3 answered ExpiredToken): the next get() fetches.
    void invalidate();
    // The source the settings select, e.g. "web identity (STS)".
    std::string source() const;

  private:
    Credentials fetch() const;

    const ChainSettings settings_;
    std::mutex mutex_;
    std::optional<Credentials> held_;      // GUARDED_BY(mutex_)
    WallClock::time_point retry_after_{};  // GUARDED_BY(mutex_)
};

// "AKIA…WXYZ": enough of an access key id to tell keys apart in a message.
std::string mask(const std::string& key);
// Seconds since the epoch of an ISO 8601 UTC time such as 2026-12-02T01:00:00Z (fractions allowed).
std::optional<WallClock::time_point> parse_iso8601(const std::string& text);
// The URL the container source asks (the relative URI under http://169.254.170.2, or the full
// URI); throws when a full http:// URI names a host other than loopback or the ECS/EKS agents.
std::string container_url(const ChainSettings& settings);

}  // namespace moerl::control::aws
