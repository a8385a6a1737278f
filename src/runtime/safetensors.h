/*!
 * \file safetensors.h
 * \brief A memory-mapped .safetensors file: 8-byte little-endian header size, JSON header, raw data.
 *
 * Opening one reads the header only; tensor data is touched when a caller reads it. Used for
 * adapter weights here and for the model's params by the C++ API (cpp/).
 */
#ifndef MLC_LORA_RUNTIME_SAFETENSORS_H_
#define MLC_LORA_RUNTIME_SAFETENSORS_H_

#include <cstdint>
#include <string>
#include <map>
#include <vector>

namespace mlc_lora {

class SafeTensorsFile {
 public:
  struct Entry {
    std::string dtype;  // safetensors code: F32, F16, BF16, I32, ...
    std::vector<int64_t> shape;
    const uint8_t* data;
    size_t nbytes;
  };
  /*!
   * \brief Map and index `path`; throws ModelError on a missing file or one that is not a
   *        safetensors file ("'path' is not a safetensors file: why").
   */
  explicit SafeTensorsFile(const std::string& path);
  ~SafeTensorsFile();
  SafeTensorsFile(const SafeTensorsFile&) = delete;
  SafeTensorsFile& operator=(const SafeTensorsFile&) = delete;

  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  /*! \brief Throws ModelError naming the file when `name` is absent. */
  const Entry& at(const std::string& name) const;
  /*! \brief Every tensor, by name (sorted). */
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, Entry> entries_;
};

/*! \brief Bytes per element of a safetensors dtype code; 0 if unknown. */
int DTypeBytes(const std::string& code);

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_SAFETENSORS_H_
