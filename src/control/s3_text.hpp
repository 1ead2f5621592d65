// Internal: the text helpers of the S3 store: SigV4 URI encoding, sha256, and the little XML it reads.
#pragma once

#include <openssl/evp.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "digest.hpp"
#include "moerl/core/error.hpp"

namespace moerl::control::s3 {

// AWS SigV4 encoding: every byte but A-Z a-z 0-9 - _ . ~ (and '/' when keep_slash) as %XX.
inline std::string uri_encode(std::string_view text, bool keep_slash) {
    static const char* kHex = "0123456789ABCDEF";
    std::string out;
    out.reserve(text.size());
    for (unsigned char c : text) {
        bool unreserved = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                          c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/');
        if (unreserved) {
            out += static_cast<char>(c);
        } else {
            out += '%';
            out += kHex[c >> 4];
            out += kHex[c & 15];
        }
    }
    return out;
}

// The canonical query string of SigV4: parameters sorted, names and values encoded, "name=" for an
// empty value. curl signs the query as written, so the URL carries it in exactly this form.
inline std::string canonical_query(std::vector<std::pair<std::string, std::string>> params) {
    for (auto& [k, v] : params) {
        k = uri_encode(k, false);
        v = uri_encode(v, false);
    }
    std::sort(params.begin(), params.end());
    std::string out;
    for (const auto& [k, v] : params) {
        if (!out.empty()) out += '&';
        out += k + "=" + v;
    }
    return out;
}

inline std::string sha256_hex(const void* data, size_t size) { return hex_digest(EVP_sha256(), data, size); }

inline std::string xml_unescape(std::string_view text) {
    std::string out;
    for (size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '&') {
            out += text[i];
            continue;
        }
        size_t end = text.find(';', i);
        if (end == std::string_view::npos) {
            out += text[i];
            continue;
        }
        std::string_view entity = text.substr(i + 1, end - i - 1);
        if (entity == "amp")
            out += '&';
        else if (entity == "lt")
            out += '<';
        else if (entity == "gt")
            out += '>';
        else if (entity == "quot")
            out += '"';
        else if (entity == "apos")
            out += '\'';
        else if (!entity.empty() && entity[0] == '#') {
            // &#NN; or &#xHH; as UTF-8
            unsigned long cp = entity.size() > 1 && (entity[1] == 'x' || entity[1] == 'X')
                                   ? std::stoul(std::string(entity.substr(2)), nullptr, 16)
                                   : std::stoul(std::string(entity.substr(1)), nullptr, 10);
            if (cp < 0x80) {
                out += static_cast<char>(cp);
            } else if (cp < 0x800) {
                out += static_cast<char>(0xC0 | (cp >> 6));
                out += static_cast<char>(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                out += static_cast<char>(0xE0 | (cp >> 12));
                out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
                out += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
                out += static_cast<char>(0xF0 | (cp >> 18));
                out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
                out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
                out += static_cast<char>(0x80 | (cp & 0x3F));
            }
        } else {
            out.append(text.substr(i, end - i + 1));
        }
        i = end;
    }
    return out;
}

// The raw contents of every <tag>...</tag> in xml, in order (S3's replies do not nest a tag in itself).
inline std::vector<std::string_view> xml_elements(std::string_view xml, std::string_view tag) {
    std::vector<std::string_view> out;
    const std::string open = "<" + std::string(tag) + ">";
    const std::string close = "</" + std::string(tag) + ">";
    size_t pos = 0;
    for (;;) {
        size_t begin = xml.find(open, pos);
        if (begin == std::string_view::npos) break;
        begin += open.size();
        size_t end = xml.find(close, begin);
        if (end == std::string_view::npos) break;
        out.push_back(xml.substr(begin, end - begin));
        pos = end + close.size();
    }
    return out;
}

// The unescaped text of the first <tag>, or "".
inline std::string xml_text(std::string_view xml, std::string_view tag) {
    auto all = xml_elements(xml, tag);
    return all.empty() ? std::string() : xml_unescape(all.front());
}

}  // namespace moerl::control::s3
