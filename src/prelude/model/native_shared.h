/* What several of the model's C files share. native_lib.py builds each C file on its own
 * (one library each) and keys its cached library by the file and the local headers it
 * includes, so a change here rebuilds every includer. */
#ifndef PRELUDE_NATIVE_SHARED_H
#define PRELUDE_NATIVE_SHARED_H

#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* [*u0, *u1): the calling OpenMP thread's contiguous share of `units` work units. */
static inline void this_threads_share(int64_t units, int64_t *u0, int64_t *u1) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
#else
    const int64_t t = 0, n = 1;
#endif
    *u0 = units * t / n;
    *u1 = units * (t + 1) / n;
}

/* Whether Linux lets this process use the AMX tile registers (each process asks once; the
 * answer is cached, per library). */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

#if defined(__AMX_TILE__)
#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* This thread's eight tiles, each 16 rows x 64 bytes. */
static inline void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
