/* The native helpers' cores, built for the CPU at hand or another (make test-native:
 * aarch64 with NEON, and x86-64 run on a CPU without AVX2, under qemu-user).
 *
 * 1. chain hashes (cas_bank/_native/chain.c) against the golden vectors of
 *    docs/design.md, "Hashing (format v1)";
 * 2. `fill` (cas_bank/_native/fill.c) of a payload file written by the package's own
 *    codec (tests/native/make_cases.py) into rows: verified, every byte where it
 *    belongs and nothing else touched;
 * 3. the same file with one byte flipped (in the body, then in the head): refused;
 *    a missing file and a short one: their codes;
 * 4. `copy_runs` (a lease into a restore's rows, streamed on x86-64): every byte
 *    where it belongs, none past a run;
 * 5. `pair_run` (pair.h: this thread and the partner thread share a counter): every
 *    piece done exactly once and done when it returns, over many calls (a call the
 *    partner has not begun is taken back, one it has begun is waited for), and the
 *    same from a forked child, which starts a partner of its own.
 *
 * Usage: test_native CASE_DIR. Exit status 0 when all pass; each failure is a line.
 */
#define CAS_BANK_CORE_ONLY 1
#include "../../cas_bank/_native/chain.c"
#include "../../cas_bank/_native/fill.c"

#include <stdio.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int failures = 0;

#define CHECK(cond, ...)                    \
  do {                                      \
    if (!(cond)) {                          \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);         \
      fputc('\n', stderr);                  \
      failures++;                           \
    }                                       \
  } while (0)

static void unhex(const char *hex, uint8_t *out) {
  for (size_t i = 0; hex[2 * i]; i++) sscanf(hex + 2 * i, "%2hhx", &out[i]);
}

static void put_u32(uint8_t *at, uint32_t v) {
  for (int k = 0; k < 4; k++) at[k] = (uint8_t)(v >> (8 * k));
}

static void check_chain(const char *root_hex, const uint32_t *tokens, size_t n_full,
                        const char *const *want_hex) {
  uint8_t root[32] = {0}, data[64], got[2 * 32], want[32];
  if (root_hex) unhex(root_hex, root);
  for (size_t i = 0; i < n_full * 4; i++) put_u32(data + 4 * i, tokens[i]);
  chain_hashes(root, data, n_full, 16, "cas_bank 2026-11-29 block chain v1", got);
  for (size_t b = 0; b < n_full; b++) {
    unhex(want_hex[b], want);
    CHECK(memcmp(got + 32 * b, want, 32) == 0, "chain block %zu differs from its golden vector", b);
  }
}

/* The prefix keys (cas_bank.index.prefixes) of tokens 0..n-1 as <u4 under a root of
 * zeros, segments of `step` bytes: the last one against its golden vector (at block
 * size 4 a segment is one BLAKE3 chunk; at 64, 16 chunks: the SIMD paths). */
static void check_prefix(size_t n, size_t step, const char *want_hex) {
  uint8_t root[32] = {0}, want[32], got[3 * 32];
  uint8_t *data = malloc(4 * n);
  if (data == NULL) exit(2);
  for (size_t i = 0; i < n; i++) put_u32(data + 4 * i, (uint32_t)i);
  size_t made = prefix_keys(root, data, 4 * n, step, 0, "cas_bank 2026-12-06 chain prefix v1", got);
  CHECK(made == 3, "%zu prefix keys of %zu tokens, not 3", made, n);
  unhex(want_hex, want);
  CHECK(memcmp(got + 2 * 32, want, 32) == 0, "prefix key of %zu tokens differs", n);
  free(data);
}

static uint8_t *slurp(const char *dir, const char *name, size_t *len) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    perror(path);
    exit(2);
  }
  fseek(f, 0, SEEK_END);
  *len = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *buf = malloc(*len + 1);
  if (buf == NULL || fread(buf, 1, *len, f) != *len) exit(2);
  fclose(f);
  return buf;
}

static void spit(const char *path, const uint8_t *buf, size_t len) {
  FILE *f = fopen(path, "wb");
  if (f == NULL || fwrite(buf, 1, len, f) != len) exit(2);
  fclose(f);
}

enum { MAX_ARRAYS = 8 };

/* pair_run's work: `n` pieces taken from a shared counter, each marked where done. */
enum { MAX_PIECES = 512 };
typedef struct {
  int64_t next, n;
  int hits[MAX_PIECES];
  long by[MAX_PIECES]; /* which thread did it (0: the caller) */
  long caller;
} pieces_t;

static void do_pieces(void *arg) {
  pieces_t *p = arg;
  long me = (long)syscall(SYS_gettid);
  for (;;) {
    int64_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
    if (i >= p->n) break;
    for (volatile int spin = 0; spin < 200; spin++) {
    }
    __atomic_fetch_add(&p->hits[i], 1, __ATOMIC_RELAXED);
    p->by[i] = me == p->caller ? 0 : me;
  }
}

