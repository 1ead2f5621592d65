// One exception type for all of moerl, carrying the file:line that raised it.
#pragma once

#include <charconv>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace moerl {

class Error : public std::runtime_error {
  public:
    Error(const std::string& what, const char* file, int line)
        : std::runtime_error(what + " [" + file + ":" + std::to_string(line) + "]"),
          message_(what),
          file_(file),
          line_(line) {}
    // The message without the location suffix.
    const std::string& message() const { return message_; }
    const char* file() const { return file_; }
    int line() const { return line_; }

  private:
    std::string message_;
    const char* file_;
    int line_;
};

// A timeout while waiting on a peer; a separate type so callers can tell it apart.
class TimeoutError : public Error {
  public:
    using Error::Error;
};

namespace detail {
// One argument of concat: text as it is, numbers as iostreams would print them (integers in decimal,
// floating point as %g, bool as 1/0, char types as characters), anything else (enums among them)
// through operator<<.
// Numbers bypass iostreams: in processes where another library exports copies of libstdc++'s
// symbols (PyTorch's wheels inside Python), a number through an ostringstream crashed.
template <typename T>
void append_one(std::string& out, const T& v) {
    using U = std::remove_cv_t<std::remove_reference_t<T>>;
    if constexpr (std::is_same_v<U, const char*> || std::is_same_v<U, char*>) {
        if (v != nullptr) out += v;
    } else if constexpr (std::is_convertible_v<const U&, std::string_view>) {
        out += std::string_view(v);
    } else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char> ||
                         std::is_same_v<U, unsigned char>) {
        out += static_cast<char>(v);
    } else if constexpr (std::is_same_v<U, bool>) {
        out += v ? '1' : '0';
    } else if constexpr (std::is_integral_v<U>) {
        char buf[24];
        const auto r = std::to_chars(buf, buf + sizeof buf, v);
        out.append(buf, r.ptr);
    } else if constexpr (std::is_floating_point_v<U>) {
        char buf[32];
        const int n = std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
        out.append(buf, static_cast<size_t>(n > 0 ? n : 0));
    } else {
        std::ostringstream os;
        os << v;
        out += os.str();
    }
}

template <typename... Args>
std::string concat(Args&&... args) {
    std::string out;
    (append_one(out, args), ...);
    return out;
}
}  // namespace detail

}  // namespace moerl

// MOERL_CHECK(cond, "what was wrong ", value, " expected ", other): throws moerl::Error.
#define MOERL_CHECK(cond, ...)                                                                       \
    do {                                                                                             \
        if (!(cond)) throw ::moerl::Error(::moerl::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
    } while (0)

#define MOERL_FAIL(...) throw ::moerl::Error(::moerl::detail::concat(__VA_ARGS__), __FILE__, __LINE__)
