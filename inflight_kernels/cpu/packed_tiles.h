// Byte layouts of the packed quantized weights, shared by the int8-activation GEMMs
// (q8_gemm.cpp, q4_gemm.cpp: the layouts are described there) and the float32-activation
// ones (dequant_gemm.cpp). Both store tiles of 8 output columns; per (tile, block of 32
// inputs):
//   Q4_1: 4 registers of 32 nibble bytes (column c at bytes 4c..4c+3 of each), then the 8
//         columns' fp16 d, then their fp16 m: 160 bytes;
//   Q8_0: 8 registers of 32 int8 (column c at bytes 4c..4c+3, inputs 4j..4j+3 in register j),
//         then 8 int32 VNNI compensations: 288 bytes; the float32 scales in their own tensor.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace packed_tiles {

constexpr int64_t kBlock = 32;  // inputs per scale (llama.cpp's QK4_1 and QK8_0)
constexpr int64_t kCols = 8;    // output columns per tile
constexpr int64_t kQ4NibbleBytes = kBlock * kCols / 2;                  // 128
constexpr int64_t kQ4TileBlockBytes = kQ4NibbleBytes + 2 * kCols * 2;   // 160
constexpr int64_t kQ8TileWeightBytes = kBlock * kCols;                  // 256
constexpr int64_t kQ8TileBlockBytes = kQ8TileWeightBytes + kCols * 4;   // 288

// IEEE half <-> float without F16C (Q4_1's d and m in the scalar builds and the packing).
inline uint16_t to_half(float f) { return c10::Half(f).x; }
inline float from_half(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

}  // namespace packed_tiles
