// GGUF blocks -> the packed tiles the linear ops read (quant_linear.h's PackedLayout), and
// rows read back out of them (a token embedding kept only as its tied head's tiles).
//
// Each GGUF block is decoded to its values' integer codes and its scales as stored, then
// written into the tile lanes of its column: nothing is rounded, so the tiles define the
// same numbers as the file (tests/test_dequant_linear.py checks every type against gguf's
// own dequantiser).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "quant_linear.h"
#include "vec.h"

namespace pagedserve::quant {
namespace {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// bf16 bits widened to fp32: the same number (bf16 is fp32's upper half).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t{h} << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// fp16 bits of -scale * (fp16 bits h), a power of two: exact unless it overflows fp16.
inline uint16_t scaled_half(uint16_t h, float scale) {
  const float v = -scale * _cvtsh_ss(h);
  TORCH_CHECK(std::abs(v) <= 65504.0f, "quant_repack: a block scale of ", _cvtsh_ss(h),
              " has no exact fp16 offset; the block cannot be packed");
  return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
}

inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// Bytes 8v .. 8v+3 (`hi` false) or 8v+4 .. 8v+7 of the 32 codes, byte t of the word holding
// value 8v + t or 8v + 4 + t: the layout's four byte lanes, handled in one word (byte-wise,
// as SWAR: every shift below stays inside its byte after its mask).
inline uint32_t code_word(const uint8_t (&q)[kBlock], int v, bool hi) { return load_u32(q + 8 * v + 4 * hi); }

// One column's 32 codes (0..63) into a tile at `tile` (after its scale bytes `scale_bytes`):
// nibbles, or crumbs (`bits` 2: two groups of 8 values to a vector), with `hi_bits` (0, 1 or
// 2) bits above them in planes after them. Word-wise, four lanes at a time: a 1B Q4_K_M's
// repack took 0.43 s byte by byte, 0.24 s so (one thread).
void put_codes(uint8_t* tile, int64_t scale_bytes, int bits, int hi_bits, int j, const uint8_t (&q)[kBlock]) {
  constexpr uint32_t kBit0 = 0x01010101, kLow2 = 0x03030303;
  const uint32_t mask = bits == 4 ? 0x0F0F0F0F : kLow2;
  const int per = 8 / (2 * bits);  // groups of 8 values per vector
  uint8_t* codes = tile + scale_bytes;
  for (int vec = 0; vec < 4 / per; ++vec) {
    uint32_t word = 0;
    for (int u = 0; u < per; ++u) {
      const int v = per * vec + u, at = 2 * bits * u;
      word |= ((code_word(q, v, false) & mask) << at) | ((code_word(q, v, true) & mask) << (at + bits));
    }
    store_u32(codes + 32 * vec + 4 * j, word);
  }
  // Bits above the codes, byte-aligned with them so that the int8 op builds code bytes
  // with a shift and a mask: plane byte t of lane j holds, for value 8v + t and 8v + 4 + t,
  // the next bit at bits 2v and 2v + 1 (one plane); bits 4-5 at bits 4(v % 2) and
  // 4(v % 2) + 2 of plane v / 2 (two planes, nibbles only).
  uint8_t* hi = codes + 32 * bits;
  if (hi_bits == 1) {
    uint32_t plane = 0;
    for (int v = 0; v < 4; ++v)
      plane |= (((code_word(q, v, false) >> bits) & kBit0) << (2 * v)) |
               (((code_word(q, v, true) >> bits) & kBit0) << (2 * v + 1));
    store_u32(hi + 4 * j, plane);
  } else if (hi_bits == 2) {
    for (int h = 0; h < 2; ++h) {
      uint32_t plane = 0;
      for (int u = 0; u < 2; ++u) {
        const int v = 2 * h + u;
        plane |= (((code_word(q, v, false) >> 4) & kLow2) << (4 * u)) |
                 (((code_word(q, v, true) >> 4) & kLow2) << (4 * u + 2));
      }
      store_u32(hi + 32 * h + 4 * j, plane);
    }
  }
}

// Q4_K / Q5_K's 6-bit scale and min of block s, packed in 12 bytes (ggml's get_scale_min_k4).
inline void k4_scale_min(const uint8_t* sc, int s, uint8_t& scale, uint8_t& min) {
  if (s < 4) {
    scale = sc[s] & 63;
    min = sc[s + 4] & 63;
  } else {
    scale = (sc[s + 4] & 0x0F) | ((sc[s - 4] >> 6) << 4);
    min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

// Q4_0 / Q4_1's block: d, then m (Q4_0's offset -8d as Q4_1's min), then the nibbles.
void pack_q4(int64_t qtype, const uint8_t* src, uint8_t* dst, int j) {
  uint8_t q[kBlock];
  const uint8_t* qs = src + (qtype == kQ4_1 ? 4 : 2);
  const uint16_t m = qtype == kQ4_1 ? load_u16(src + 2) : scaled_half(load_u16(src), 8.0f);
  std::memcpy(dst + 2 * j, src, 2);
  std::memcpy(dst + 16 + 2 * j, &m, 2);
  for (int i = 0; i < 16; ++i) {
    q[i] = qs[i] & 0x0F;
    q[i + 16] = qs[i] >> 4;
  }
  put_codes(dst, 32, 4, 0, j, q);
}

// Q5_0 / Q5_1's block: as Q4_0 / Q4_1's (Q5_0's offset -16d), the fifth bits from qh.
void pack_q5(int64_t qtype, const uint8_t* src, uint8_t* dst, int j) {
  uint8_t q[kBlock];
  const int64_t at = qtype == kQ5_1 ? 4 : 2;
  const uint32_t qh = load_u32(src + at);
  const uint8_t* qs = src + at + 4;
  const uint16_t m = qtype == kQ5_1 ? load_u16(src + 2) : scaled_half(load_u16(src), 16.0f);
  std::memcpy(dst + 2 * j, src, 2);
  std::memcpy(dst + 16 + 2 * j, &m, 2);
  for (int i = 0; i < 16; ++i) {
    q[i] = (qs[i] & 0x0F) | (((qh >> i) & 1) << 4);
    q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
  }
  put_codes(dst, 32, 4, 1, j, q);
}

// Q4_K / Q5_K's super-block (`five`: Q5_K's, with qh's fifth bits).
void pack_k4(bool five, const uint8_t* src, uint8_t* dst, int j, const PackedLayout& L) {
  uint8_t q[kBlock];
  const uint8_t* scales = src + 4;
  const uint8_t* qh = src + 16;
  const uint8_t* qs = src + (five ? 48 : 16);
  std::memcpy(dst + 2 * j, src, 2);
  std::memcpy(dst + 16 + 2 * j, src + 2, 2);
  for (int s = 0; s < 8; ++s) {  // block s: nibbles of bytes 32 (s / 2) .. + 31, low for even s
    uint8_t* tile = dst + L.header + s * L.tile;
    k4_scale_min(scales, s, tile[j], tile[8 + j]);
    const uint8_t* bytes = qs + 32 * (s / 2);
    for (int l = 0; l < 32; ++l) {
      q[l] = (s % 2 ? bytes[l] >> 4 : bytes[l] & 0x0F);
      if (five) q[l] |= ((qh[l] >> s) & 1) << 4;
    }
    put_codes(tile, 16, 4, five ? 1 : 0, j, q);
  }
}

void pack_q6_k(const uint8_t* src, uint8_t* dst, int j, const PackedLayout& L) {
  uint8_t q[kBlock];
  const uint8_t *ql = src, *qh = src + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(src + 192);
  std::memcpy(dst + 2 * j, src + 208, 2);
  for (int s = 0; s < 8; ++s) {
    // Value y = 128n + 32k + l sits in ql[64n + l (+32 for odd k)] (low nibble for
    // k < 2) and bits 2k, 2k+1 of qh[32n + l].
    const int n = s / 4, k = s % 4;
    uint8_t* tile = dst + L.header + s * L.tile;
    std::memcpy(tile + j, &scales[2 * s], 1);
    std::memcpy(tile + 8 + j, &scales[2 * s + 1], 1);
    for (int l = 0; l < 32; ++l) {
      const uint8_t low = ql[64 * n + l + 32 * (k % 2)];
      q[l] = (k < 2 ? low & 0x0F : low >> 4) | (((qh[32 * n + l] >> (2 * k)) & 3) << 4);
    }
    put_codes(tile, 16, 4, 2, j, q);
  }
}

// Value y = 128n + 32k + l: bits 2k, 2k + 1 of qs[32n + l], and bit 4n + k of hmask[l]
// (set: no offset; the tile's code is q + 4 with m = -4 d); 16 scales of 6 bits, low
// nibbles in bytes 0-7, top bits in 8-11 (ggml's dequantize_row_q3_K).
void pack_q3_k(const uint8_t* src, uint8_t* dst, int j, const PackedLayout& L) {
  uint8_t q[kBlock];
  const uint8_t *hmask = src, *qs = src + 32, *sc = src + 96;
  std::memcpy(dst + 2 * j, src + 108, 2);
  for (int s = 0; s < 8; ++s) {
    const int n = s / 4, k = s % 4;
    uint8_t* tile = dst + L.header + s * L.tile;
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * s + h;
      const int scale = ((i < 8 ? sc[i] & 0x0F : sc[i - 8] >> 4) | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4));
      tile[8 * h + j] = static_cast<uint8_t>(scale - 32);
    }
    for (int l = 0; l < 32; ++l) q[l] = ((qs[32 * n + l] >> (2 * k)) & 3) | (((hmask[l] >> s) & 1) << 2);
    put_codes(tile, 16, 2, 1, j, q);
  }
}

// IQ4_NL's block: d, then the nibbles (indices into the IQ4 book).
void pack_iq4_nl(const uint8_t* src, uint8_t* dst, int j) {
  uint8_t q[kBlock];
  std::memcpy(dst + 2 * j, src, 2);
  for (int i = 0; i < 16; ++i) {
    q[i] = src[2 + i] & 0x0F;
    q[i + 16] = src[2 + i] >> 4;
  }
  put_codes(dst, 16, 4, 0, j, q);
}

// bf16 bits of MXFP4's half scale 2^(e - 128) for an E8M0 byte e (ggml's
// ggml_e8m0_to_fp32_half): a normal number's exponent field e - 1, or for e < 2 a subnormal.
inline uint16_t e8m0_half_bf16(uint8_t e) {
  return e < 2 ? static_cast<uint16_t>(0x0020 << e) : static_cast<uint16_t>((e - 1) << 7);
}

// MXFP4's block: the E8M0 byte as the book's half scale, then the nibbles (indices into the
// doubled E2M1 book), laid out as IQ4_NL's.
void pack_mxfp4(const uint8_t* src, uint8_t* dst, int j) {
  uint8_t q[kBlock];
  const uint16_t d = e8m0_half_bf16(src[0]);
  std::memcpy(dst + 2 * j, &d, 2);
  for (int i = 0; i < 16; ++i) {
    q[i] = src[1 + i] & 0x0F;
    q[i + 16] = src[1 + i] >> 4;
  }
  put_codes(dst, 16, 4, 0, j, q);
}

// Block s's 6-bit scale: nibble s % 2 of scales_l[s / 2], top bits 2s, 2s + 1 of
// scales_h; its nibbles as IQ4_NL's, at qs + 16 s (ggml's dequantize_row_iq4_xs).
void pack_iq4_xs(const uint8_t* src, uint8_t* dst, int j, const PackedLayout& L) {
  uint8_t q[kBlock];
  const uint16_t high = load_u16(src + 2);
  std::memcpy(dst + 2 * j, src, 2);
  for (int s = 0; s < 8; ++s) {
    uint8_t* tile = dst + L.header + s * L.tile;
    const int scale = ((src[4 + s / 2] >> (4 * (s % 2))) & 0x0F) | (((high >> (2 * s)) & 3) << 4);
    tile[j] = static_cast<uint8_t>(scale - 32);
    const uint8_t* qs = src + 8 + 16 * s;
    for (int i = 0; i < 16; ++i) {
      q[i] = qs[i] & 0x0F;
      q[i + 16] = qs[i] >> 4;
    }
    put_codes(tile, 8, 4, 0, j, q);
  }
}

// Value y = 128n + 32k + l: bits 2k, 2k + 1 of qs[32n + l]; byte y / 16 of the scales
// holds its 4-bit scale and, above it, its min (ggml's dequantize_row_q2_K).
void pack_q2_k(const uint8_t* src, uint8_t* dst, int j, const PackedLayout& L) {
  uint8_t q[kBlock];
  const uint8_t* qs = src + 16;
  std::memcpy(dst + 2 * j, src + 80, 2);
  std::memcpy(dst + 16 + 2 * j, src + 82, 2);
  for (int s = 0; s < 8; ++s) {
    const int n = s / 4, k = s % 4;
    uint8_t* tile = dst + L.header + s * L.tile;
    tile[j] = src[2 * s];
    tile[8 + j] = src[2 * s + 1];
    for (int l = 0; l < 32; ++l) q[l] = (qs[32 * n + l] >> (2 * k)) & 3;
    put_codes(tile, 16, 2, 0, j, q);
  }
}

// Column j's GGUF block `src` into super-tile `dst` (header, then the block tiles).
void pack_column(int64_t qtype, const uint8_t* src, uint8_t* dst, int j) {
  const PackedLayout L = packed_layout(qtype);
  switch (qtype) {
    case kF16:
    case kBF16:
      for (int k = 0; k < kBlock; ++k) std::memcpy(dst + 16 * k + 2 * j, src + 2 * k, 2);
      return;
    case kQ8_0:
      std::memcpy(dst + 2 * j, src, 2);
      for (int c = 0; c < 8; ++c) std::memcpy(dst + 16 + 32 * c + 4 * j, src + 2 + 4 * c, 4);
      return;
    case kQ4_0:
    case kQ4_1: return pack_q4(qtype, src, dst, j);
    case kQ5_0:
    case kQ5_1: return pack_q5(qtype, src, dst, j);
    case kQ4_K:
    case kQ5_K: return pack_k4(qtype == kQ5_K, src, dst, j, L);
    case kQ6_K: return pack_q6_k(src, dst, j, L);
    case kQ3_K: return pack_q3_k(src, dst, j, L);
    case kIQ4_NL: return pack_iq4_nl(src, dst, j);
    case kIQ4_XS: return pack_iq4_xs(src, dst, j, L);
    case kMXFP4: return pack_mxfp4(src, dst, j);
    case kQ2_K: return pack_q2_k(src, dst, j, L);
  }
}

// GGUF blocks, the rows of `parts` stacked ([N, row bytes] in all), -> packed [ceil(N/8),
// super-blocks per row, super bytes]; columns past N in the last tile are zero (scale 0), so
// they add nothing. Packing the parts of a fused matrix (q, k, v) straight into one output
// spares a concatenation of them or of their tiles: each would be a copy of the matrix whose
// freed pages the allocator keeps (a 1B model's load held ~110 MB more so).
at::Tensor quant_repack(const std::vector<at::Tensor>& parts, int64_t qtype) {
  const PackedLayout L = packed_layout(qtype);
  TORCH_CHECK(L.blocks != 0, "quant_repack: qtype must be a GGML type id of F16 (1), Q4_0 (2), Q4_1 (3), Q5_0 (6), "
              "Q5_1 (7), Q8_0 (8), Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K (14), IQ4_NL (20), IQ4_XS (23), "
              "BF16 (30) or MXFP4 (39), got ", qtype);
  TORCH_CHECK(!parts.empty(), "quant_repack: no blocks");
  const int64_t row_bytes = parts[0].dim() == 2 ? parts[0].size(1) : -1;
  std::vector<const uint8_t*> rows;  // each row's blocks, in the stacked order
  for (const at::Tensor& part : parts) {
    TORCH_CHECK(part.scalar_type() == at::kByte && part.dim() == 2 && part.size(1) == row_bytes &&
                    (part.size(1) <= 1 || part.stride(1) == 1),
                "quant_repack: blocks must be uint8 [rows, row bytes] tensors of one width, each row contiguous");
    const uint8_t* base = part.data_ptr<uint8_t>();
    for (int64_t r = 0; r < part.size(0); ++r) rows.push_back(base + r * part.stride(0));
  }
  TORCH_CHECK(row_bytes % L.gguf_bytes == 0, "quant_repack: row bytes ", row_bytes, " not a multiple of ",
              L.gguf_bytes);
  const int64_t n = static_cast<int64_t>(rows.size()), ns = row_bytes / L.gguf_bytes;
  const int64_t ng = (n + kTileCols - 1) / kTileCols, group_bytes = ns * L.super_bytes();
  at::Tensor packed = at::empty({ng, ns, L.super_bytes()}, parts[0].options());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, ng, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      // Zeroed (the columns past N stay so) group by group, just before it is written, rather
      // than by at::zeros: one pass over the model's bytes fewer.
      std::memset(dst + g * group_bytes, 0, group_bytes);
      for (int64_t s = 0; s < ns; ++s)
        for (int j = 0; j < kTileCols && g * kTileCols + j < n; ++j)
          pack_column(qtype, rows[g * kTileCols + j] + s * L.gguf_bytes, dst + (g * ns + s) * L.super_bytes(), j);
    }
  });
  return packed;
}

