// CheckpointStore on S3 (or an S3-compatible server) through libcurl, signed with CURLOPT_AWS_SIGV4.
// curl computes the signature; we give it the payload hash (x-amz-content-sha256), an encoded path and a
// query already in canonical order, so the request curl signs is the one S3 verifies.
#include "s3_store.hpp"

#include <curl/curl.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "backends.hpp"
#include "moerl/core/env.hpp"
#include "s3_text.hpp"
#include "uri_settings.hpp"

// Throws moerl::Error naming the curl call when it did not return CURLE_OK.
#define MOERL_CURL_CHECK(call)                                                                           \
    do {                                                                                                 \
        CURLcode moerl_curl_rc_ = (call);                                                                \
        MOERL_CHECK(moerl_curl_rc_ == CURLE_OK, #call, " failed: ", curl_easy_strerror(moerl_curl_rc_)); \
    } while (0)

namespace moerl::control::s3 {

namespace fs = std::filesystem;

namespace {

const std::string kEmptySha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

using Query = std::vector<std::pair<std::string, std::string>>;

struct Response {
    long status = 0;
    std::string body;                            // the body, or the error body when a download failed
    std::map<std::string, std::string> headers;  // names in lower case
    std::string code() const { return xml_text(body, "Code"); }
};

struct Request {
    const char* method = "GET";
    std::string key;  // full object key; empty for a bucket request
    Query query;
    const std::string* body = nullptr;  // PUT/POST payload
    std::string content_type;
    FILE* sink = nullptr;  // a 2xx GET body goes here instead of Response::body
};

// State the curl callbacks see during one transfer.
struct Transfer {
    CURL* curl = nullptr;
    Response* response = nullptr;
    FILE* sink = nullptr;
    const std::string* body = nullptr;
    size_t body_offset = 0;
};

size_t on_write(char* data, size_t size, size_t count, void* user) {
    auto* t = static_cast<Transfer*>(user);
    size_t bytes = size * count;
    long status = 0;
    curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
    if (t->sink != nullptr && status >= 200 && status < 300) return std::fwrite(data, 1, bytes, t->sink);
    t->response->body.append(data, bytes);
    return bytes;
}

size_t on_read(char* buffer, size_t size, size_t count, void* user) {
    auto* t = static_cast<Transfer*>(user);
    size_t n = std::min(size * count, t->body->size() - t->body_offset);
    std::memcpy(buffer, t->body->data() + t->body_offset, n);
    t->body_offset += n;
    return n;
}

int on_seek(void* user, curl_off_t offset, int origin) {
    auto* t = static_cast<Transfer*>(user);
    if (origin != SEEK_SET || offset < 0 || static_cast<size_t>(offset) > t->body->size())
        return CURL_SEEKFUNC_FAIL;
    t->body_offset = static_cast<size_t>(offset);
    return CURL_SEEKFUNC_OK;
}

size_t on_header(char* data, size_t size, size_t count, void* user) {
    auto* t = static_cast<Transfer*>(user);
    std::string_view line(data, size * count);
    if (line.rfind("HTTP/", 0) == 0) t->response->headers.clear();  // a new response (after 100-continue)
    auto colon = line.find(':');
    if (colon != std::string_view::npos) {
        std::string name(line.substr(0, colon));
        for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        std::string_view value = line.substr(colon + 1);
        while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
        while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
            value.remove_suffix(1);
        t->response->headers[name] = std::string(value);
    }
    return size * count;
}

// Curl errors that a fresh attempt may not repeat (the server went away, a timeout, a reset).
bool is_transient(CURLcode rc) {
    switch (rc) {
        case CURLE_URL_MALFORMAT:
        case CURLE_UNSUPPORTED_PROTOCOL:
        case CURLE_NOT_BUILT_IN:
        case CURLE_BAD_FUNCTION_ARGUMENT:
        case CURLE_OUT_OF_MEMORY:
        case CURLE_WRITE_ERROR:
        case CURLE_READ_ERROR:
        case CURLE_ABORTED_BY_CALLBACK:
            return false;
        default:
            return true;
    }
}

bool is_transient(const Response& r) {
    return r.status >= 500 || r.status == 429 || (r.status == 400 && r.code() == "RequestTimeout");
}

void curl_init_once() {
    static std::once_flag once;
    std::call_once(once, [] { MOERL_CURL_CHECK(curl_global_init(CURL_GLOBAL_DEFAULT)); });
}

std::string read_range(const std::string& path, int fd, uint64_t offset, uint64_t size) {
    std::string out(size, '\0');
    uint64_t done = 0;
    while (done < size) {
        ssize_t n = ::pread(fd, out.data() + done, size - done, static_cast<off_t>(offset + done));
        MOERL_CHECK(n > 0, "reading ", path, " at offset ", offset + done, ": ",
                    n == 0 ? "unexpected end of file" : std::strerror(errno), "; expected ", size, " bytes");
        done += static_cast<uint64_t>(n);
    }
    return out;
}

class S3Store final : public CheckpointStore {
  public:
    S3Store(const std::string& uri, const Options& options) : uri_(uri), options_(options) {
        options_.validate();
        MOERL_CHECK(uri.rfind("s3://", 0) == 0, "S3 store URI '", uri, "': expected s3://bucket/prefix");
        std::string rest = uri.substr(5);
        auto slash = rest.find('/');
        bucket_ = rest.substr(0, slash);
        std::string prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
        while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
        root_ = prefix.empty() ? "" : prefix + "/";
        MOERL_CHECK(!bucket_.empty(), "S3 store URI '", uri, "': no bucket; expected s3://bucket/prefix");
        while (!options_.endpoint.empty() && options_.endpoint.back() == '/') options_.endpoint.pop_back();
        curl_init_once();
        curl_ = curl_easy_init();
        MOERL_CHECK(curl_ != nullptr, "curl_easy_init failed");
        if (options_.credentials) options_.credentials->get();  // a missing or broken source fails here
    }

    ~S3Store() override { curl_easy_cleanup(curl_); }

    std::string uri() const override { return uri_; }

    void put_file(const std::string& key, const std::string& local_path) override {
        std::error_code ec;
        uint64_t size = fs::file_size(local_path, ec);
        MOERL_CHECK(!ec, "put_file ", key, ": cannot read the size of ", local_path, ": ", ec.message());
        int fd = ::open(local_path.c_str(), O_RDONLY | O_CLOEXEC);
        MOERL_CHECK(fd >= 0, "put_file ", key, ": cannot open ", local_path, ": ", std::strerror(errno));
        struct Closer {
            int fd;
            ~Closer() { ::close(fd); }
        } closer{fd};
        std::lock_guard lock(mutex_);
        std::string object = object_key(key);
        if (size <= options_.multipart_threshold) {
            std::string body = read_range(local_path, fd, 0, size);
            Request r{.method = "PUT", .key = object, .body = &body};
            auto resp = perform(r);
            check_ok(r, resp);
            return;
        }
        put_multipart(object, local_path, fd, size);
    }

    void get_file(const std::string& key, const std::string& local_path) override {
        fs::path target(local_path);
        if (target.has_parent_path()) fs::create_directories(target.parent_path());
        // Written beside the target and renamed, so a reader never sees half a file.
        static std::atomic<uint64_t> counter{0};
        std::string temp =
            local_path + ".part-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
        FILE* f = std::fopen(temp.c_str(), "wb");
        MOERL_CHECK(f != nullptr, "get_file ", key, ": cannot create ", temp, ": ", std::strerror(errno));
        try {
            std::lock_guard lock(mutex_);
            Request r{.method = "GET", .key = object_key(key), .sink = f};
            auto resp = perform(r);
            check_ok(r, resp);
            MOERL_CHECK(std::fflush(f) == 0 && ::fsync(fileno(f)) == 0, "get_file ", key, ": writing ", temp,
                        " failed: ", std::strerror(errno));
            std::fclose(f);
            f = nullptr;
            fs::rename(temp, local_path);
        } catch (...) {
            if (f != nullptr) std::fclose(f);
            std::error_code ignored;
            fs::remove(temp, ignored);
            throw;
        }
    }

    bool exists(const std::string& key) override {
        std::lock_guard lock(mutex_);
        Request r{.method = "HEAD", .key = object_key(key)};
        auto resp = perform(r);
        if (resp.status == 404) return false;
        check_ok(r, resp);
        return true;
    }

    std::vector<std::string> list(const std::string& prefix) override {
        std::lock_guard lock(mutex_);
        std::vector<std::string> keys;
        std::string token;
        for (;;) {
            Request r{.method = "GET"};
            r.query = {{"list-type", "2"},
                       {"max-keys", std::to_string(options_.list_page_size)},
                       {"prefix", root_ + prefix}};
            if (!token.empty()) r.query.emplace_back("continuation-token", token);
            auto resp = perform(r);
            check_ok(r, resp);
            for (auto contents : xml_elements(resp.body, "Contents")) {
                std::string key = xml_text(contents, "Key");
                if (key.rfind(root_, 0) == 0) keys.push_back(key.substr(root_.size()));
            }
            if (xml_text(resp.body, "IsTruncated") != "true") break;
            token = xml_text(resp.body, "NextContinuationToken");
            MOERL_CHECK(!token.empty(), "S3 list ", uri_, " prefix '", prefix,
                        "': the reply is truncated but has no NextContinuationToken");
        }
        return keys;
    }

    void remove(const std::string& key) override {
        std::lock_guard lock(mutex_);
        Request r{.method = "DELETE", .key = object_key(key)};
        auto resp = perform(r);
        if (resp.status == 404) return;
        check_ok(r, resp);
    }

  private:
    std::string object_key(const std::string& key) const {
        MOERL_CHECK(!key.empty() && key.front() != '/', "S3 key '", key,
                    "': expected a relative key such as 'ckpt-3/model.safetensors'");
        return root_ + key;
    }

    aws::Credentials credentials() {
        if (options_.credentials) return options_.credentials->get();
        return {options_.access_key_id, options_.secret_access_key, options_.session_token, std::nullopt,
                "options"};
    }

    static bool expired(const Response& r) {
        return (r.status == 400 || r.status == 403) &&
               (r.code() == "ExpiredToken" || r.code() == "TokenRefreshRequired");
    }

    std::string describe(const Request& r) const {
        std::string out = std::string("S3 ") + r.method + " s3://" + bucket_ + "/" + r.key;
        for (const auto& [k, v] : r.query)
            if (k == "partNumber" || k == "uploads" || k == "prefix") out += " " + k + "=" + v;
        return out;
    }

    [[noreturn]] void fail(const Request& r, const Response& resp, int attempts) const {
        std::string code = resp.code();
        std::string message = xml_text(resp.body, "Message");
        MOERL_FAIL(describe(r), " failed: HTTP ", resp.status, code.empty() ? "" : " " + code,
                   message.empty() ? "" : " (" + message + ")", " after ", attempts,
                   attempts == 1 ? " attempt" : " attempts", "; expected HTTP 2xx");
    }

    void check_ok(const Request& r, const Response& resp) const {
        if (resp.status < 200 || resp.status >= 300) fail(r, resp, 1);
    }

    // One request with retries: returns the response of the first attempt that is not transient (any
    // status), or throws after max_attempts transient failures.
    Response perform(const Request& r) {
        std::string url = options_.endpoint + "/" + bucket_ + "/" + uri_encode(r.key, true);
        if (!r.query.empty()) url += "?" + canonical_query(r.query);
        const std::string payload_hash =
            r.body != nullptr ? sha256_hex(r.body->data(), r.body->size()) : kEmptySha256;
        auto backoff = options_.backoff;
        Response resp;
        bool refreshed = false;
        for (int attempt = 1;; ++attempt) {
            if (r.sink != nullptr) {
                // A failed try may have written part of the body.
                MOERL_CHECK(std::fflush(r.sink) == 0 && ::ftruncate(fileno(r.sink), 0) == 0,
                            "truncating the download of ", r.key, " failed: ", std::strerror(errno));
                std::rewind(r.sink);
            }
            resp = Response{};
            std::string curl_error;
            CURLcode rc = perform_once(r, url, payload_hash, resp, curl_error);
            if (rc == CURLE_OK && expired(resp) && options_.credentials && !refreshed) {
                // Temporary credentials revoked or expired early: fetch new ones, once.
                options_.credentials->invalidate();
                refreshed = true;
                --attempt;
                continue;
            }
            if (rc == CURLE_OK && !is_transient(resp)) return resp;
            MOERL_CHECK(rc == CURLE_OK || is_transient(rc), describe(r), " failed: curl error ", rc, " ",
                        curl_easy_strerror(rc), " (", curl_error, ")");
            if (attempt >= options_.max_attempts) {
                if (rc != CURLE_OK)
                    MOERL_FAIL(describe(r), " failed after ", attempt, " attempts: ", curl_easy_strerror(rc),
                               " (", curl_error, "); expected the S3 endpoint ", options_.endpoint,
                               " to answer");
                fail(r, resp, attempt);
            }
            std::this_thread::sleep_for(backoff);
            backoff = std::min(backoff * 2, std::chrono::milliseconds(10000));
        }
    }

    CURLcode perform_once(const Request& r, const std::string& url, const std::string& payload_hash,
                          Response& resp, std::string& curl_error) {
        curl_easy_reset(curl_);  // keeps the connection cache
        Transfer t{.curl = curl_, .response = &resp, .sink = r.sink, .body = r.body};
        char error_buffer[CURL_ERROR_SIZE] = {0};
        struct curl_slist* headers = nullptr;
        auto add_header = [&](const std::string& h) {
            curl_slist* next = curl_slist_append(headers, h.c_str());
            MOERL_CHECK(next != nullptr, "curl_slist_append failed");
            headers = next;
        };
        const aws::Credentials creds = credentials();
        add_header("x-amz-content-sha256: " + payload_hash);
        // Signed with the rest (curl signs every header it is given): temporary credentials need it.
        if (!creds.session_token.empty()) add_header("x-amz-security-token: " + creds.session_token);
        if (!r.content_type.empty()) add_header("Content-Type: " + r.content_type);
        std::string sigv4 = "aws:amz:" + options_.region + ":s3";
        std::string userpwd = creds.access_key_id + ":" + creds.secret_access_key;
        CURLcode rc = CURLE_OK;
        auto set = [&](CURLcode c) {
            if (rc == CURLE_OK) rc = c;
        };
        set(curl_easy_setopt(curl_, CURLOPT_URL, url.c_str()));
        set(curl_easy_setopt(curl_, CURLOPT_PATH_AS_IS, 1L));  // the signed path must be the sent path
        set(curl_easy_setopt(curl_, CURLOPT_AWS_SIGV4, sigv4.c_str()));
        set(curl_easy_setopt(curl_, CURLOPT_USERPWD, userpwd.c_str()));
        set(curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers));
        set(curl_easy_setopt(curl_, CURLOPT_ERRORBUFFER, error_buffer));
        set(curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L));
        set(curl_easy_setopt(curl_, CURLOPT_CONNECTTIMEOUT_MS,
                             static_cast<long>(options_.connect_timeout.count())));
        set(curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_LIMIT, 1L));
        set(curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_TIME,
                             static_cast<long>(std::max<int64_t>(1, options_.stall_timeout.count() / 1000))));
        set(curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, on_write));
        set(curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &t));
        set(curl_easy_setopt(curl_, CURLOPT_HEADERFUNCTION, on_header));
        set(curl_easy_setopt(curl_, CURLOPT_HEADERDATA, &t));
        std::string method = r.method;
        if (method == "HEAD") {
            set(curl_easy_setopt(curl_, CURLOPT_NOBODY, 1L));
        } else if (method == "PUT") {
            set(curl_easy_setopt(curl_, CURLOPT_UPLOAD, 1L));
            set(curl_easy_setopt(curl_, CURLOPT_READFUNCTION, on_read));
            set(curl_easy_setopt(curl_, CURLOPT_READDATA, &t));
            set(curl_easy_setopt(curl_, CURLOPT_SEEKFUNCTION, on_seek));
            set(curl_easy_setopt(curl_, CURLOPT_SEEKDATA, &t));
            set(curl_easy_setopt(curl_, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body->size())));
        } else if (method == "POST") {
            set(curl_easy_setopt(curl_, CURLOPT_POST, 1L));
            set(curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, r.body != nullptr ? r.body->data() : ""));
            set(curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE_LARGE,
                                 static_cast<curl_off_t>(r.body != nullptr ? r.body->size() : 0)));
        } else if (method != "GET") {
            set(curl_easy_setopt(curl_, CURLOPT_CUSTOMREQUEST, r.method));
        }
        if (rc == CURLE_OK) rc = curl_easy_perform(curl_);
        if (rc == CURLE_OK) curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &resp.status);
        curl_easy_setopt(curl_, CURLOPT_ERRORBUFFER, nullptr);
        curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, nullptr);
        curl_slist_free_all(headers);
        curl_error = error_buffer;
        return rc;
    }

    void put_multipart(const std::string& object, const std::string& local_path, int fd, uint64_t size) {
        // Parts of at least 5 MiB (S3's minimum except for the last) and at most 10000 of them.
        uint64_t part_size = std::max<uint64_t>({options_.part_size, 5ull << 20, (size + 9999) / 10000});
        std::string empty;
        Request create{.method = "POST",
                       .key = object,
                       .query = {{"uploads", ""}},
                       .body = &empty,
                       .content_type = "application/octet-stream"};
        auto created = perform(create);
        check_ok(create, created);
        std::string upload_id = xml_text(created.body, "UploadId");
        MOERL_CHECK(!upload_id.empty(), describe(create), ": the reply has no UploadId: ", created.body);
        try {
            std::string complete_xml = "<CompleteMultipartUpload>";
            int part_number = 0;
            for (uint64_t offset = 0; offset < size; offset += part_size) {
                ++part_number;
                std::string part = read_range(local_path, fd, offset, std::min(part_size, size - offset));
                Request put{.method = "PUT",
                            .key = object,
                            .query = {{"partNumber", std::to_string(part_number)}, {"uploadId", upload_id}},
                            .body = &part};
                auto resp = perform(put);
                check_ok(put, resp);
                auto etag = resp.headers.find("etag");
                MOERL_CHECK(etag != resp.headers.end() && !etag->second.empty(), describe(put),
                            ": the reply has no ETag header");
                complete_xml += "<Part><PartNumber>" + std::to_string(part_number) + "</PartNumber><ETag>" +
                                etag->second + "</ETag></Part>";
            }
            complete_xml += "</CompleteMultipartUpload>";
            Request complete{.method = "POST",
                             .key = object,
                             .query = {{"uploadId", upload_id}},
                             .body = &complete_xml,
                             .content_type = "application/xml"};
            auto resp = perform(complete);
            // S3 may answer 200 and still report an error in the body.
            if (resp.status == 200 && resp.body.find("<Error>") != std::string::npos) resp.status = 500;
            if (resp.status == 404 && resp.code() == "NoSuchUpload" &&
                size_of(object) == static_cast<int64_t>(size))
                return;  // a retry
            check_ok(complete, resp);
        } catch (...) {
            try {
                Request abort{.method = "DELETE", .key = object, .query = {{"uploadId", upload_id}}};
                perform(abort);
            } catch (...) {
                // The original error matters more; an abandoned upload is cleaned up by bucket lifecycle
                // rules.
            }
            throw;
        }
    }

    // The object's size, or -1 when it does not exist.
    int64_t size_of(const std::string& object) {
        Request r{.method = "HEAD", .key = object};
        auto resp = perform(r);
        if (resp.status != 200) return -1;
        auto length = resp.headers.find("content-length");
        return length == resp.headers.end() ? -1 : std::stoll(length->second);
    }

    const std::string uri_;
    Options options_;
    std::string bucket_;
    std::string root_;      // "prefix/" or ""
    std::mutex mutex_;      // guards curl_ (one handle per store: its connections are reused)
    CURL* curl_ = nullptr;  // GUARDED_BY(mutex_)
};

}  // namespace

