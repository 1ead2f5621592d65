#include "file_util.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "moerl/core/error.hpp"

namespace moerl::model::detail {

std::string read_text_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    MOERL_CHECK(in.good(), "cannot open ", path, ": ", std::strerror(errno));
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

AtomicWriter::AtomicWriter(const std::string& path)
    : path_(path), tmp_(path + ".tmp." + std::to_string(getpid())) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    MOERL_CHECK(fd_ >= 0, "cannot create ", tmp_, ": ", std::strerror(errno));
}

AtomicWriter::~AtomicWriter() {
    if (fd_ >= 0) {
        ::close(fd_);
        ::unlink(tmp_.c_str());
    }
}

void AtomicWriter::write(const void* data, size_t size) {
    MOERL_CHECK(fd_ >= 0, "write to ", path_, " after commit");
    const char* p = static_cast<const char*>(data);
    size_t left = size;
    while (left > 0) {
        ssize_t n = ::write(fd_, p, left);
        if (n < 0 && errno == EINTR) continue;
        MOERL_CHECK(n > 0, "writing ", path_, " failed after ", written_, " bytes: ", std::strerror(errno));
        p += n;
        left -= static_cast<size_t>(n);
        written_ += static_cast<size_t>(n);
    }
}

void AtomicWriter::commit() {
    MOERL_CHECK(fd_ >= 0, "commit of ", path_, " twice");
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0 || ::rename(tmp_.c_str(), path_.c_str()) != 0) {
        int err = errno;
        ::unlink(tmp_.c_str());
        MOERL_FAIL("finishing ", path_, " failed: ", std::strerror(err));
    }
}

void write_file_atomic(const std::string& path, const void* data, size_t size) {
    AtomicWriter w(path);
    w.write(data, size);
    w.commit();
}

std::string join_path(const std::string& dir, const std::string& name) {
    if (dir.empty() || dir.back() == '/') return dir + name;
    return dir + "/" + name;
}

}  // namespace moerl::model::detail