// Lane j's 32 values of one block tile: the fp32 numbers dequant_linear computes, by the
// same operations (d * s exact, then one fma per value).
void unpack_lane(int64_t qtype, const uint8_t* hdr, const uint8_t* tile, int j, float* out) {
  if (is_half(qtype)) {
    for (int i = 0; i < 32; ++i) {
      const uint16_t h = load_u16(tile + 16 * i + 2 * j);
      out[i] = qtype == kF16 ? _cvtsh_ss(h) : bf16_to_float(h);
    }
    return;
  }
  if (qtype == kQ8_0) {
    const float d = _cvtsh_ss(load_u16(tile + 2 * j));
    for (int i = 0; i < 32; ++i)
      out[i] = d * static_cast<float>(static_cast<int8_t>(tile[16 + 32 * (i / 4) + 4 * j + i % 4]));
    return;
  }
  const PackedLayout L = packed_layout(qtype);
  const int bits = code_bits(qtype), hi = hi_bits(qtype);
  const uint8_t* codes = tile + scale_bytes(qtype);
  for (int i = 0; i < 32; ++i) {
    const int v = i / 8, t = i % 8, high = t >= 4;
    const int vec = bits == 2 ? v / 2 : v, at = (bits == 2 ? 4 * (v % 2) : 0) + bits * high;
    uint32_t q = (codes[32 * vec + 4 * j + t % 4] >> at) & ((1 << bits) - 1);
    if (hi == 1) q |= ((codes[32 * bits + 4 * j + t % 4] >> (2 * v + high)) & 1) << bits;
    if (hi == 2) q |= ((codes[128 + 32 * (v / 2) + 4 * j + t % 4] >> (4 * (v % 2) + 2 * high)) & 3) << 4;
    float d, m;
    if (is_book(qtype)) {
      d = qtype == kMXFP4 ? bf16_to_float(load_u16(tile + 2 * j))
          : L.blocks == 1 ? _cvtsh_ss(load_u16(tile + 2 * j))
                          : _cvtsh_ss(load_u16(hdr + 2 * j)) * static_cast<float>(static_cast<int8_t>(tile[j]));
      out[i] = d * book_of(qtype).f32[q];
      continue;
    }
    if (L.blocks == 1) {
      d = _cvtsh_ss(load_u16(tile + 2 * j));
      m = _cvtsh_ss(load_u16(tile + 16 + 2 * j));
    } else if (per_half(qtype)) {
      const uint8_t scale = tile[8 * (i / 16) + j];  // this value's half's scale byte
      if (qtype == kQ2_K) {
        d = _cvtsh_ss(load_u16(hdr + 2 * j)) * static_cast<float>(scale & 0x0F);
        m = -(_cvtsh_ss(load_u16(hdr + 16 + 2 * j)) * static_cast<float>(scale >> 4));
      } else {
        d = _cvtsh_ss(load_u16(hdr + 2 * j)) * static_cast<float>(static_cast<int8_t>(scale));
        m = d * -static_cast<float>(sym_offset(qtype));
      }
    } else {
      d = _cvtsh_ss(load_u16(hdr + 2 * j)) * static_cast<float>(tile[j]);
      m = -(_cvtsh_ss(load_u16(hdr + 16 + 2 * j)) * static_cast<float>(tile[8 + j]));
    }
    out[i] = std::fma(static_cast<float>(q), d, m);
  }
}

