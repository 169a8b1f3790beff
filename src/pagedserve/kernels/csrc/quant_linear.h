// Weight-only quantised linear layers with llama.cpp's block formats (GGML type ids):
//   Q4_0 (2):  fp16 d, 16 bytes of nibbles          w = d * (q - 8)
//   Q4_1 (3):  fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
//   Q8_0 (8):  fp16 d, 32 int8                      w = d * q
// A block covers 32 consecutive input values of one output row; in a 4-bit block byte j
// holds value j in its low nibble and value j + 16 in its high nibble.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace pagedserve::quant {

constexpr int64_t kBlock = 32;    // input values per block
constexpr int64_t kTileCols = 8;  // output columns interleaved in a packed tile (one ymm of fp32 results)

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

// Bytes of one block as GGUF stores it.
inline int64_t gguf_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: return 0;
  }
}

// Bytes of one packed tile (8 columns x one block). Q8_0: 8 fp16 scales, then eight
// 32-byte chunks; chunk c holds bytes 4c..4c+3 of each column's block (column j in
// 32-bit lane j), so one 4-byte broadcast of the activations meets all 8 columns.
// Q4_0 and Q4_1 share a layout: 8 fp16 scales, 8 fp16 mins (Q4_0 stores m = -8d, exact
// in fp16), then four 32-byte vectors whose low nibbles are chunk 2v and high nibbles
// chunk 2v+1 in the same lane order.
inline int64_t tile_bytes(int64_t qtype) { return qtype == kQ8_0 ? 16 + 8 * 32 : 32 + 4 * 32; }

// The arguments of a linear op on packed tiles, checked (errors name `op`), with the
// output allocated and the bias padded to whole tiles (the epilogues read a full tile).
struct TiledLinear {
  at::Tensor in;           // x, contiguous
  at::Tensor out;          // [..., out_features], uninitialised
  at::Tensor bias_padded;  // [tiles * 8] or undefined
  int64_t k, nb, ng, m;    // input features, blocks per row, tile groups, rows
};
TiledLinear check_tiled_linear(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                               int64_t out_features, const std::optional<at::Tensor>& bias);

}  // namespace pagedserve::quant
