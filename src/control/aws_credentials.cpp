// The AWS credential chain (aws_credentials.hpp) over libcurl, the S3 store's HTTP client.
#include "aws_credentials.hpp"

#include <curl/curl.h>
#include <unistd.h>

#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "s3_text.hpp"

namespace moerl::control::aws {

namespace {

struct Reply {
    long status = 0;
    std::string body;
};

size_t append_body(char* data, size_t size, size_t count, void* user) {
    static_cast<std::string*>(user)->append(data, size * count);
    return size * count;
}

// One HTTP request. `what` names the source in errors; neither headers nor body (they carry
// tokens) ever reach a message.
Reply http(const char* method, const std::string& url, const std::vector<std::string>& headers,
           const std::string& body, std::chrono::milliseconds connect_timeout,
           std::chrono::milliseconds timeout, const std::string& what) {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    struct Handle {
        CURL* curl = curl_easy_init();
        curl_slist* headers = nullptr;
        ~Handle() {
            curl_slist_free_all(headers);
            curl_easy_cleanup(curl);
        }
    } h;
    MOERL_CHECK(h.curl != nullptr, what, ": curl_easy_init failed");
    for (const auto& line : headers) {
        curl_slist* next = curl_slist_append(h.headers, line.c_str());
        MOERL_CHECK(next != nullptr, what, ": curl_slist_append failed");
        h.headers = next;
    }
    Reply reply;
    char error[CURL_ERROR_SIZE] = {0};
    CURLcode rc = CURLE_OK;
    auto set = [&rc](CURLcode c) {
        if (rc == CURLE_OK) rc = c;
    };
    set(curl_easy_setopt(h.curl, CURLOPT_URL, url.c_str()));
    set(curl_easy_setopt(h.curl, CURLOPT_HTTPHEADER, h.headers));
    set(curl_easy_setopt(h.curl, CURLOPT_ERRORBUFFER, error));
    set(curl_easy_setopt(h.curl, CURLOPT_NOSIGNAL, 1L));
    set(curl_easy_setopt(h.curl, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(connect_timeout.count())));
    set(curl_easy_setopt(h.curl, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout.count())));
    set(curl_easy_setopt(h.curl, CURLOPT_WRITEFUNCTION, append_body));
    set(curl_easy_setopt(h.curl, CURLOPT_WRITEDATA, &reply.body));
    set(curl_easy_setopt(h.curl, CURLOPT_PROTOCOLS_STR, "http,https"));
    const std::string m = method;
    if (m == "POST") {
        set(curl_easy_setopt(h.curl, CURLOPT_POSTFIELDS, body.c_str()));
        set(curl_easy_setopt(h.curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size())));
    } else if (m != "GET") {
        set(curl_easy_setopt(h.curl, CURLOPT_CUSTOMREQUEST, method));
    }
    if (rc == CURLE_OK) rc = curl_easy_perform(h.curl);
    MOERL_CHECK(rc == CURLE_OK, what, ": ", method, " ", url, " failed: ", curl_easy_strerror(rc),
                error[0] ? std::string(" (") + error + ")" : std::string(),
                "; expected the endpoint to answer");
    curl_easy_getinfo(h.curl, CURLINFO_RESPONSE_CODE, &reply.status);
    return reply;
}

std::string read_token_file(const std::string& path, const std::string& what, const char* variable) {
    std::ifstream in(path, std::ios::binary);
    MOERL_CHECK(in.good(), what, ": cannot read ", path, " (", variable, ")");
    std::ostringstream text;
    text << in.rdbuf();
    std::string token = text.str();
    while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' '))
        token.pop_back();
    MOERL_CHECK(!token.empty(), what, ": ", path, " (", variable, ") is empty; expected a token");
    return token;
}

void check_header_value(const std::string& value, const std::string& what, const char* variable) {
    MOERL_CHECK(value.find_first_of("\r\n") == std::string::npos, what, ": ", variable,
                " holds a line break; expected a single-line token");
}

