/* BLAKE3's SSE4.1 code, compiled for SSE4.1 in this file only: blake3_dispatch.c
 * calls it only after its CPU check finds SSE4.1. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("sse4.1")
#include "blake3/blake3_sse41.c"
#endif
