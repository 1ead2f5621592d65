// Internal: hex digests through OpenSSL's EVP interface — sha256 for checkpoint manifests and S3
// payload hashes, sha1 for Redis script ids.
#pragma once

#include <openssl/evp.h>

#include <memory>
#include <string>

#include "moerl/core/error.hpp"

namespace moerl::control {

// An incremental digest: update() any number of times, then hex() once.
class Digest {
  public:
    explicit Digest(const EVP_MD* md) : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
        MOERL_CHECK(ctx_ && EVP_DigestInit_ex(ctx_.get(), md, nullptr) == 1, "OpenSSL ", EVP_MD_name(md),
                    " init failed");
    }
    void update(const void* data, size_t size) {
        MOERL_CHECK(EVP_DigestUpdate(ctx_.get(), data, size) == 1, "OpenSSL digest update failed");
    }
    // Lower-case hex of the digest.
    std::string hex() {
        unsigned char md[EVP_MAX_MD_SIZE];
        unsigned int length = 0;
        MOERL_CHECK(EVP_DigestFinal_ex(ctx_.get(), md, &length) == 1, "OpenSSL digest final failed");
        static const char* kHex = "0123456789abcdef";
        std::string out;
        out.reserve(2 * length);
        for (unsigned int i = 0; i < length; ++i) {
            out += kHex[md[i] >> 4];
            out += kHex[md[i] & 15];
        }
        return out;
    }

  private:
    std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx_;
};

inline std::string hex_digest(const EVP_MD* md, const void* data, size_t size) {
    Digest d(md);
    d.update(data, size);
    return d.hex();
}

}  // namespace moerl::control