// Credentials from a JSON document with AccessKeyId, SecretAccessKey, Token, Expiration (the
// container endpoint and IMDS both answer so).
Credentials from_json(const std::string& text, const std::string& what, const std::string& url) {
    auto j = nlohmann::json::parse(text, nullptr, false);
    MOERL_CHECK(j.is_object(), what, ": the reply of ", url, " is not a JSON object (", text.size(),
                " bytes); expected AccessKeyId, SecretAccessKey, Token, Expiration");
    auto field = [&](const char* name) -> std::string {
        auto it = j.find(name);
        return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    if (j.contains("Code") && field("Code") != "Success")
        MOERL_FAIL(what, ": ", url, " answered Code ", field("Code"), " ", field("Message"),
                   "; expected Success");
    Credentials c;
    c.access_key_id = field("AccessKeyId");
    c.secret_access_key = field("SecretAccessKey");
    c.session_token = field("Token");
    c.source = what;
    MOERL_CHECK(!c.access_key_id.empty() && !c.secret_access_key.empty(), what, ": the reply of ", url,
                " lacks AccessKeyId or SecretAccessKey; expected both");
    const std::string expiration = field("Expiration");
    if (!expiration.empty()) {
        c.expiration = parse_iso8601(expiration);
        MOERL_CHECK(c.expiration, what, ": Expiration '", expiration, "' from ", url,
                    " is not an ISO 8601 UTC time; expected e.g. 2026-12-02T01:00:00Z");
    }
    return c;
}

// The message of an error reply: Code and Message only, never the whole body.
std::string reply_error(const Reply& r, bool xml) {
    std::string code, message;
    if (xml) {
        code = s3::xml_text(r.body, "Code");
        message = s3::xml_text(r.body, "Message");
    } else {
        auto j = nlohmann::json::parse(r.body, nullptr, false);
        if (j.is_object()) {
            for (const char* k : {"code", "Code"})
                if (j.contains(k) && j[k].is_string()) code = j[k];
            for (const char* k : {"message", "Message"})
                if (j.contains(k) && j[k].is_string()) message = j[k];
        }
    }
    std::string out = "HTTP " + std::to_string(r.status);
    if (!code.empty()) out += " " + code;
    if (!message.empty()) out += " (" + message + ")";
    return out;
}

const char* kStsSource = "web identity (STS AssumeRoleWithWebIdentity)";
const char* kContainerSource = "container credentials endpoint";
const char* kImdsSource = "instance metadata (IMDSv2)";

Credentials from_sts(const ChainSettings& s) {
    const std::string what = kStsSource;
    const std::string token = read_token_file(s.web_identity_token_file, what, "AWS_WEB_IDENTITY_TOKEN_FILE");
    const std::string session =
        s.role_session_name.empty() ? "moerl-" + std::to_string(::time(nullptr)) : s.role_session_name;
    const std::string form = s3::canonical_query({{"Action", "AssumeRoleWithWebIdentity"},
                                                  {"Version", "2011-06-15"},
                                                  {"RoleArn", s.role_arn},
                                                  {"RoleSessionName", session},
                                                  {"WebIdentityToken", token}});
    std::string url = s.sts_endpoint;
    if (url.empty() || url.back() != '/') url += "/";
    Reply r =
        http("POST", url, {"Content-Type: application/x-www-form-urlencoded", "Accept: application/xml"},
             form, s.connect_timeout, s.request_timeout, what);
    MOERL_CHECK(r.status == 200, what, ": ", url, " answered ", reply_error(r, true), " for role ",
                s.role_arn, "; expected HTTP 200");
    const std::string creds = s3::xml_text(r.body, "Credentials");
    Credentials c;
    c.access_key_id = s3::xml_text(creds, "AccessKeyId");
    c.secret_access_key = s3::xml_text(creds, "SecretAccessKey");
    c.session_token = s3::xml_text(creds, "SessionToken");
    c.source = what;
    MOERL_CHECK(!c.access_key_id.empty() && !c.secret_access_key.empty() && !c.session_token.empty(), what,
                ": the reply of ", url, " (", r.body.size(),
                " bytes) lacks Credentials with AccessKeyId, SecretAccessKey and SessionToken");
    const std::string expiration = s3::xml_text(creds, "Expiration");
    c.expiration = parse_iso8601(expiration);
    MOERL_CHECK(c.expiration, what, ": Expiration '", expiration, "' from ", url,
                " is not an ISO 8601 UTC time; expected e.g. 2026-12-02T01:00:00Z");
    return c;
}

Credentials from_container(const ChainSettings& s) {
    const std::string what = kContainerSource;
    const std::string url = container_url(s);
    std::vector<std::string> headers{"Accept: application/json"};
    std::string token = s.container_token;
    if (!s.container_token_file.empty())  // re-read each time: the agent rotates it
        token = read_token_file(s.container_token_file, what, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
    if (!token.empty()) {
        check_header_value(token, what, "the authorization token");
        headers.push_back("Authorization: " + token);
    }
    Reply r = http("GET", url, headers, "", s.connect_timeout, s.request_timeout, what);
    MOERL_CHECK(r.status == 200, what, ": ", url, " answered ", reply_error(r, false), "; expected HTTP 200");
    return from_json(r.body, what, url);
}

Credentials from_imds(const ChainSettings& s) {
    const std::string what = kImdsSource;
    std::string base = s.imds_endpoint;
    while (!base.empty() && base.back() == '/') base.pop_back();
    Reply t = http("PUT", base + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds: 21600"}, "",
                   s.imds_connect_timeout, s.request_timeout, what);
    MOERL_CHECK(t.status == 200 && !t.body.empty(), what, ": PUT ", base, "/latest/api/token answered HTTP ",
                t.status,
                "; expected a session token (on EKS, a pod needs the node's metadata hop limit >= 2)");
    check_header_value(t.body, what, "the metadata session token");
    const std::vector<std::string> auth{"X-aws-ec2-metadata-token: " + t.body};
    const std::string roles_url = base + "/latest/meta-data/iam/security-credentials/";
    Reply roles = http("GET", roles_url, auth, "", s.imds_connect_timeout, s.request_timeout, what);
    std::string role = roles.body.substr(0, roles.body.find_first_of("\r\n"));
    MOERL_CHECK(roles.status == 200 && !role.empty(), what, ": ", roles_url, " answered HTTP ", roles.status,
                "; expected the name of the instance's role (has the instance profile a role?)");
    MOERL_CHECK(role.find_first_of("/?#% ") == std::string::npos, what, ": role name '", role, "' from ",
                roles_url, " is not a role name");
    Reply c = http("GET", roles_url + role, auth, "", s.imds_connect_timeout, s.request_timeout, what);
    MOERL_CHECK(c.status == 200, what, ": ", roles_url, role, " answered HTTP ", c.status,
                "; expected HTTP 200");
    return from_json(c.body, what, roles_url + role);
}

bool is_true(const std::string& v) { return v == "true" || v == "TRUE" || v == "True" || v == "1"; }

}  // namespace

std::string mask(const std::string& key) {
    if (key.size() <= 8) return std::string(key.size(), '*');
    return key.substr(0, 4) + "…" + key.substr(key.size() - 4);
}

std::optional<WallClock::time_point> parse_iso8601(const std::string& text) {
    std::tm tm{};
    int consumed = 0;
    if (std::sscanf(text.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d%n", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                    &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &consumed) != 6)
        return std::nullopt;
    std::string rest = text.substr(static_cast<size_t>(consumed));
    if (!rest.empty() && rest[0] == '.') {  // fractions of a second: dropped
        size_t i = 1;
        while (i < rest.size() && rest[i] >= '0' && rest[i] <= '9') ++i;
        if (i == 1) return std::nullopt;
        rest = rest.substr(i);
    }
    if (rest != "Z" && rest != "+00:00") return std::nullopt;
    if (tm.tm_mon < 1 || tm.tm_mon > 12 || tm.tm_mday < 1 || tm.tm_mday > 31 || tm.tm_hour > 23 ||
        tm.tm_min > 59 || tm.tm_sec > 60)
        return std::nullopt;
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    return WallClock::from_time_t(::timegm(&tm));
}

std::string container_url(const ChainSettings& s) {
    if (!s.container_relative_uri.empty()) {
        MOERL_CHECK(s.container_relative_uri.front() == '/', "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI '",
                    s.container_relative_uri, "': expected a path starting with /");
        return "http://169.254.170.2" + s.container_relative_uri;
    }
    const std::string& url = s.container_full_uri;
    if (url.rfind("https://", 0) == 0) return url;
    MOERL_CHECK(url.rfind("http://", 0) == 0, "AWS_CONTAINER_CREDENTIALS_FULL_URI '", url,
                "': expected an http:// or https:// URL");
    std::string host =
        url.substr(7, url.find('/', 7) == std::string::npos ? std::string::npos : url.find('/', 7) - 7);
    if (host.front() == '[') {
        host = host.substr(1, host.find(']') - 1);
    } else if (host.find(':') != std::string::npos) {
        host = host.substr(0, host.find(':'));
    }
    const bool allowed = host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1" ||
                         host == "169.254.170.2" || host == "169.254.170.23" || host == "fd00:ec2::23";
    MOERL_CHECK(
        allowed, "AWS_CONTAINER_CREDENTIALS_FULL_URI '", url, "': plain http only to loopback, ",
        "169.254.170.2 (ECS) or 169.254.170.23 / fd00:ec2::23 (EKS Pod Identity); expected https otherwise");
    return url;
}

ChainSettings ChainSettings::from_env(const std::string& region) {
    ChainSettings s;
    s.access_key_id = env::get_string("AWS_ACCESS_KEY_ID", "");
    s.secret_access_key = env::get_string("AWS_SECRET_ACCESS_KEY", "");
    s.session_token = env::get_string("AWS_SESSION_TOKEN", "");
    s.web_identity_token_file = env::get_string("AWS_WEB_IDENTITY_TOKEN_FILE", "");
    s.role_arn = env::get_string("AWS_ROLE_ARN", "");
    s.role_session_name = env::get_string("AWS_ROLE_SESSION_NAME", "");
    s.sts_endpoint =
        env::get_string("AWS_ENDPOINT_URL_STS",
                        env::get_string("AWS_ENDPOINT_URL", "https://sts." + region + ".amazonaws.com"));
    s.container_full_uri = env::get_string("AWS_CONTAINER_CREDENTIALS_FULL_URI", "");
    s.container_relative_uri = env::get_string("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "");
    s.container_token = env::get_string("AWS_CONTAINER_AUTHORIZATION_TOKEN", "");
    s.container_token_file = env::get_string("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "");
    s.imds_disabled = is_true(env::get_string("AWS_EC2_METADATA_DISABLED", ""));
    s.imds_endpoint = env::get_string("AWS_EC2_METADATA_SERVICE_ENDPOINT", s.imds_endpoint);
    return s;
}

CredentialChain::CredentialChain(ChainSettings settings) : settings_(std::move(settings)) {
    const auto& s = settings_;
    MOERL_CHECK(
        s.access_key_id.empty() == s.secret_access_key.empty(),
        "AWS credentials: only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY is set; expected both");
    MOERL_CHECK(
        s.web_identity_token_file.empty() == s.role_arn.empty() || !s.access_key_id.empty(),
        "AWS credentials: only one of AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN is set; expected both");
}

std::string CredentialChain::source() const {
    const auto& s = settings_;
    if (!s.access_key_id.empty()) return "environment (AWS_ACCESS_KEY_ID)";
    if (!s.web_identity_token_file.empty()) return kStsSource;
    if (!s.container_full_uri.empty() || !s.container_relative_uri.empty()) return kContainerSource;
    if (!s.imds_disabled) return kImdsSource;
    return "";
}

Credentials CredentialChain::fetch() const {
    const auto& s = settings_;
    if (!s.access_key_id.empty())
        return {s.access_key_id, s.secret_access_key, s.session_token, std::nullopt, source()};
    if (!s.web_identity_token_file.empty()) return from_sts(s);
    if (!s.container_full_uri.empty() || !s.container_relative_uri.empty()) return from_container(s);
    MOERL_CHECK(
        !s.imds_disabled,
        "no AWS credentials: AWS_ACCESS_KEY_ID, AWS_WEB_IDENTITY_TOKEN_FILE, "
        "AWS_CONTAINER_CREDENTIALS_FULL_URI and _RELATIVE_URI are unset and AWS_EC2_METADATA_DISABLED "
        "is true; expected one of them (on EKS: IRSA or Pod Identity on the pod's ServiceAccount)");
    try {
        return from_imds(s);
    } catch (const Error& e) {
        MOERL_FAIL(
            "no AWS credentials: AWS_ACCESS_KEY_ID, AWS_WEB_IDENTITY_TOKEN_FILE and "
            "AWS_CONTAINER_CREDENTIALS_FULL_URI / _RELATIVE_URI are unset, and ",
            e.message());
    }
}

Credentials CredentialChain::get() {
    std::lock_guard lock(mutex_);
    const auto now = WallClock::now();
    if (held_ && (!held_->expiration || now < *held_->expiration - settings_.refresh_before)) return *held_;
    // Within the refresh window: a failed refresh is retried after a pause while the held ones last.
    if (held_ && now < retry_after_) return *held_;
    try {
        Credentials fresh = fetch();
        held_ = fresh;
        return fresh;
    } catch (const Error&) {
        if (held_ && held_->expiration && now < *held_->expiration) {
            retry_after_ = now + std::chrono::seconds(5);
            return *held_;
        }
        throw;
    }
}

void CredentialChain::invalidate() {
    std::lock_guard lock(mutex_);
    held_.reset();
}

}  // namespace moerl::control::aws
