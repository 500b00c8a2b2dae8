// AMX helpers shared by our kernels: the tile configuration they use and the per-process permission.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

#define KAKEYA_AMX 1

namespace kakeya_amx {

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the AMX tile state on request, once per process. KAKEYA_AMX=0 declines it, so a machine with
// AMX can run (and test) the AVX-512 paths that CPUs without it take.
inline bool permitted() {
  static const bool ok = [] {
    const char* env = std::getenv("KAKEYA_AMX");
    if (env != nullptr && env[0] == '0') return false;
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Which kernels run on AMX tiles in this process, when permitted: the start-up calibration's choice
// (models/native.py, measured once per machine and cached), set before the first call and then fixed, so every
// call of the process computes alike. Off: the AVX-512 (BF16) paths.
inline std::atomic<bool> attention_on{true};
inline std::atomic<bool> linear_on{true};

// ldtilecfg from `cfg`. The barrier makes the stores that filled it happen first: GCC does not see the instruction
// read the struct, and dropped them in a variant of configure() that skipped unchanged configurations (a zeroed
// configuration: SIGSEGV); nothing kept the shipped version from the same fate.
inline void load_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Every tile 16 rows x 64 bytes: C (16 x 16 fp32), A (16 rows x 32 bf16), B (16 pair-rows x 16 columns).
// `rows` < 16: tiles 0-4 (C tiles and the A tile of the attention kernel) that many rows, for a few query rows: a
// tdpbf16ps costs about one pass per row of A, and a tile store a line per row; tiles 5-7 (its B tiles 6, 7) keep 16.
inline void configure(int rows = 16) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 5 ? static_cast<uint8_t>(rows) : 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

// The attention kernel's decode layout, for `rows` < 16 query rows: scores as K . Q^T (the keys as A, straight from
// the cache; tile 2 the scores, 16 keys x `rows`; tile 3 Q^T in pairs, 16 pair-rows x `rows`), then P . V on C
// tiles 0-1 and A tile 4 of `rows` rows; tile 5 the keys (16 x 32 bf16), tiles 6-7 V in pairs (16 x 64 bytes).
inline void configure_decode(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    const bool narrow_rows = t < 2 || t == 4;
    cfg.rows[t] = narrow_rows ? static_cast<uint8_t>(rows) : 16;
    cfg.colsb[t] = t == 2 || t == 3 ? static_cast<uint16_t>(4 * rows) : 64;
  }
  load_config(cfg);
}

// Tile rows are 64 bytes: buffers that tiles load from start on a cache line, so no row straddles two.
template <typename T>
struct AlignedBuffer {
  T* data = nullptr;
  explicit AlignedBuffer(size_t n) : data(static_cast<T*>(std::aligned_alloc(64, ((n * sizeof(T) + 63) / 64) * 64))) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

}  // namespace kakeya_amx
#endif
