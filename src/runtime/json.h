/*!
 * \file json.h
 * \brief A read-only view over tvm-ffi's parsed JSON that throws ModelError naming the JSON path.
 *
 * Shared by the runtime's adapter packing (adapter_config.json, safetensors headers, the compiled
 * config) and the C++ API (cpp/), which includes it from here.
 */
#ifndef MLC_LORA_RUNTIME_JSON_H_
#define MLC_LORA_RUNTIME_JSON_H_

#include <tvm/ffi/extra/json.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mlc_lora/error.h"

namespace mlc_lora {

class JSON {
 public:
  JSON(tvm::ffi::Any v, std::string path, std::string origin)
      : v_(std::move(v)), path_(std::move(path)), origin_(std::move(origin)) {}

  /*! \brief Parse `text`; `origin` (a file name) prefixes error messages. */
  static JSON Parse(const std::string& text, const std::string& origin) {
    tvm::ffi::String err;
    tvm::ffi::Any v = tvm::ffi::json::Parse(text, &err);
    if (!err.empty()) throw ModelError(origin + " is not valid JSON: " + std::string(err));
    return JSON(std::move(v), "", origin);
  }

  bool is_null() const { return v_ == nullptr; }
  bool is_object() const { return v_.as<tvm::ffi::json::Object>().has_value(); }
  bool is_array() const { return v_.as<tvm::ffi::json::Array>().has_value(); }
  bool is_string() const { return v_.as<tvm::ffi::String>().has_value(); }
  bool is_int() const { return v_.as<int64_t>().has_value(); }
  bool is_bool() const { return v_.as<bool>().has_value(); }
  bool is_number() const { return !is_bool() && v_.try_cast<double>().has_value(); }

  bool has(const std::string& key) const {
    auto o = v_.as<tvm::ffi::json::Object>();
    return o.has_value() && o->count(tvm::ffi::String(key)) && !((*o)[tvm::ffi::String(key)] == nullptr);
  }
  /*! \brief Whether this is an object with member `key` (even a null one). */
  bool contains(const std::string& key) const {
    auto o = v_.as<tvm::ffi::json::Object>();
    return o.has_value() && o->count(tvm::ffi::String(key));
  }
  /*! \brief Member `key`; throws if this is not an object or the key is missing. */
  JSON operator[](const std::string& key) const {
    auto o = object();
    auto it = o.find(tvm::ffi::String(key));
    if (it == o.end()) Fail("missing key '" + key + "'", path_);
    return JSON((*it).second, path_ + "." + key, origin_);
  }
  /*! \brief Member `key` or null when missing. */
  JSON get(const std::string& key) const {
    auto o = object();
    auto it = o.find(tvm::ffi::String(key));
    return JSON(it == o.end() ? tvm::ffi::Any() : (*it).second, path_ + "." + key, origin_);
  }
  std::vector<JSON> items() const {
    auto a = v_.as<tvm::ffi::json::Array>();
    if (!a.has_value()) Fail("expected an array");
    std::vector<JSON> out;
    out.reserve(a->size());
    for (size_t i = 0; i < a->size(); ++i) {
      out.emplace_back((*a)[i], path_ + "[" + std::to_string(i) + "]", origin_);
    }
    return out;
  }
  std::vector<std::pair<std::string, JSON>> members() const {
    std::vector<std::pair<std::string, JSON>> out;
    for (const auto& kv : object()) {
      std::string k(kv.first.cast<tvm::ffi::String>());
      out.emplace_back(k, JSON(kv.second, path_ + "." + k, origin_));
    }
    return out;
  }
  std::string str() const {
    auto s = v_.as<tvm::ffi::String>();
    if (!s.has_value()) Fail("expected a string");
    return std::string(*s);
  }
  int64_t i64() const {
    auto i = v_.as<int64_t>();
    if (!i.has_value()) Fail("expected an integer");
    return *i;
  }
  double f64() const {
    auto d = v_.try_cast<double>();
    if (!d.has_value()) Fail("expected a number");
    return *d;
  }
  bool boolean() const {
    auto b = v_.as<bool>();
    if (!b.has_value()) Fail("expected true or false");
    return *b;
  }
  std::string str_or(const std::string& dflt) const { return is_null() ? dflt : str(); }
  bool bool_or(bool dflt) const { return is_null() ? dflt : boolean(); }
  int64_t i64_or(int64_t dflt) const { return is_null() ? dflt : i64(); }
  const std::string& path() const { return path_; }
  /*! \brief The parsed value itself. */
  const tvm::ffi::Any& value() const { return v_; }
  /*! \brief Compact JSON text of the value. */
  std::string dump() const { return std::string(tvm::ffi::json::Stringify(v_)); }

  [[noreturn]] void Fail(const std::string& what) const { Fail(what, path_); }

 private:
  tvm::ffi::json::Object object() const {
    auto o = v_.as<tvm::ffi::json::Object>();
    if (!o.has_value()) Fail("expected an object");
    return *o;
  }
  [[noreturn]] void Fail(const std::string& what, const std::string& at) const {
    throw ModelError(origin_ + ": " + (at.empty() ? std::string("<root>") : at.substr(1)) + ": " + what);
  }

  tvm::ffi::Any v_;
  std::string path_;
  std::string origin_;
};

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_JSON_H_
