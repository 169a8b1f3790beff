// Weight-only quantised linear layers on llama.cpp's block formats (GGML type ids):
//   Q4_0 (2):  fp16 d, 16 bytes of nibbles          w = d * (q - 8)
//   Q4_1 (3):  fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
//   Q5_0 (6), Q5_1 (7): as Q4_0 / Q4_1 with a fifth bit per value (q - 16 for Q5_0)
//   Q8_0 (8):  fp16 d, 32 int8                      w = d * q
//   Q4_K (12), Q5_K (13): super-blocks of 256 = 8 blocks of 32, fp16 d and dmin, a 6-bit
//     scale s and min n per block: w = (d * s) * q - (dmin * n), q of 4 or 5 bits
//   Q6_K (14): super-blocks of 256, fp16 d, an int8 scale per 16 values: w = (d * s) * (q - 32)
//   Q3_K (11): as Q6_K with 3-bit q and a 6-bit scale s (stored s + 32): w = (d * s) * (q - 4)
//   Q2_K (10): super-blocks of 256, fp16 d and dmin, a 4-bit scale s and min n per 16
//     values: w = (d * s) * q - (dmin * n), q of 2 bits
//   IQ4_NL (20): fp16 d, 16 bytes of nibbles indexing llama.cpp's code book (kvalues_iq4nl,
//     16 int8 from -127 to 113)                     w = d * book[q]
//   IQ4_XS (23): super-blocks of 256, fp16 d, a 6-bit scale s per block (stored s + 32), nibbles
//     as IQ4_NL's                                   w = (d * s) * book[q]
//   MXFP4 (39): an E8M0 scale byte e (2^(e - 127)), 16 bytes of nibbles, each an E2M1 code
//     (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6)  w = 2^(e - 127) * fp4[q]
//     = 2^(e - 128) * book[q], book = the codes doubled (ggml's kvalues_mxfp4: 0, 1, 2, 3, 4, 6, 8, 12
//     and their negatives), so that the book is small integers as IQ4_NL's is
//   F16 (1), BF16 (30): the weights as stored, 2 bytes each, no scale (a "block" is 32 of them)
// A block covers 32 consecutive input values of one output row; in a 4-bit block byte j
// holds value j in its low nibble and value j + 16 in its high nibble.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace pagedserve::quant {

constexpr int64_t kBlock = 32;    // input values per block
constexpr int64_t kTileCols = 8;  // output columns interleaved in a packed tile (one ymm of fp32 results)

enum QType : int64_t {
  kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30, kMXFP4 = 39
};

// How quant_repack lays out a type's weights for 8 output columns: per super-block (256
// values for K-quants, one block of 32 otherwise) a header, then one tile per block of 32.
// Within a tile, lane j (4 bytes of each 32-byte vector) belongs to column j:
//   Q8_0:       [8 fp16 d][8 x 32: chunk c holds values 4c..4c+3]
//   Q4_0, Q4_1: [8 fp16 d][8 fp16 m][4 x 32: vector v's byte t holds value 8v+t low, 8v+4+t high]
//               (Q4_0 stores m = -8d, exact in fp16)
//   Q5_0, Q5_1: the Q4 tile, then 32 bytes of fifth bits (m = -16d): byte t of lane j has
//               value 8v+t's at bit 2v and 8v+4+t's at bit 2v+1, beside the nibbles they extend
//   Q4_K, Q5_K: header [8 fp16 d][8 fp16 dmin]; tile [8 u8 s][8 u8 n][nibbles as Q4][Q5's bits]
//   Q6_K:       header [8 fp16 d]; tile [8 int8 s of values 0-15][8 of 16-31][nibbles as Q4]
//               [2 x 32: bits 4-5 of value 8v+t at bits 4(v%2), of 8v+4+t at 4(v%2)+2, in byte t
//               of lane j of vector v/2]
//   Q3_K:       header [8 fp16 d]; tile [8 int8 s of values 0-15][8 of 16-31][2 x 32 of 2-bit
//               codes: value 8v+t at bits 4(v%2), 8v+4+t at 4(v%2)+2 of byte t of lane j of
//               vector v/2][32: the third bit, placed as Q5's fifth]
//   Q2_K:       header [8 fp16 d][8 fp16 dmin]; tile [8 u8 s | n << 4 of values 0-15][8 of
//               16-31][2-bit codes as Q3_K]
//   IQ4_NL:     [8 fp16 d][nibbles as Q4]
//   IQ4_XS:     header [8 fp16 d]; tile [8 int8 s][nibbles as Q4]
//   MXFP4:      [8 bf16 d = 2^(e - 128), the book's half scale][nibbles as Q4] (bf16 holds every
//               2^(e - 128), e = 0 .. 255, exactly: 8 bits of exponent and, for e < 2, a subnormal)
// (so each packs into the bytes of its file, +3.6% for Q3_K and +5.9% for MXFP4, whose scale
// byte grows to bf16: no type grows past its bits)
//   F16, BF16:  tile [32 x 16: row k holds value k of the 8 columns, 2 bytes each]
// (F16 and BF16 values widen to fp32 exactly, so their weights too are the fp32 numbers the
// file defines; nothing multiplies them.)
// Each value is then one fma of its integer code with two fp32 numbers made exactly from
// the file's (d * s has at most 18 significant bits): the fp32 value the file defines.
struct PackedLayout {
  int64_t blocks;      // blocks of 32 per super-block (0: a type with no layout)
  int64_t header;      // header bytes per super-block
  int64_t tile;        // bytes per block tile
  int64_t gguf_bytes;  // bytes of one GGUF block (of 32 or 256 values)
  constexpr int64_t super_bytes() const { return header + blocks * tile; }
};

