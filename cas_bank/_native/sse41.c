/* BLAKE3's SSE4.1 code, compiled for SSE4.1 in this file only: blake3_dispatch.c
 * calls it only after its CPU check finds SSE4.1. clang (Apple's included) ignores
 * `#pragma GCC target`: it takes the target as an attribute of every function defined
 * here, its headers included first so that their own functions keep theirs. */
#if defined(__x86_64__) && defined(__clang__)
#include "blake3/blake3_impl.h"
#include <immintrin.h>
#pragma clang attribute push(__attribute__((target("sse4.1"))), apply_to = function)
#include "blake3/blake3_sse41.c"
#pragma clang attribute pop
#elif defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("sse4.1")
#include "blake3/blake3_sse41.c"
#endif
