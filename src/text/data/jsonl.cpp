// JSONL files read through an index of line offsets (one pass at open, the text stays on disk).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "moerl/core/error.hpp"
#include "moerl/text/dataset.hpp"

namespace moerl::text {

namespace {

bool is_blank(const char* begin, const char* end) {
    return std::all_of(begin, end, [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

const char* type_name(const nlohmann::json& v) { return v.type_name(); }

// nlohmann's messages start with "[json.exception.parse_error.101] "; keep what follows.
std::string parse_message(const std::exception& e) {
    std::string s = e.what();
    auto pos = s.find("] ");
    return pos == std::string::npos ? s : s.substr(pos + 2);
}

// A field that is a string, or a number (an integer when `integer_only`) written as text.
std::optional<std::string> text_field(const nlohmann::json& j, const std::string& name, bool integer_only,
                                      const std::string& where) {
    const auto v = j.find(name);
    if (v == j.end()) return std::nullopt;
    MOERL_CHECK(v->is_string() || (integer_only ? v->is_number_integer() : v->is_number()), where, ": \"",
                name, "\" must be a string or ", integer_only ? "an integer" : "a number", ", got ",
                type_name(*v));
    return v->is_string() ? v->get<std::string>() : v->dump();
}

}  // namespace

Example parse_example(const std::string& line, const JsonlFormat& f, const std::string& where) {
    Example ex;
    ex.where = where;
    try {
        ex.fields = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
        MOERL_FAIL(where, ": not valid JSON: ", parse_message(e));
    }
    const nlohmann::json& j = ex.fields;
    MOERL_CHECK(j.is_object(), where, ": expected a JSON object, got ", type_name(j));
    const auto prompt = j.find(f.prompt_field);
    const auto messages = j.find(f.messages_field);
    MOERL_CHECK(prompt != j.end() || messages != j.end(), where, ": no \"", f.prompt_field, "\" and no \"",
                f.messages_field, "\" field");
    MOERL_CHECK(prompt == j.end() || messages == j.end(), where, ": both \"", f.prompt_field, "\" and \"",
                f.messages_field, "\" are given; keep one");
    if (prompt != j.end()) {
        MOERL_CHECK(prompt->is_string(), where, ": \"", f.prompt_field, "\" must be a string, got ",
                    type_name(*prompt));
        ex.prompt = prompt->get<std::string>();
    } else {
        MOERL_CHECK(messages->is_array() && !messages->empty(), where, ": \"", f.messages_field,
                    "\" must be a non-empty array of messages, got ",
                    messages->is_array() ? "an empty array" : type_name(*messages));
        for (size_t m = 0; m < messages->size(); ++m) {
            const auto& msg = (*messages)[m];
            MOERL_CHECK(msg.is_object(), where, ": \"", f.messages_field, "\"[", m,
                        "] must be an object, got ", type_name(msg));
            const auto role = msg.find("role");
            MOERL_CHECK(role != msg.end() && role->is_string(), where, ": \"", f.messages_field, "\"[", m,
                        "] needs a string \"role\"");
            const auto content = msg.find("content");
            MOERL_CHECK(
                content == msg.end() || content->is_string() || content->is_null() || content->is_array(),
                where, ": \"", f.messages_field, "\"[", m,
                "].content must be a string, an array or null, got ", type_name(*content));
        }
        ex.messages = *messages;
    }
    auto answer = text_field(j, f.answer_field, false, where);
    MOERL_CHECK(answer || !f.require_answer, where, ": no \"", f.answer_field, "\" field");
    ex.answer = answer.value_or("");
    ex.id = text_field(j, f.id_field, true, where).value_or(where);
    return ex;
}

JsonlFile::JsonlFile(std::string path, JsonlFormat format, bool validate)
    : path_(std::move(path)), format_(std::move(format)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    MOERL_CHECK(fd_ >= 0, "cannot open dataset '", path_, "': ", std::strerror(errno));
    // One pass: record where each non-blank line starts; lines that span reads are carried over.
    // Reads of up to 1 MiB, no larger than a small file needs (the fuzzer opens thousands a second).
    struct stat st {};
    const uint64_t chunk = ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode)
                               ? std::clamp<uint64_t>(static_cast<uint64_t>(st.st_size) + 1, 4096, 1 << 20)
                               : 1 << 20;
    std::vector<char> buf(chunk);
    std::string carry;     // the current line's bytes read so far
    uint64_t pos = 0;      // file offset of buf[0]
    uint64_t start = 0;    // offset where the current line starts
    uint64_t line_no = 1;  // its line number
    bool first = true;
    auto finish_line = [&](const char* b, const char* e) {
        if (is_blank(b, e)) {
            blanks_before_.push_back(offsets_.size());
        } else {
            if (validate) {
                std::string line(b, e);
                if (!line.empty() && line.back() == '\r') line.pop_back();
                parse_example(line, format_, path_ + ":" + std::to_string(line_no));
            }
            offsets_.push_back(start);
        }
        ++line_no;
    };
    for (;;) {
        ssize_t n = ::read(fd_, buf.data(), buf.size());
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            const int err = errno;
            ::close(fd_);
            MOERL_FAIL("cannot read dataset '", path_, "': ", std::strerror(err));
        }
        if (n == 0) break;
        const char* b = buf.data();
        const char* e = b + n;
        if (first) {
            first = false;
            if (n >= 3 && std::memcmp(b, "\xEF\xBB\xBF", 3) == 0) b += 3, start = 3;  // UTF-8 BOM
        }
        while (b < e) {
            const char* nl = static_cast<const char*>(std::memchr(b, '\n', static_cast<size_t>(e - b)));
            if (nl == nullptr) {
                carry.append(b, e);
                break;
            }
            try {
                if (carry.empty()) {
                    finish_line(b, nl);
                } else {
                    carry.append(b, nl);
                    finish_line(carry.data(), carry.data() + carry.size());
                    carry.clear();
                }
            } catch (...) {
                ::close(fd_);
                throw;
            }
            start = pos + static_cast<uint64_t>(nl + 1 - buf.data());
            b = nl + 1;
        }
        pos += static_cast<uint64_t>(n);
    }
    file_bytes_ = pos;
    try {
        if (!carry.empty()) finish_line(carry.data(), carry.data() + carry.size());
        MOERL_CHECK(!offsets_.empty(), "dataset '", path_, "' holds no examples (",
                    file_bytes_ == 0 ? "the file is empty" : "only blank lines", ")");
    } catch (...) {
        ::close(fd_);
        throw;
    }
    offsets_.shrink_to_fit();
    blanks_before_.shrink_to_fit();
}

JsonlFile::~JsonlFile() {
    if (fd_ >= 0) ::close(fd_);
}

uint64_t JsonlFile::line_number(uint64_t i) const {
    // Blank lines recorded with a count <= i come before example i.
    const auto blanks =
        std::upper_bound(blanks_before_.begin(), blanks_before_.end(), i) - blanks_before_.begin();
    return i + 1 + static_cast<uint64_t>(blanks);
}

uint64_t JsonlFile::index_bytes() const {
    return (offsets_.capacity() + blanks_before_.capacity()) * sizeof(uint64_t);
}

std::string JsonlFile::read_line(uint64_t i) const {
    MOERL_CHECK(i < offsets_.size(), "dataset '", path_, "': example ", i, " of ", offsets_.size());
    std::string line;
    char chunk[4096];
    uint64_t at = offsets_[i];
    for (;;) {
        ssize_t n = ::pread(fd_, chunk, sizeof chunk, static_cast<off_t>(at));
        if (n < 0 && errno == EINTR) continue;
        MOERL_CHECK(n >= 0, "cannot read dataset '", path_, "' at byte ", at, ": ", std::strerror(errno));
        if (n == 0) break;
        const void* nl = std::memchr(chunk, '\n', static_cast<size_t>(n));
        if (nl != nullptr) {
            line.append(chunk, static_cast<size_t>(static_cast<const char*>(nl) - chunk));
            break;
        }
        line.append(chunk, static_cast<size_t>(n));
        at += static_cast<uint64_t>(n);
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return line;
}

Example JsonlFile::read(uint64_t i) const {
    return parse_example(read_line(i), format_, path_ + ":" + std::to_string(line_number(i)));
}

}  // namespace moerl::text
