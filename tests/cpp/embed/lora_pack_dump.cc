// lora_pack_dump ADAPTER_DIR MODEL_DIR OUT_PREFIX: packs a PEFT folder with the C++ port of
// lora/peft.py + lora/layout.py and writes OUT_PREFIX.{pages,a_off,b_off,scale}.bin and .json
// (rank, pages shape) for lora_pack_parity.py to compare with Python. On an mlc_lora::Error it
// prints "error (<class>): <message>" and exits 1.
#include <fstream>
#include <iostream>
#include <sstream>

#include "json.h"
#include "lora.h"
#include "mlc_lora/error.h"

int main(int argc, char** argv) {
  using namespace mlc_lora;
  if (argc != 4) {
    std::cerr << "usage: lora_pack_dump ADAPTER_DIR MODEL_DIR OUT_PREFIX\n";
    return 2;
  }
  std::string out = argv[3];
  try {
    std::ifstream f(std::string(argv[2]) + "/mlc-lora-config.json");
    std::stringstream ss;
    ss << f.rdbuf();
    detail::JSON cfg = detail::JSON::Parse(ss.str(), "mlc-lora-config.json");
    detail::PackedAdapter p = detail::PackPeftAdapter(argv[1], cfg["model_config"],
                                                      detail::LoraSpec::FromJSON(cfg["lora"]), cfg["dtype"].str(), "test");
    auto dump = [&](const char* what, const void* data, size_t n) {
      std::ofstream o(out + "." + what + ".bin", std::ios::binary);
      o.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    };
    dump("pages", p.pages.data(), p.pages.size());
    dump("a_off", p.a_off.data(), p.a_off.size() * 4);
    dump("b_off", p.b_off.data(), p.b_off.size() * 4);
    dump("scale", p.scale.data(), p.scale.size() * 4);
    std::ofstream(out + ".json") << "{\"rank\": " << p.rank << ", \"shape\": [" << p.num_layers << ", " << p.num_pages
                                 << ", " << p.page_elems << "]}\n";
  } catch (const InvalidArgument& e) {
    std::cout << "error (InvalidArgument): " << e.what() << "\n";
    return 1;
  } catch (const ModelError& e) {
    std::cout << "error (ModelError): " << e.what() << "\n";
    return 1;
  } catch (const Error& e) {
    std::cout << "error (Error): " << e.what() << "\n";
    return 1;
  }
  return 0;
}