Options Options::from_env() {
    Options o;
    o.region = env::get_string("AWS_REGION", env::get_string("AWS_DEFAULT_REGION", o.region));
    o.endpoint =
        env::get_string("AWS_ENDPOINT_URL_S3",
                        env::get_string("AWS_ENDPOINT_URL", "https://s3." + o.region + ".amazonaws.com"));
    o.credentials = std::make_shared<aws::CredentialChain>(aws::ChainSettings::from_env(o.region));
    return o;
}

std::string Options::read_uri_settings(const std::string& uri) {
    for (const auto& [name, text] : query_settings(uri, "S3 store URI")) {
        const long v = query_int(uri, "S3 store URI", name, text);
        if (name == "multipart_mb" || name == "part_mb") {
            MOERL_CHECK(v >= 1, "S3 store URI '", uri, "': ", name, "=", v, "; expected at least 1 (MiB)");
            (name == "part_mb" ? part_size : multipart_threshold) = static_cast<uint64_t>(v) << 20;
        } else if (name == "attempts") {
            max_attempts = static_cast<int>(v);
        } else if (name == "backoff_ms") {
            backoff = std::chrono::milliseconds(v);
        } else {
            MOERL_FAIL("S3 store URI '", uri, "': unknown setting '", name,
                       "'; expected multipart_mb, part_mb, attempts or backoff_ms");
        }
    }
    return without_query(uri);
}

