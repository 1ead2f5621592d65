#include "moerl/model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "file_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/json.hpp"

namespace moerl::model {
namespace {

using nlohmann::json;

struct DTypeEntry {
    StDType type;
    const char* name;
    size_t size;
};
constexpr DTypeEntry kDTypes[] = {{StDType::kF64, "F64", 8}, {StDType::kF32, "F32", 4},
                                  {StDType::kF16, "F16", 2}, {StDType::kBF16, "BF16", 2},
                                  {StDType::kI64, "I64", 8}, {StDType::kI32, "I32", 4},
                                  {StDType::kI16, "I16", 2}, {StDType::kI8, "I8", 1},
                                  {StDType::kU8, "U8", 1},   {StDType::kBool, "BOOL", 1}};

// Largest header the format allows (the reference implementation uses the same bound).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string shape_str(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

}  // namespace

size_t st_dtype_size(StDType t) {
    for (const auto& e : kDTypes) {
        if (e.type == t) return e.size;
    }
    MOERL_FAIL("unknown safetensors dtype ", static_cast<int>(t));
}

std::string st_dtype_name(StDType t) {
    for (const auto& e : kDTypes) {
        if (e.type == t) return e.name;
    }
    MOERL_FAIL("unknown safetensors dtype ", static_cast<int>(t));
}

StDType parse_st_dtype(const std::string& name) {
    for (const auto& e : kDTypes) {
        if (name == e.name) return e.type;
    }
    MOERL_FAIL("dtype \"", name,
               "\" is not supported, expected one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL");
}

int64_t TensorInfo::numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
}

SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, uint64_t size, const std::string& source) {
    SafetensorsHeader out;
    MOERL_CHECK(size >= 8, source, ": file is ", size,
                " bytes, too short for a safetensors header (8-byte length + JSON)");
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];  // little-endian u64
    MOERL_CHECK(header_len <= kMaxHeaderBytes, source, ": header length ", header_len, " exceeds the ",
                kMaxHeaderBytes, "-byte limit (corrupt file?)");
    MOERL_CHECK(header_len <= size - 8, source, ": header length ", header_len,
                " runs past the end of the file (", size, " bytes; truncated?)");
    out.data_offset = 8 + header_len;
    const uint64_t data_size = size - 8 - header_len;

    json header;
    try {
        header = parse_json(bytes + 8, bytes + 8 + header_len, source);
    } catch (const json::exception& e) {
        MOERL_FAIL(source, ": header is not valid JSON (", e.what(), ")");
    }
    MOERL_CHECK(header.is_object(), source, ": header must be a JSON object");
    for (auto it = header.begin(); it != header.end(); ++it) {
        const std::string& name = it.key();
        const json& v = it.value();
        if (name == "__metadata__") {
            MOERL_CHECK(v.is_object(), source, ": __metadata__ must be an object of strings");
            for (auto m = v.begin(); m != v.end(); ++m) {
                MOERL_CHECK(m.value().is_string(), source, ": __metadata__.", m.key(), " must be a string");
                out.metadata[m.key()] = m.value().get<std::string>();
            }
            continue;
        }
        MOERL_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
                    source, ": tensor ", name, " needs dtype, shape and data_offsets, got ", v.dump());
        TensorInfo info;
        info.name = name;
        MOERL_CHECK(v["dtype"].is_string(), source, ": tensor ", name, ": dtype must be a string");
        try {
            info.dtype = parse_st_dtype(v["dtype"].get<std::string>());
        } catch (const Error& e) {
            MOERL_FAIL(source, ": tensor ", name, ": ", e.message());
        }
        MOERL_CHECK(v["shape"].is_array(), source, ": tensor ", name, ": shape must be a list");
        uint64_t numel = 1;
        for (const json& d : v["shape"]) {
            MOERL_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, source, ": tensor ", name,
                        ": shape entries must be non-negative integers, got ", d.dump());
            const uint64_t s = d.get<uint64_t>();
            MOERL_CHECK(s == 0 || numel <= UINT64_MAX / s / 8, source, ": tensor ", name, ": shape ",
                        v["shape"].dump(), " overflows");
            numel *= s;
            info.shape.push_back(static_cast<int64_t>(s));
        }
        const json& off = v["data_offsets"];
        MOERL_CHECK(
            off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
            source, ": tensor ", name, ": data_offsets must be [begin, end], got ", off.dump());
        const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
        MOERL_CHECK(begin <= end, source, ": tensor ", name, ": data_offsets ", off.dump(),
                    " has begin > end");
        info.offset = begin;
        info.nbytes = end - begin;
        const uint64_t expect = numel * st_dtype_size(info.dtype);
        MOERL_CHECK(info.nbytes == expect, source, ": tensor ", name, ": data_offsets ", off.dump(), " span ",
                    info.nbytes, " bytes, but shape ", shape_str(info.shape), " of ",
                    st_dtype_name(info.dtype), " needs ", expect, " bytes");
        MOERL_CHECK(end <= data_size, source, ": tensor ", name, ": data_offsets ", off.dump(),
                    " run past the end of the data region (", data_size, " bytes; truncated file?)");
        out.tensors.push_back(std::move(info));
    }
    std::vector<const TensorInfo*> order;
    for (const auto& t : out.tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(),
              [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < order.size(); ++i) {
        const TensorInfo& a = *order[i - 1];
        const TensorInfo& b = *order[i];
        MOERL_CHECK(a.offset + a.nbytes <= b.offset || a.nbytes == 0 || b.nbytes == 0, source, ": tensors ",
                    a.name, " [", a.offset, ", ", a.offset + a.nbytes, ") and ", b.name, " [", b.offset, ", ",
                    b.offset + b.nbytes, ") overlap");
    }
    return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    MOERL_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        MOERL_FAIL("cannot stat ", path, ": ", std::strerror(err));
    }
    file_size_ = static_cast<uint64_t>(st.st_size);
    if (file_size_ > 0) {
        map_ = ::mmap(nullptr, file_size_, PROT_READ, MAP_PRIVATE, fd, 0);
        int err = errno;
        ::close(fd);
        if (map_ == MAP_FAILED) {
            map_ = nullptr;
            MOERL_FAIL("cannot map ", path, ": ", std::strerror(err));
        }
    } else {
        ::close(fd);
    }
    // Member initialisation is done; from here errors must release the mapping.
    try {
        SafetensorsHeader header =
            parse_safetensors_header(static_cast<const uint8_t*>(map_), file_size_, path);
        data_ = static_cast<const uint8_t*>(map_) + header.data_offset;
        tensors_ = std::move(header.tensors);
        metadata_ = std::move(header.metadata);
        for (size_t i = 0; i < tensors_.size(); ++i) by_name_[tensors_[i].name] = i;
    } catch (...) {
        if (map_) ::munmap(map_, file_size_);
        map_ = nullptr;
        throw;
    }
}

