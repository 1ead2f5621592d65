// Helpers of the dist tests: server addresses from the environment, unique names, and servers the
// tests start themselves (to stop and restart them).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace moerl::dist_test {

inline std::string env_or(const char* name, const std::string& fallback = "") {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}

// A name no earlier run used: keys and objects of each test stay apart on shared servers.
inline std::string unique_name(const std::string& base) {
    static std::mt19937_64 rng(std::random_device{}());
    return base + "-" + std::to_string(::getpid()) + "-" + std::to_string(rng() % 1000000000);
}

inline int free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
        ::close(fd);
        throw std::runtime_error("free_port: cannot bind 127.0.0.1:0");
    }
    ::close(fd);
    return ntohs(addr.sin_port);
}

inline bool port_open(int port) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    return ok;
}

// A child process (a server) that is killed when this object goes away.
class ServerProcess {
  public:
    ServerProcess() = default;
    ServerProcess(const ServerProcess&) = delete;
    ServerProcess& operator=(const ServerProcess&) = delete;
    ~ServerProcess() { stop(SIGKILL); }

    // Starts argv with stdout and stderr to log_path and waits until `port` accepts connections.
    void start(const std::vector<std::string>& argv, int port, const std::string& log_path,
               std::chrono::seconds timeout = std::chrono::seconds(30)) {
        stop(SIGKILL);
        pid_ = ::fork();
        if (pid_ < 0) throw std::runtime_error("fork failed");
        if (pid_ == 0) {
            FILE* log = std::fopen(log_path.c_str(), "a");
            if (log != nullptr) {
                ::dup2(fileno(log), 1);
                ::dup2(fileno(log), 2);
            }
            std::vector<char*> args;
            for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
            args.push_back(nullptr);
            ::execvp(args[0], args.data());
            std::_Exit(127);
        }
        auto deadline = std::chrono::steady_clock::now() + timeout;
        while (!port_open(port)) {
            int status = 0;
            if (::waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                throw std::runtime_error("server " + argv[0] + " exited at start; see " + log_path);
            }
            if (std::chrono::steady_clock::now() > deadline) {
                stop(SIGKILL);
                throw std::runtime_error("server " + argv[0] + " did not listen on port " +
                                         std::to_string(port));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

    // Ends the server (SIGKILL: it goes away without a goodbye, as a crashed server does).
    void stop(int signal = SIGKILL) {
        if (pid_ <= 0) return;
        ::kill(pid_, signal);
        int status = 0;
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
    }

    bool running() const { return pid_ > 0; }

  private:
    pid_t pid_ = -1;
};

// A scratch directory removed at the end of the test.
class TempDir {
  public:
    explicit TempDir(const std::string& base) {
        path_ = std::filesystem::temp_directory_path() / unique_name(base);
        std::filesystem::create_directories(path_);
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    const std::filesystem::path& path() const { return path_; }
    std::string operator/(const std::string& name) const { return (path_ / name).string(); }

  private:
    std::filesystem::path path_;
};

inline std::string random_bytes(size_t size, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::string out(size, '\0');
    for (size_t i = 0; i < size; i += 8) {
        uint64_t v = rng();
        for (size_t j = 0; j < 8 && i + j < size; ++j) out[i + j] = static_cast<char>(v >> (8 * j));
    }
    return out;
}

inline void write_file(const std::string& path, const std::string& data) {
    std::ofstream out(path, std::ios::binary);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!out) throw std::runtime_error("cannot write " + path);
}

inline std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace moerl::dist_test