void Options::validate() const {
    MOERL_CHECK(
        credentials || (!access_key_id.empty() && !secret_access_key.empty()),
        "S3 credentials missing: expected AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or another source of "
        "the AWS credential chain (IRSA, Pod Identity, instance metadata)");
    MOERL_CHECK(endpoint.rfind("http://", 0) == 0 || endpoint.rfind("https://", 0) == 0, "S3 endpoint '",
                endpoint, "': expected http://host[:port] or https://host[:port]");
    MOERL_CHECK(!region.empty(), "S3 region is empty; expected e.g. us-east-1 (AWS_REGION)");
    MOERL_CHECK(max_attempts >= 1, "S3 max_attempts = ", max_attempts,
                "; expected >= 1 (the store URI's attempts)");
    MOERL_CHECK(backoff.count() >= 0, "S3 backoff = ", backoff.count(),
                " ms; expected >= 0 (the store URI's backoff_ms)");
    MOERL_CHECK(multipart_threshold >= 1, "S3 multipart threshold is 0; expected >= 1 byte");
    MOERL_CHECK(list_page_size >= 1 && list_page_size <= 1000, "S3 list page size = ", list_page_size,
                "; expected 1..1000");
}

std::unique_ptr<CheckpointStore> make_store(const std::string& uri, const Options& options) {
    return std::make_unique<S3Store>(uri, options);
}

}  // namespace moerl::control::s3

namespace moerl::control {

std::unique_ptr<CheckpointStore> make_s3_checkpoint_store(const std::string& uri) {
    s3::Options options = s3::Options::from_env();
    const std::string address = options.read_uri_settings(uri);
    return s3::make_store(address, options);
}

}  // namespace moerl::control