SafetensorsFile::~SafetensorsFile() {
    if (map_) ::munmap(map_, file_size_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void write_safetensors(const std::string& path, const std::vector<TensorBytes>& tensors,
                       const std::map<std::string, std::string>& metadata) {
    json header = json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    uint64_t offset = 0;
    for (const auto& t : tensors) {
        uint64_t numel = 1;
        for (int64_t s : t.shape) {
            MOERL_CHECK(s >= 0, "tensor ", t.name, ": negative dimension in shape ", shape_str(t.shape));
            numel *= static_cast<uint64_t>(s);
        }
        MOERL_CHECK(numel * st_dtype_size(t.dtype) == t.nbytes, "tensor ", t.name, ": ", t.nbytes,
                    " bytes given, but shape ", shape_str(t.shape), " of ", st_dtype_name(t.dtype), " needs ",
                    numel * st_dtype_size(t.dtype));
        MOERL_CHECK(!header.contains(t.name), "tensor ", t.name, " is listed twice");
        header[t.name] = {{"dtype", st_dtype_name(t.dtype)},
                          {"shape", t.shape},
                          {"data_offsets", {offset, offset + t.nbytes}}};
        offset += t.nbytes;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data region 8-byte aligned
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    detail::AtomicWriter w(path);
    w.write(len, 8);
    w.write(text.data(), text.size());
    for (const auto& t : tensors) w.write(t.data, t.nbytes);
    w.commit();
}

std::string shard_file_name(int index, int count) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", index + 1, count);
    return buf;
}

void write_index(const std::string& dir, const std::map<std::string, std::string>& weight_map,
                 uint64_t total_size) {
    json j = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
    detail::write_file_atomic(detail::join_path(dir, "model.safetensors.index.json"), j.dump(2) + "\n");
}

std::vector<std::string> write_sharded(const std::string& dir, const std::vector<TensorBytes>& tensors,
                                       uint64_t max_shard_bytes) {
    std::filesystem::create_directories(dir);
    std::vector<std::vector<TensorBytes>> shards(1);
    uint64_t in_shard = 0, total = 0;
    for (const auto& t : tensors) {
        if (max_shard_bytes > 0 && in_shard > 0 && in_shard + t.nbytes > max_shard_bytes) {
            shards.emplace_back();
            in_shard = 0;
        }
        shards.back().push_back(t);
        in_shard += t.nbytes;
        total += t.nbytes;
    }
    std::vector<std::string> files;
    const int count = static_cast<int>(shards.size());
    if (count == 1) {
        write_safetensors(detail::join_path(dir, "model.safetensors"), shards[0]);
        std::filesystem::remove(detail::join_path(dir, "model.safetensors.index.json"));
        return {"model.safetensors"};
    }
    std::map<std::string, std::string> weight_map;
    for (int i = 0; i < count; ++i) {
        files.push_back(shard_file_name(i, count));
        write_safetensors(detail::join_path(dir, files.back()), shards[i]);
        for (const auto& t : shards[i]) weight_map[t.name] = files.back();
    }
    // The index goes last: a reader that finds it finds every shard it names.
    write_index(dir, weight_map, total);
    std::filesystem::remove(detail::join_path(dir, "model.safetensors"));
    return files;
}

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(dir) {
    const std::string index_path = detail::join_path(dir, "model.safetensors.index.json");
    const std::string single_path = detail::join_path(dir, "model.safetensors");
    if (std::filesystem::exists(index_path)) {
        json j;
        try {
            j = parse_json(detail::read_text_file(index_path), index_path);
        } catch (const json::exception& e) {
            MOERL_FAIL(index_path, ": not valid JSON (", e.what(), ")");
        }
        MOERL_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index_path,
                    ": expected an object with a weight_map object");
        for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
            MOERL_CHECK(it.value().is_string(), index_path, ": weight_map.", it.key(),
                        " must be a file name");
            const std::string file = it.value().get<std::string>();
            MOERL_CHECK(file.find('/') == std::string::npos && file != ".." && !file.empty(), index_path,
                        ": weight_map.", it.key(), " = \"", file,
                        "\" must be a file name inside the directory");
            weight_map_[it.key()] = file;
        }
    } else if (std::filesystem::exists(single_path)) {
        auto& f = file("model.safetensors");
        for (const auto& t : f.tensors()) weight_map_[t.name] = "model.safetensors";
    } else {
        MOERL_FAIL("checkpoint ", dir, " has neither model.safetensors nor model.safetensors.index.json");
    }
}

