// Safetensors files (memory-mapped, header validated) and Hugging Face checkpoint directories
// (model.safetensors, or shards listed by model.safetensors.index.json). No LibTorch here.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace moerl::model {

enum class StDType : uint8_t { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

size_t st_dtype_size(StDType t);
std::string st_dtype_name(StDType t);             // "F32", "BF16", ...
StDType parse_st_dtype(const std::string& name);  // throws naming the unknown dtype

struct TensorInfo {
    std::string name;
    StDType dtype = StDType::kF32;
    std::vector<int64_t> shape;
    uint64_t offset = 0;  // from the start of the data region (after the header)
    uint64_t nbytes = 0;
    int64_t numel() const;
};

// The header of a safetensors file held in memory: `bytes` is the whole file (8-byte length, JSON
// header, data region). Checked as SafetensorsFile describes; `source` names the file in errors.
struct SafetensorsHeader {
    std::vector<TensorInfo> tensors;  // in header order
    std::map<std::string, std::string> metadata;
    uint64_t data_offset = 0;  // where the data region starts
};
SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, uint64_t size, const std::string& source);

// A read-only, memory-mapped safetensors file. The header is checked on open: JSON well formed,
// every dtype known, shapes non-negative, nbytes = numel x dtype size, ranges inside the file and
// disjoint. Errors name the file and the offending tensor.
class SafetensorsFile {
  public:
    explicit SafetensorsFile(const std::string& path);
    ~SafetensorsFile();
    SafetensorsFile(const SafetensorsFile&) = delete;
    SafetensorsFile& operator=(const SafetensorsFile&) = delete;

    const std::string& path() const { return path_; }
    uint64_t file_size() const { return file_size_; }
    const std::vector<TensorInfo>& tensors() const { return tensors_; }
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    // nullptr when absent.
    const TensorInfo* find(const std::string& name) const;
    const uint8_t* data(const TensorInfo& info) const { return data_ + info.offset; }

  private:
    std::string path_;
    uint64_t file_size_ = 0;
    void* map_ = nullptr;
    const uint8_t* data_ = nullptr;
    std::vector<TensorInfo> tensors_;
    std::map<std::string, size_t> by_name_;
    std::map<std::string, std::string> metadata_;
};

// One tensor to write: raw little-endian bytes of `shape` elements of `dtype`.
struct TensorBytes {
    std::string name;
    StDType dtype = StDType::kF32;
    std::vector<int64_t> shape;
    const void* data = nullptr;
    uint64_t nbytes = 0;
};

// Writes one safetensors file atomically (temporary file + rename), tensors in the given order.
void write_safetensors(const std::string& path, const std::vector<TensorBytes>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Writes `tensors` into `dir` as model.safetensors when they fit in `max_shard_bytes` (0 = no
// limit), otherwise as model-0000i-of-0000n.safetensors plus model.safetensors.index.json.
// Returns the file names written.
std::vector<std::string> write_sharded(const std::string& dir, const std::vector<TensorBytes>& tensors,
                                       uint64_t max_shard_bytes);
std::string shard_file_name(int index, int count);  // index from 0: "model-00001-of-00004.safetensors"
// Writes model.safetensors.index.json mapping each tensor to its file.
void write_index(const std::string& dir, const std::map<std::string, std::string>& weight_map,
                 uint64_t total_size);

// A checkpoint directory opened for reading. Shards are mapped on first use.
class CheckpointReader {
  public:
    explicit CheckpointReader(const std::string& dir);
    ~CheckpointReader();
    CheckpointReader(const CheckpointReader&) = delete;
    CheckpointReader& operator=(const CheckpointReader&) = delete;

    const std::string& dir() const { return dir_; }
    std::vector<std::string> names() const;
    std::vector<std::string> files() const;
    bool contains(const std::string& name) const { return weight_map_.count(name) > 0; }
    // Throws "tensor NAME not found in checkpoint DIR" when absent.
    const TensorInfo& info(const std::string& name);
    const uint8_t* data(const std::string& name);

  private:
    SafetensorsFile& file(const std::string& file_name);

    std::string dir_;
    std::map<std::string, std::string> weight_map_;  // tensor name -> file name
    std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace moerl::model
