/*!
 * \file safetensors.cc
 * \brief The .safetensors reader (safetensors.h).
 */
#include "safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "json.h"

namespace mlc_lora {

int DTypeBytes(const std::string& c) {
  if (c == "F64" || c == "I64" || c == "U64") return 8;
  if (c == "F32" || c == "I32" || c == "U32") return 4;
  if (c == "F16" || c == "BF16" || c == "I16" || c == "U16") return 2;
  if (c == "I8" || c == "U8" || c == "BOOL" || c == "F8_E4M3" || c == "F8_E5M2") return 1;
  return 0;
}

SafeTensorsFile::SafeTensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw ModelError("cannot open weights file '" + path + "': " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_size < 8) {
    ::close(fd);
    throw ModelError("'" + path + "' is not a safetensors file: it is too short");
  }
  size_ = static_cast<size_t>(st.st_size);
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw ModelError("cannot map '" + path + "': " + std::strerror(errno));
  }
  const uint8_t* base = static_cast<const uint8_t*>(map_);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  if (header_len > size_ - 8) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw ModelError("'" + path + "' is not a safetensors file: its header size " +
                     std::to_string(header_len) + " exceeds the file");
  }
  const uint8_t* data = base + 8 + header_len;
  size_t data_size = size_ - 8 - header_len;
  try {
    JSON header(tvm::ffi::Any(), "", path);
    try {
      header = JSON::Parse(std::string(reinterpret_cast<const char*>(base + 8), header_len), path);
    } catch (const ModelError&) {
      throw ModelError("'" + path + "' is not a safetensors file: its header is not valid JSON");
    }
    for (const auto& kv : header.members()) {
      if (kv.first == "__metadata__") continue;
      Entry e;
      e.dtype = kv.second["dtype"].str();
      int64_t numel = 1;
      for (const JSON& d : kv.second["shape"].items()) {
        const int64_t n = d.i64();
        if (n < 0 || (n > 0 && numel > static_cast<int64_t>(data_size) / n)) {
          kv.second.Fail("shape has a negative dimension or more elements than the file holds");
        }
        e.shape.push_back(n);
        numel *= n;
      }
      auto offs = kv.second["data_offsets"].items();
      if (offs.size() != 2) kv.second.Fail("data_offsets must have two entries");
      int64_t begin = offs[0].i64(), end = offs[1].i64();
      int bytes = DTypeBytes(e.dtype);
      if (bytes == 0) kv.second.Fail("unsupported dtype '" + e.dtype + "'");
      if (begin < 0 || end < begin || static_cast<size_t>(end) > data_size || end - begin != numel * bytes) {
        kv.second.Fail("data_offsets do not match the shape or lie outside the file");
      }
      e.data = data + begin;
      e.nbytes = static_cast<size_t>(end - begin);
      entries_.emplace(kv.first, std::move(e));
    }
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

SafeTensorsFile::~SafeTensorsFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
  map_ = nullptr;
}

const SafeTensorsFile::Entry& SafeTensorsFile::at(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw ModelError("'" + path_ + "' has no tensor '" + name + "'");
  return it->second;
}

}  // namespace mlc_lora