static void check_pairs(const char *where) {
  static pieces_t p;
  int shared = 0;
  for (int call = 0; call < 2000; call++) {
    memset(&p, 0, sizeof p);
    p.n = call % MAX_PIECES;
    p.caller = (long)syscall(SYS_gettid);
    pair_run(do_pieces, &p);
    int bad = 0;
    for (int64_t i = 0; i < p.n; i++) {
      bad += p.hits[i] != 1;
      shared |= p.by[i] != 0;
    }
    CHECK(!bad, "%s: pair_run call %d did %d of %lld pieces other than once", where, call, bad,
          (long long)p.n);
    if (bad) break;
  }
  CHECK(pair_thread_id() != 0, "%s: the partner never started", where);
  /* With two CPUs the partner must have taken some piece (one CPU: it may never). */
  CHECK(shared || sysconf(_SC_NPROCESSORS_ONLN) < 2, "%s: the partner never took a piece", where);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s CASE_DIR\n", argv[0]);
    return 2;
  }
  const char *dir = argv[1];

  /* 1. The golden chain vectors (block size 4, context BLOCK_CONTEXT). */
  const uint32_t counting[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const char *const counting_want[2] = {
      "5b3a4e773fdf0cc1ba130b245a0836231eb48d6c2575e26ef8513366b2ece3f1",
      "92d0d3540678097572a7c969b80e74f05adab8a9398ba9af38e525ff9ff1b273"};
  check_chain(NULL, counting, 2, counting_want);
  const uint32_t edges[8] = {0, 1, 4294967295u, 7, 65535, 65536, 3, 3};
  const char *const edges_want[2] = {
      "49905ce9eb04c65ea23e70c0d6bd44c3c30cb9207a5b0c177cb91cf00eeb6e73",
      "d8beb5841555e1495370ed3c98fc22b9632876f47ba5a7b62510f33b7c6abaa4"};
  check_chain("c94a6754793a51d52b8cb720d3a08e468102d7e976cffe3c289e25c6d1595f18", edges, 2,
              edges_want);

  /* The golden prefix keys (tests/test_lookup.py): two whole segments and 3 blocks. */
  check_prefix(2 * 64 * 4 + 3 * 4, 64 * 4 * 4,
               "a99b6c946f1b3d3680725f1f5770a7a53b979f0725d1d09d3c5ae0fbec3b8568");
  check_prefix(2 * 64 * 64 + 3 * 64, 64 * 64 * 4,
               "1ce3d0946e0e322c46ea79bf8d0f2e9f9d97db9d8f745509ff0751f26029492e");

  /* 2. A payload file filled into block 1's rows of each array. */
  size_t case_len, payload_len, head_len, rows_len;
  char *spec = (char *)slurp(dir, "case.txt", &case_len);
  spec[case_len] = '\0';
  uint8_t *payload = slurp(dir, "payload.bin", &payload_len);
  uint8_t *head = slurp(dir, "head.bin", &head_len);
  uint8_t *rows = slurp(dir, "rows.bin", &rows_len);
  size_t lead = 0, head_n = 0, sizes[MAX_ARRAYS];
  int used = 0, n_arrays = 0;
  char *at = spec;
  if (sscanf(at, "%zu %zu%n", &lead, &head_n, &used) != 2) return 2;
  at += used;
  while (n_arrays < MAX_ARRAYS && sscanf(at, "%zu%n", &sizes[n_arrays], &used) == 1) {
    at += used;
    n_arrays++;
  }
  char *context = strchr(at, '\n') + 1;
  context[strcspn(context, "\n")] = '\0';
  CHECK(head_n == head_len, "head.bin is not the head size of case.txt");

  int64_t segs[3 * MAX_ARRAYS];
  uint8_t *dest[MAX_ARRAYS], *alloc[MAX_ARRAYS];
  char path[4096];
  snprintf(path, sizeof path, "%s/filled.bin", dir);
  spit(path, payload, payload_len);
  int err = 0, rc = OK;
  /* Rows starting 0 to 63 bytes into a cache line (MLX's sit at 24 mod 64): the check
   * is fed, and the rows copied, in pieces that end on a destination line. */
  const size_t shifts[] = {0, 1, 8, 24, 40, 63};
  const int n_shifts = (int)(sizeof shifts / sizeof shifts[0]);
  for (int s = 0; s < n_shifts; s++) {
    for (int j = 0; j < n_arrays; j++) {
      size_t bytes = (2 * sizes[j] + 127) & ~(size_t)63; /* 2 blocks, 64 to spare */
      alloc[j] = aligned_alloc(64, bytes);
      memset(alloc[j], 0, bytes);
      dest[j] = alloc[j] + shifts[s]; /* blocks 0 and 1 of this array */
      segs[3 * j] = (int64_t)(intptr_t)dest[j];
      segs[3 * j + 1] = (int64_t)sizes[j];
      segs[3 * j + 2] = (int64_t)sizes[j];
    }
    rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
    CHECK(rc == OK, "fill of a good payload (rows %zu into a line) returned %d (errno %d)",
          shifts[s], rc, err);
    size_t off = 0;
    for (int j = 0; j < n_arrays; j++) {
      int untouched = 1;
      for (size_t k = 0; k < sizes[j]; k++) untouched &= dest[j][k] == 0;
      for (uint8_t *k = dest[j] + 2 * sizes[j]; k < alloc[j] + 2 * sizes[j] + 64; k++)
        untouched &= *k == 0;
      CHECK(untouched, "around block 1 of array %d was written (shift %zu)", j, shifts[s]);
      CHECK(memcmp(dest[j] + sizes[j], rows + off, sizes[j]) == 0,
            "array %d's rows differ (shift %zu)", j, shifts[s]);
      off += sizes[j];
    }
    CHECK(off == rows_len, "rows.bin holds %zu bytes, the arrays %zu", rows_len, off);
    if (s < n_shifts - 1) /* the last shift's rows stay for the damage cases */
      for (int j = 0; j < n_arrays; j++) free(alloc[j]);
  }

  /* 3. Damage: a flipped byte in the body, then in the descriptors; gone; short. */
  payload[payload_len - 7] ^= 0x10;
  spit(path, payload, payload_len);
  rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
  CHECK(rc == DIGEST, "a flipped body byte gave %d, not DIGEST", rc);
  payload[payload_len - 7] ^= 0x10;
  payload[head_len - 1] ^= 0x01;
  spit(path, payload, payload_len);
  rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
  CHECK(rc == HEAD, "a flipped head byte gave %d, not HEAD", rc);
  payload[head_len - 1] ^= 0x01;
  spit(path, payload, payload_len - 1);
  rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
  CHECK(rc == SIZE, "a short file gave %d, not SIZE", rc);
  spit(path, payload, payload_len - head_len + 1); /* cut in its body */
  rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
  CHECK(rc == SIZE, "a file cut in its body gave %d, not SIZE", rc);
  spit(path, payload, head_len - 1); /* cut inside the head */
  rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
  CHECK(rc == SIZE, "a file cut in its head gave %d, not SIZE", rc);
  {
    uint8_t *longer = malloc(payload_len + 1);
    CHECK(longer != NULL, "no memory for the longer file");
    memcpy(longer, payload, payload_len);
    longer[payload_len] = 0;
    spit(path, longer, payload_len + 1);
    free(longer);
  }
  rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
  CHECK(rc == SIZE, "a file one byte longer gave %d, not SIZE", rc);
  remove(path);
  rc = fill(path, head, head_len, lead, segs, n_arrays, 1, context, &err);
  CHECK(rc == MISSING, "a missing file gave %d, not MISSING", rc);

  /* 4. copy_runs: runs of every length around the streamed loop's edges (under 256
   * bytes, heads of 1 to 63 bytes before a cache line, a tail short of 64), each where
   * it belongs, nothing else. */
  {
    enum { N = 9, SPAN = 8192 };
    static uint8_t src[N * SPAN], dst[N * SPAN + 64];
    const size_t lens[N] = {0, 1, 63, 255, 256, 257, 1000, 4096 + 17, SPAN - 3};
    int64_t runs[3 * N];
    for (size_t i = 0; i < sizeof src; i++) src[i] = (uint8_t)(i * 131 + 7);
    memset(dst, 0xAB, sizeof dst);
    for (int i = 0; i < N; i++) {
      runs[3 * i] = (int64_t)(intptr_t)(dst + i * SPAN + (i * 23) % 63 + 1); /* unaligned */
      runs[3 * i + 1] = (int64_t)(intptr_t)(src + i * SPAN);
      runs[3 * i + 2] = (int64_t)lens[i];
    }
    int64_t next = 0;
    copy_runs(runs, N, &next);
    for (int i = 0; i < N; i++) {
      const uint8_t *d = dst + i * SPAN, *from = src + i * SPAN;
      size_t at = (size_t)((i * 23) % 63) + 1;
      int bad = 0;
      for (size_t k = 0; k < SPAN && !bad; k++) {
        int inside = k >= at && k < at + lens[i];
        bad = inside ? d[k] != from[k - at] : d[k] != 0xAB;
      }
      CHECK(!bad, "copy_runs: run %d (%zu bytes) misplaced or overran", i, lens[i]);
    }
    CHECK(next >= N, "copy_runs stopped at run %lld of %d", (long long)next, N);
  }

  /* 5. pair_run: exactly once, over calls of every size. */
  pair_init();
  check_pairs("parent");
  pid_t child = fork();
  if (child == 0) {
    check_pairs("forked child");
    _exit(failures == 0 ? 0 : 1);
  }
  int status = 0;
  CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) &&
            WEXITSTATUS(status) == 0,
        "pair_run failed in a forked child");

  if (failures == 0) printf("test_native: chain vectors, fill, damage, copy, pair: all passed\n");
  return failures == 0 ? 0 : 1;
}
