// A scratch directory per test, removed afterwards, and a helper to write files into it.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "moerl/core/error.hpp"
#include "moerl/text/dataset.hpp"

namespace moerl::text::testing {

// An example with only a prompt and `answer`, as verifier tests need.
inline Example with_answer(const std::string& answer) {
    Example ex;
    ex.where = "test:1";
    ex.answer = answer;
    ex.fields = {{"prompt", "q"}, {"answer", answer}};
    return ex;
}

// The message of the moerl::Error that `f` throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const Error& e) {
        return e.message();
    }
    return "";
}

class ScratchDir {
  public:
    ScratchDir() {
        const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
        path_ = std::filesystem::temp_directory_path() / ("moerl-text-" + std::to_string(::getpid()) + "-" +
                                                          info->test_suite_name() + "-" + info->name());
        std::filesystem::remove_all(path_);
        std::filesystem::create_directories(path_);
    }
    ~ScratchDir() { std::filesystem::remove_all(path_); }
    std::string write(const std::string& name, const std::string& text) const {
        const auto p = path_ / name;
        std::ofstream(p, std::ios::binary) << text;
        return p.string();
    }
    std::string path(const std::string& name) const { return (path_ / name).string(); }

  private:
    std::filesystem::path path_;
};

}  // namespace moerl::text::testing
