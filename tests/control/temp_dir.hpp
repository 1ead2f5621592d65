// A fresh directory under the system's temporary directory, removed with its contents at the end.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace moerl::control::test {

struct TempDir {
    std::filesystem::path path;
    explicit TempDir(const std::string& tag = "ckpt-test") {
        static int n = 0;
        path = std::filesystem::temp_directory_path() /
               ("moerl-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
        std::filesystem::remove_all(path);
        std::filesystem::create_directories(path);
    }
    ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace moerl::control::test
