// lock_run_directory (run_lock.hpp): an flock(2) on DIR/.moerl.lock holding the holder's pid.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "moerl/control/run_lock.hpp"
#include "moerl/core/error.hpp"

namespace moerl::control {

namespace {
namespace fs = std::filesystem;

std::string read_all(int fd) {
    std::string text;
    char buf[64];
    for (off_t at = 0;;) {
        const ssize_t n = ::pread(fd, buf, sizeof buf, at);
        if (n <= 0) break;
        text.append(buf, static_cast<size_t>(n));
        at += n;
        if (text.size() > 256) break;  // a pid is short: whatever else is there is not ours
    }
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
}

class DirectoryLock final : public RunLock {
  public:
    DirectoryLock(std::string path, int fd)
        : path_(std::move(path)), fd_(fd), pid_(std::to_string(::getpid())) {}
    ~DirectoryLock() override {
        ::unlink(path_.c_str());  // first: a waiting process then finds no stale pid in it
        ::close(fd_);
    }

    void check() override {
        const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
        std::string held_by = fd >= 0 ? read_all(fd) : "";
        if (fd >= 0) ::close(fd);
        MOERL_CHECK(held_by == pid_, "output directory lock ", path_,
                    held_by.empty() ? std::string(" was removed")
                                    : " now names pid " + held_by + " instead of this process (" + pid_ + ")",
                    "; stopping so that two runs do not write one directory");
    }

  private:
    const std::string path_;
    const int fd_;
    const std::string pid_;
};
}  // namespace

std::unique_ptr<RunLock> lock_run_directory(const std::string& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    MOERL_CHECK(!ec, "cannot create output directory ", dir, ": ", ec.message());
    const std::string path = (fs::path(dir) / ".moerl.lock").string();
    // The holder unlinks the file before it unlocks: a lock taken on an unlinked file is retried.
    for (int attempt = 0;; ++attempt) {
        const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        MOERL_CHECK(fd >= 0, "cannot open the output directory lock ", path, ": ", std::strerror(errno));
        if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const int err = errno;
            const std::string holder = read_all(fd);
            ::close(fd);
            MOERL_CHECK(err == EWOULDBLOCK, "cannot lock ", path, ": ", std::strerror(err));
            MOERL_FAIL("output directory ", dir, " is in use by another moerl process (pid ",
                       holder.empty() ? std::string("unknown") : holder, ", lock file ", path,
                       "); wait for it to finish or stop it, or choose another --out");
        }
        struct stat opened {
        }, named{};
        if (::fstat(fd, &opened) == 0 && ::stat(path.c_str(), &named) == 0 && opened.st_ino == named.st_ino &&
            opened.st_dev == named.st_dev) {
            // Ours. A dead holder's pid may still be in it: replace it.
            const std::string pid = std::to_string(::getpid()) + "\n";
            MOERL_CHECK(::ftruncate(fd, 0) == 0 &&
                            ::pwrite(fd, pid.data(), pid.size(), 0) == static_cast<ssize_t>(pid.size()),
                        "cannot write the output directory lock ", path, ": ", std::strerror(errno));
            return std::make_unique<DirectoryLock>(path, fd);
        }
        ::close(fd);
        MOERL_CHECK(attempt < 100, "cannot lock ", path, ": it keeps being replaced");
    }
}

}  // namespace moerl::control
