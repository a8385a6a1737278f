// Raw file input/output of the emulation drivers (gemv_emu.cc, sgmv_emu.cc): the tests write the
// kernels' inputs with numpy's tofile and read the outputs back with fromfile.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

template <class E>
std::vector<E> read(const std::string& p, size_t n) {
  std::vector<E> v(n);
  FILE* f = fopen(p.c_str(), "rb");
  if (!f || fread(v.data(), sizeof(E), n, f) != n) {
    fprintf(stderr, "cannot read %zu items from %s\n", n, p.c_str());
    exit(1);
  }
  fclose(f);
  return v;
}

template <class E>
void write(const std::string& p, const std::vector<E>& v) {
  FILE* f = fopen(p.c_str(), "wb");
  fwrite(v.data(), sizeof(E), v.size(), f);
  fclose(f);
}
