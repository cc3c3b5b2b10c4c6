// The AMX tile set-up shared by serve's tile kernels (csrc/amx.cpp: bf16 GEMMs; csrc/screen_gemm.cpp:
// the head screen's uint8 x int8 sums): eight tiles of 16 rows x 64 bytes, and the OS's grant of
// the tile state (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM), asked for once per process.
#pragma once

#include <immintrin.h>

#include <cstdint>

bool amx_enable();       // csrc/amx.cpp: true once the OS grants the tile state (AMX-BF16 CPUs only)
bool amx_int8_enable();  // csrc/amx.cpp: that, on a CPU with AMX-INT8 as well

namespace warsha {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("amx-tile")

// Every tile 16 rows of 64 bytes: 16 x 32 bf16, 16 x 64 int8 or 16 x 16 float32 / int32. Per thread.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

#pragma GCC pop_options

}  // namespace warsha
