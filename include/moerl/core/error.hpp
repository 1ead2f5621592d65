// One exception type for all of moerl, carrying the file:line that raised it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
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
template <typename... Args>
std::string concat(Args&&... args) {
    std::ostringstream os;
    (os << ... << std::forward<Args>(args));
    return os.str();
}
}  // namespace detail

}  // namespace moerl

// MOERL_CHECK(cond, "what was wrong ", value, " expected ", other): throws moerl::Error.
#define MOERL_CHECK(cond, ...)                                                                       \
    do {                                                                                             \
        if (!(cond)) throw ::moerl::Error(::moerl::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
    } while (0)

#define MOERL_FAIL(...) throw ::moerl::Error(::moerl::detail::concat(__VA_ARGS__), __FILE__, __LINE__)