CheckpointReader::~CheckpointReader() = default;

std::vector<std::string> CheckpointReader::names() const {
    std::vector<std::string> out;
    for (const auto& [name, file] : weight_map_) out.push_back(name);
    return out;
}

std::vector<std::string> CheckpointReader::files() const {
    std::vector<std::string> out;
    for (const auto& [name, file] : weight_map_) {
        if (std::find(out.begin(), out.end(), file) == out.end()) out.push_back(file);
    }
    std::sort(out.begin(), out.end());
    return out;
}

SafetensorsFile& CheckpointReader::file(const std::string& file_name) {
    auto it = files_.find(file_name);
    if (it == files_.end()) {
        it = files_.emplace(file_name, std::make_unique<SafetensorsFile>(detail::join_path(dir_, file_name)))
                 .first;
    }
    return *it->second;
}

const TensorInfo& CheckpointReader::info(const std::string& name) {
    auto it = weight_map_.find(name);
    MOERL_CHECK(it != weight_map_.end(), "tensor ", name, " not found in checkpoint ", dir_);
    const TensorInfo* t = file(it->second).find(name);
    MOERL_CHECK(t != nullptr, "checkpoint ", dir_, ": the index maps tensor ", name, " to ", it->second,
                ", but that file has no such tensor");
    return *t;
}

const uint8_t* CheckpointReader::data(const std::string& name) {
    const TensorInfo& t = info(name);
    return file(weight_map_.at(name)).data(t);
}

}  // namespace moerl::model
