/*!
 * \file lora_layout.h
 * \brief Adapter rows in the unified page pool: the one implementation of the page layout and of
 *        packing an adapter into the pool's input (pool_load_adapter).
 *
 * A page is E = 2 * h_kv * page_size * head_dim elements per layer (one KV page of one layer). An
 * adapter of rank r stores, for every module m it targets, r rows of A (length in_m) and r rows of
 * B^T (length out_m); a row never crosses a page and every layer uses the same layout. Rows are
 * placed best-fit-decreasing (longest rows first, each into the fullest page that still has
 * room), which lets short rows fill the tail of pages holding long ones (docs/DESIGN.md).
 *
 * Rows are stored in the model dtype, or (a model compiled with `--lora-rows int8`) as int8 values
 * with a float32 scale per row: the contract's int8_row_align bytes before the values hold the
 * scale (the rest zero), the values follow, padded to a multiple of int8_row_align; a row's offset
 * points at its first value, so the scale is at the offset less int8_row_align bytes. Row k's
 * values are q_i = round_half_even(w_i / s) in [-127, 127] with s = max_i |w_i| / 127 (s = 0 and
 * q = 0 for a zero row); the kernels read q_i * s rounded to the model dtype (RowFormat,
 * QuantizeRow; python/mlc_lora/lora/layout.py holds their references).
 *
 * Under tensor parallelism the spec's module shapes are one shard's: every shard's pool holds its
 * slices of each adapter (column-parallel modules: all of A, their output columns of B^T;
 * row-parallel ones: their input columns of A, all of B^T), and every shard has the same layout.
 *
 * Bad input throws mlc_lora::InvalidArgument (an adapter that does not fit the compiled model),
 * ModelError (a config without the needed blocks) or NotAvailable (a model dtype without pages).
 */
#ifndef MLC_LORA_RUNTIME_LORA_LAYOUT_H_
#define MLC_LORA_RUNTIME_LORA_LAYOUT_H_

#include <tvm/ffi/container/tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "contract.h"
#include "json.h"

namespace mlc_lora {

/*! \brief How a row of n values is stored in the pages (see the file comment). */
struct RowFormat {
  int64_t elem_bytes = 2;  // the pages' dtype
  int64_t align = 0;       // int8 rows: the contract's int8_row_align; 0: rows in the model dtype
  /*!
   * \brief "model" or "int8" (the config's lora "rows") on pages of `elem_bytes`-byte elements, int8
   *        rows laid out by `int8_align` (the contract's); bad input throws InvalidArgument.
   */
  static RowFormat Of(const std::string& rows, int64_t elem_bytes, int64_t int8_align);
  bool int8() const { return align > 0; }
  /*! \brief Page elements a row of n values takes, its scale included. */
  int64_t Elems(int64_t n) const;
  /*! \brief Page elements before a row's first value (its scale). */
  int64_t Lead() const { return align / elem_bytes; }
};

/*!
 * \brief int8 values and the scale of one row of n floats (see the file comment); false if the row
 *        holds a value that is not finite (nothing written then).
 */
bool QuantizeRow(const float* w, int64_t n, int8_t* q, float* scale);

struct LoraModule {
  std::string name;
  int64_t in_features, out_features;
};

/*! \brief What a model was compiled for: the "lora", "contract" and "dtype" of its config. */
struct LoraSpec {
  int64_t num_layers = 0, page_elems = 0, max_rank = 0, pool_pages = 0, shards = 1;
  std::vector<LoraModule> modules;  // compiled modules, canonical order, one shard's shapes
  std::string kernel;
  std::string dtype;  // the model's (and the pages') dtype: float32, float16 or bfloat16
  std::string rows = "model";  // how adapter rows are stored: "model" (its dtype) or "int8"
  /*! \brief The row format of this spec's pages. */
  RowFormat Rows() const;
  Contract contract;

  /*!
   * \brief From a compiled config (mlc-lora-config.json, or {"lora", "contract", "dtype"}).
   *        Throws InvalidArgument when the model was compiled without LoRA.
   */
  static LoraSpec FromConfig(const JSON& config);
  /*! \brief Index of compiled module `name`, -1 if it was not compiled. */
  int64_t Index(const std::string& name) const;
  /*! \brief (in, out) of compiled module `m` before tensor-parallel slicing. */
  std::pair<int64_t, int64_t> FullShape(const LoraModule& m) const;
  /*! \brief "q_proj, v_proj": the compiled modules, for messages. */
  std::string ModuleList() const;
};

/*! \brief Where every row of one adapter lives: local offsets local_page * E + offset_in_page. */
struct AdapterLayout {
  int64_t num_pages = 0, used_elems = 0;
  std::vector<int32_t> a_off, b_off;  // [modules.size(), rank]
};

/*!
 * \brief Best-fit-decreasing placement of the A and B^T rows of `modules` at `rank`, each row taking
 *        `rows.Elems(its length)` elements; offsets point at the rows' first values.
 */
AdapterLayout LayoutAdapter(int64_t page_elems, const std::vector<LoraModule>& modules, int64_t rank,
                            const RowFormat& rows = RowFormat{});

/*! \brief The input of pool_load_adapter, plus what the engines show about the adapter. */
struct PackedAdapter {
  tvm::ffi::Tensor pages;  // [L, n, E] in the model dtype, host memory
  tvm::ffi::Tensor a_off;  // int32 [M, R], local offsets, -1 unused
  tvm::ffi::Tensor b_off;  // int32 [M, R]
  tvm::ffi::Tensor scale;  // float32 [M], 0 for modules the adapter does not target
  int64_t rank = 0;
  std::string name;
  std::vector<std::string> modules;       // targeted modules, canonical order
  std::map<std::string, double> scales;   // module -> its table scale
  std::vector<std::string> warnings;      // what the caller should pass on to its user
};

/*!
 * \brief The rows of one adapter at full (unsharded) size, float32: row k of A (length in) or of
 *        B^T (length out) of (layer, module). Rows k >= the module's own rank are zero.
 */
class AdapterRows {
 public:
  virtual ~AdapterRows() = default;
  virtual bool Has(int64_t layer, const std::string& module) const = 0;
  virtual void Row(int64_t layer, const std::string& module, bool b, int64_t k, float* out) const = 0;
  /*!
   * \brief The fast path of packing: elements [from, from + n) of the same row written straight in
   *        the pages' 16-bit `dtype` to `dst`, where the source holds exactly those values (no
   *        rounding, no scaling) and the whole row is finite. False where it cannot (PackAdapter
   *        then takes Row), so that the pages and every error are bitwise those of Row.
   */
  virtual bool RawRow(int64_t layer, const std::string& module, bool b, int64_t k, DLDataType dtype,
                      int64_t from, int64_t n, uint16_t* dst) const {
    return false;
  }
};

/*!
 * \brief Pack an adapter of `rank` on `modules` (canonical order) with table scales `scales` for
 *        shard `shard` of a model compiled with `spec`. Checks the rank and the modules first.
 */
PackedAdapter PackAdapter(const LoraSpec& spec, const std::string& name, int64_t rank,
                          const std::vector<std::string>& modules,
                          const std::map<std::string, double>& scales, const AdapterRows& rows,
                          int64_t shard);

/*! \brief Python's repr of a list of strings: ['a', 'b'] (messages match the Python side). */
std::string PyList(const std::vector<std::string>& items);

}  // namespace mlc_lora

#endif  // MLC_LORA_RUNTIME_LORA_LAYOUT_H_