// Rows `ids` of the matrix packed in `packed` (quant_repack's output for `qtype`), fp32
// [len(ids), K]: a token embedding read from the tiles its tied LM head multiplies with.
at::Tensor quant_unpack_rows(const at::Tensor& packed, int64_t qtype, const at::Tensor& ids) {
  const PackedLayout L = packed_layout(qtype);
  TORCH_CHECK(L.blocks != 0, "quant_unpack_rows: qtype ", qtype, " is not a GGML type id quant_repack packs");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == L.super_bytes(),
              "quant_unpack_rows: packed must come from quant_repack with the same qtype");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_unpack_rows: ids must be int64 [n]");
  const at::Tensor index = ids.contiguous();
  const int64_t n = index.size(0), ns = packed.size(1), k = ns * L.blocks * kBlock;
  const int64_t rows = packed.size(0) * kTileCols;
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kFloat));
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(id[r] >= 0 && id[r] < rows, "quant_unpack_rows: row ", id[r], " out of range");
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* group = src + (id[r] / kTileCols) * ns * L.super_bytes();
      for (int64_t b = 0; b < ns * L.blocks; ++b) {
        const uint8_t* hdr = group + (b / L.blocks) * L.super_bytes();
        unpack_lane(qtype, hdr, hdr + L.header + (b % L.blocks) * L.tile, static_cast<int>(id[r] % kTileCols),
                    dst + r * k + b * kBlock);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quant_repack(Tensor[] parts, int qtype) -> Tensor", &quant_repack);
  m.def("quant_unpack_rows(Tensor packed, int qtype, Tensor ids) -> Tensor", &quant_unpack_rows);
}

}  // namespace pagedserve::quant