constexpr PackedLayout packed_layout(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {1, 0, 32 + 128, 18};
    case kQ4_1: return {1, 0, 32 + 128, 20};
    case kQ5_0: return {1, 0, 32 + 128 + 32, 22};
    case kQ5_1: return {1, 0, 32 + 128 + 32, 24};
    case kQ8_0: return {1, 0, 16 + 256, 34};
    case kQ4_K: return {8, 32, 16 + 128, 144};
    case kQ5_K: return {8, 32, 16 + 128 + 32, 176};
    case kQ6_K: return {8, 16, 16 + 128 + 64, 210};
    case kQ3_K: return {8, 16, 16 + 64 + 32, 110};
    case kQ2_K: return {8, 32, 16 + 64, 84};
    case kIQ4_NL: return {1, 0, 16 + 128, 18};
    case kMXFP4: return {1, 0, 16 + 128, 17};
    case kIQ4_XS: return {8, 16, 8 + 128, 136};
    case kF16:
    case kBF16: return {1, 0, 32 * 16, 64};
    default: return {0, 0, 0, 0};
  }
}

// Bits per code in the packed vectors (4: nibbles; 2: Q2_K/Q3_K's crumbs), bits of a code
// above those (planes after them), and the bytes of a tile's scales before them.
constexpr int code_bits(int64_t qtype) { return qtype == kQ2_K || qtype == kQ3_K ? 2 : 4; }
constexpr int hi_bits(int64_t qtype) {
  return qtype == kQ6_K ? 2 : (qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ5_K || qtype == kQ3_K) ? 1 : 0;
}
// The types scaled per 16 values (two halves of each block of 32), and of those the
// symmetric ones' code offset (w = d * (q - offset)), 0 for the others.
constexpr bool per_half(int64_t qtype) { return qtype == kQ2_K || qtype == kQ3_K || qtype == kQ6_K; }
constexpr int sym_offset(int64_t qtype) { return qtype == kQ6_K ? 32 : qtype == kQ3_K ? 4 : 0; }
constexpr int64_t scale_bytes(int64_t qtype) {
  return qtype == kIQ4_NL || qtype == kMXFP4 ? 16 : qtype == kIQ4_XS ? 8 : packed_layout(qtype).blocks == 1 ? 32 : 16;
}
// The types whose nibbles index a code book (no min: w = d * book[q]): the IQ4 book, or
// MXFP4's doubled E2M1 codes.
constexpr bool is_book(int64_t qtype) { return qtype == kIQ4_NL || qtype == kIQ4_XS || qtype == kMXFP4; }
// llama.cpp's IQ4 code book (ggml-common.h kvalues_iq4nl) and MXFP4's (kvalues_mxfp4: E2M1
// codes 0-7 times 2, then the same negated; code 8 is -0, which adds as 0 does).
inline constexpr int8_t kIq4Book[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
inline constexpr int8_t kMxfp4Book[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// A book as 16 fp32 (the fp32 op's lookup), int8 (the AVX2 int8 op's) and bytes + 128 (the
// VNNI op's unsigned side).
struct BookTables {
  alignas(64) float f32[16];
  alignas(16) int8_t i8[16];
  alignas(16) uint8_t u8[16];
};
constexpr BookTables book_tables(const int8_t (&book)[16]) {
  BookTables t{};
  for (int i = 0; i < 16; ++i) {
    t.f32[i] = book[i];
    t.i8[i] = book[i];
    t.u8[i] = static_cast<uint8_t>(book[i] + 128);
  }
  return t;
}
inline constexpr BookTables kIq4 = book_tables(kIq4Book);
inline constexpr BookTables kMxfp4 = book_tables(kMxfp4Book);
// The book a type's nibbles index.
constexpr const BookTables& book_of(int64_t qtype) { return qtype == kMXFP4 ? kMxfp4 : kIq4; }

// Weights stored as 16-bit floats: read by the fp32 op only (there is no int8 form of them).
constexpr bool is_half(int64_t qtype) { return qtype == kF16 || qtype == kBF16; }

// Bytes of one Q4_0 / Q4_1 / Q8_0 tile (the int8 op's types: one block per super-block).
inline int64_t tile_bytes(int64_t qtype) { return packed_layout(qtype).tile; }

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

// Tiles t0 .. t0 + nt - 1 of a packed matrix (`stride` bytes apart, nb blocks of 32 a row)
// for m rows of x [m, k], into out [m, out_features]: one thread's share of dequant_linear
// (dequant_linear.cpp), also run by the MoE experts' op on each expert's tiles.
void dequant_tiles(int64_t qtype, int64_t t0, int64_t nt, int64_t m, const uint8_t* tiles, int64_t stride, int64_t nb,
                   const float* x, int64_t k, float* out, int64_t out_features, const float* bias, bool avx512);

// Rows of activations as quant_linear quantises them (quant_linear.cpp's quantize_row): per
// row, per block of 32, int8 codes with one fp32 scale, the scaled code sum (the Q4 min
// term) and the integer sums of each 16 codes (Q6_K's offset). Row r's are at from(r).
struct Int8Rows {
  const int8_t* q;           // [m, k]
  const int8_t* q_offset;    // [m, k] the codes + 128 (VNNI's unsigned side for Q8_0 tiles), or nullptr
  const float* scale;        // [m, nb]
  const float* scaled_sum;   // [m, nb]
  const int32_t* half_sums;  // [m, 2 nb]
  int64_t k, nb;
  Int8Rows from(int64_t row) const {
    return {q + row * k, q_offset ? q_offset + row * k : nullptr, scale + row * nb, scaled_sum + row * nb,
            half_sums + row * 2 * nb, k, nb};
  }
};
struct Int8Activations {
  at::Tensor q, q_offset, scales, half_sums;  // the buffers `rows` points into
  Int8Rows rows;
};
// x [m, k] (k a multiple of 32) quantised, rows in parallel; `with_offset`: also q_offset,
// which quant_tiles reads for Q8_0 tiles on the VNNI path.
Int8Activations quantize_activations(const float* x, int64_t m, int64_t k, bool with_offset,
                                     const at::TensorOptions& options);

// Tile groups per task of quant_linear's parallel loop: VNNI runs four whole tiles at once.
constexpr int64_t quant_task_groups(bool vnni) { return vnni ? 4 : 1; }

// Tile groups g0 .. g1 - 1 (one task: g0 a multiple of quant_task_groups) of a packed matrix
// (`stride` bytes a group) for the m rows of `a`, into out [m, out_features]: one task of
// quant_linear, also run by the MoE experts' int8 op on each expert's tiles. A row's bits
// depend on neither m, the task split nor `vnni` (the path), only on the row and the matrix.
void quant_tiles(int64_t qtype, int64_t g0, int64_t g1, int64_t m, const uint8_t* tiles, int64_t stride,
                 const Int8Rows& a, float* out, int64_t out_features, const float* bias, bool vnni);

}  // namespace pagedserve::quant
