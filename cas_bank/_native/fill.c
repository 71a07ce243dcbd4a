/* cas_bank._fill: read one payload file straight into destination memory, verified.
 *
 * A block payload file (cas_bank.blocks.files) holds the codec's bytes: a fixed lead
 * ending in the 32-byte digest field, the array descriptors, then each array's block
 * slice in C order. The field says which check it is (cas_bank.blocks.hashing): an
 * XXH3-128 digest followed by the 16-byte tag "cas_bank xxh3128" (format version 4), or
 * a blake3 digest (derive-key context given by the caller; every bank before).
 * `read_into` checks the head against the one the caller expects (the layout and the
 * header's digest, hence its kind), then reads the body in runs of 256 KiB. An XXH3
 * payload (format 4) is read straight into the destination rows (one `preadv` a run,
 * the head with the first and a probe byte past the end with the last) and checked
 * there, just written: one copy out of the page cache, one hashing pass, no GIL.
 * A blake3 payload (banks before) goes through this thread's staging buffer: each run
 * checked while in the core's cache (blake3's SIMD wants whole runs), then copied out
 * to the rows with streamed stores (x86-64: the rows are in no cache, and a plain
 * store first reads each line from memory to overwrite it). Staging was measured
 * faster than reading straight into the rows when every check was blake3 (100 MB of a
 * 4k-token cache, both cores: 34-40 ms against 43-48); with XXH3 the straight read
 * is as fast or faster in a restore and saves the second copy (session 22, the
 * restore benchmark's reopened fill, two runs each, interleaved builds: medium-hybrid
 * 16k 8.76-9.46 ms against 10.14-11.23, medium-qwen3 16k 32.1-32.7 against 32.3-35.7,
 * the 4k sizes within noise). SIMD code is picked at run time: BLAKE3's own dispatch,
 * xxHash's x86 dispatch to AVX2 where there is one.
 * The digest covers the lead before the digest, the descriptors and the body, as
 * blocks.codec computes it.
 *
 * `read_many` (a restore's files) and `copy_runs` (a lease copied) work on the calling
 * thread and on this module's partner thread at once (pair.h), both taking files or
 * runs from a shared counter.
 *
 * The destination is given as raw addresses (int64 triples: block 0's address, the
 * length, how many bytes further each next block's run starts): the
 * caller (cas_bank.restore.file_read) builds them from arrays it owns and keeps alive for
 * the call. On a failed check the rows already written hold unverified bytes: the
 * caller treats them as undefined (a restore ends before that block).
 */
#ifndef CAS_BANK_CORE_ONLY
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#else /* the C test (tests/native/test_native.c): `fill` without the Python module */
#include <stddef.h>
typedef ptrdiff_t Py_ssize_t;
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "blake3/blake3.h"
#include "pair.h"
/* XXH3-128, from the vendored official xxHash sources (BSD-2, cas_bank/_native/xxhash):
 * all inline in this file. On x86-64 its dispatcher picks AVX2 or AVX-512 at run time
 * (SSE2 otherwise); elsewhere the compiler's vectors (NEON on arm64). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "xxhash/xxh_x86dispatch.c"
#include "xxhash/xxh_x86dispatch.h"
#else
#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#endif

/* The tail of a digest field that holds an XXH3-128 check (cas_bank.blocks.hashing). */
static const uint8_t XXH3_TAG[16] = {'c', 'a', 's', '_', 'b', 'a', 'n', 'k',
                                     ' ', 'x', 'x', 'h', '3', '1', '2', '8'};
enum { FIELD = 32 };

/* One payload check in progress: blake3 or XXH3-128, as the expected field says. */
typedef struct {
  int xxh3;
  blake3_hasher b3;
  XXH3_state_t xx;
} check_t;

static void check_init(check_t *c, const uint8_t *field, const char *context) {
  c->xxh3 = memcmp(field + 16, XXH3_TAG, 16) == 0;
  if (c->xxh3) {
    (void)XXH3_128bits_reset(&c->xx);
  } else {
    blake3_hasher_init_derive_key(&c->b3, context);
  }
}

static void check_update(check_t *c, const uint8_t *data, size_t n) {
  if (c->xxh3) {
    (void)XXH3_128bits_update(&c->xx, data, n);
  } else {
    blake3_hasher_update(&c->b3, data, n);
  }
}

/* Whether what was fed matches `field`. */
static int check_matches(check_t *c, const uint8_t *field) {
  if (c->xxh3) {
    XXH128_canonical_t got;
    XXH128_canonicalFromHash(&got, XXH3_128bits_digest(&c->xx));
    return memcmp(got.digest, field, 16) == 0;
  }
  uint8_t got[BLAKE3_OUT_LEN];
  blake3_hasher_finalize(&c->b3, got, BLAKE3_OUT_LEN);
  return memcmp(got, field, BLAKE3_OUT_LEN) == 0;
}

enum { OK = 0, MISSING = 1, SIZE = 2, HEAD = 3, DIGEST = 4, IO = 5 };

#ifndef STAGE_BYTES
#define STAGE_BYTES (256 * 1024)
#endif
/* Copy a run out of the staging buffer (in L2) to destination rows that are not in any
 * cache: non-temporal stores where the rows allow, so the copy does not first read
 * every destination line from memory only to overwrite it. The streamed part starts on
 * a cache line: MLX's CPU arrays start 8 bytes into their allocation (the allocator
 * keeps the size there), so their rows are 8 mod 16 and 24 mod 64, and a run aligned
 * to 16 bytes only wrote every line in two partial halves. Aligned to 64, in
 * interleaved A/B (15 rounds): medium-qwen3 reopened 4k 11.9 -> 11.2 ms, 16k
 * 47.2 -> 46.0; a lease copied on the path 16k 27.0 -> 25.2, hybrid 1k 1.56 -> 1.34. */
static void copy_out(char *dst, const uint8_t *src, size_t n) {
#if defined(__x86_64__) && defined(__SSE2__) && !defined(CAS_BANK_NO_STREAM)
  size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
  if (n < 256 + head) {
    memcpy(dst, src, n);
    return;
  }
  memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t body = n & ~(size_t)63;
  for (size_t k = 0; k < body; k += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(src + k));
    __m128i b = _mm_loadu_si128((const __m128i *)(src + k + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + k + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + k + 48));
    _mm_stream_si128((__m128i *)(dst + k), a);
    _mm_stream_si128((__m128i *)(dst + k + 16), b);
    _mm_stream_si128((__m128i *)(dst + k + 32), c);
    _mm_stream_si128((__m128i *)(dst + k + 48), d);
  }
  memcpy(dst + body, src + body, n - body);
#else
  memcpy(dst, src, n);
#endif
}

/* Each reading thread's staging buffer (freed when the thread exits). */
static pthread_key_t stage_key;
static pthread_once_t stage_once = PTHREAD_ONCE_INIT;
static void make_stage_key(void) { (void)pthread_key_create(&stage_key, free); }

static uint8_t *staging(void) {
  (void)pthread_once(&stage_once, make_stage_key);
  uint8_t *buf = pthread_getspecific(stage_key);
  if (buf == NULL) {
    buf = aligned_alloc(4096, STAGE_BYTES);
    if (buf != NULL && pthread_setspecific(stage_key, buf) != 0) {
      free(buf);
      buf = NULL;
    }
  }
  return buf;
}

/* preadv of every iovec in full (short reads continue); 0, or -1 with errno set, or -2
 * at an unexpected end of file. Advances the iovecs it is given. With `probe`, the last
 * iovec is one byte just past where the file should end: 0 when the file ends there
 * (the read stops short of the probe, or at it), -3 when the probe is read (the file
 * goes on). A regular file's read comes back short only at its end, so the size is
 * checked by the read itself, with no `fstat` a file. */
static int preadv_full(int fd, struct iovec *iov, int n, off_t at, int probe) {
  while (n > 0) {
    ssize_t got = preadv(fd, iov, n, at);
    if (got < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (got == 0) return probe && n == 1 ? 0 : -2;
    at += got;
    while (n > 0 && (size_t)got >= iov->iov_len) {
      got -= (ssize_t)iov->iov_len;
      iov++;
      n--;
    }
    if (probe && n == 0) return -3;
    if (probe && n == 1 && iov->iov_len == 1) return 0; /* all but the probe: the end */
    if (n > 0) {
      iov->iov_base = (char *)iov->iov_base + got;
      iov->iov_len -= (size_t)got;
    }
  }
  return 0;
}

/* The destination rows of the body's next `want` bytes, from segment `*i` at `*part`
 * bytes in, as at most `max` iovecs; advances `*i` and `*part` past them. Returns the
 * bytes covered: `want`, or less where the rows took `max` pieces first. */
static size_t rows_of(const int64_t *segs, int64_t index, Py_ssize_t *i, size_t *part,
                      size_t want, struct iovec *iov, int max, int *n) {
  size_t done = 0;
  *n = 0;
  while (done < want && *n < max) {
    size_t rest = (size_t)segs[3 * *i + 1] - *part;
    size_t take = rest < want - done ? rest : want - done;
    char *to = (char *)(intptr_t)(segs[3 * *i] + index * segs[3 * *i + 2]) + *part;
    iov[(*n)++] = (struct iovec){to, take};
    done += take;
    *part += take;
    if (*part == (size_t)segs[3 * *i + 1]) {
      (*i)++;
      *part = 0;
    }
  }
  return done;
}

/* Rows a run reads at once: a run of more ends early (the next goes on from there). A
 * 256 KiB run of the medium layouts' 32 KiB rows (a head's 64 tokens) spans 8-9 of them,
 * of 4 KiB rows 64; the C test builds with 1 to end runs so. */
#ifndef MAX_ROWS
#define MAX_ROWS 64
#endif

/* A file's runs: the head with the first (one read), then STAGE_BYTES at a time, the
 * last with the probe past the end (`preadv_full`). A run is read into `rows` (`n_rows`
 * iovecs): its destination rows (XXH3), or the one staging buffer (blake3). 0, or an
 * error code. */
static int read_rows(int fd, uint8_t *head, size_t head_len, const struct iovec *rows,
                     int n_rows, int last, off_t at, int *err) {
  struct iovec iov[MAX_ROWS + 2];
  int n = 0;
  uint8_t probe;
  if (head != NULL) iov[n++] = (struct iovec){head, head_len};
  memcpy(iov + n, rows, sizeof(struct iovec) * (size_t)n_rows);
  n += n_rows;
  if (last) iov[n++] = (struct iovec){&probe, 1};
  int r = preadv_full(fd, iov, n, at, last);
  if (r == 0) return OK;
  *err = r == -1 ? errno : 0;
  return r == -1 ? IO : SIZE;
}

/* Scatter a run of the body (in `stage`) into the rows it covers (`rows_of`, from
 * segment `*i` at `*part` bytes in: a run may end inside one), the whole run checked
 * first (blake3 hashes 8 chunks at once only when given 8 KiB or more). */
static void scatter(check_t *check, const uint8_t *stage, size_t want, const int64_t *segs,
                    int64_t index, Py_ssize_t *i, size_t *part) {
  check_update(check, stage, want);
  struct iovec rows[MAX_ROWS];
  for (size_t done = 0; done < want;) {
    int n = 0;
    const uint8_t *from = stage + done;
    done += rows_of(segs, index, i, part, want - done, rows, MAX_ROWS, &n);
    for (int k = 0; k < n; k++) {
      copy_out(rows[k].iov_base, from, rows[k].iov_len);
      from += rows[k].iov_len;
    }
  }
}

static int fill(const char *path, const uint8_t *head, size_t head_len, size_t lead,
                const int64_t *segs, Py_ssize_t n_segs, int64_t index, const char *context,
                int *err) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *err = errno;
    return errno == ENOENT ? MISSING : IO;
  }
  int rc = OK;
  uint64_t body = 0;
  for (Py_ssize_t i = 0; i < n_segs; i++) body += (uint64_t)segs[3 * i + 1];
  /* The check's state is large (XXH3's 576 bytes, 64-aligned; blake3's ~1.9 KiB): on
   * the heap with the head, not on a pool thread's stack. */
  uint8_t *got_head = malloc(head_len ? head_len : 1);
  check_t *check = aligned_alloc(64, (sizeof(check_t) + 63) & ~(size_t)63);
  if (got_head == NULL || check == NULL) {
    *err = ENOMEM;
    rc = IO;
    goto out;
  }
  /* The expected head's field says the check; the head read must equal it to count. */
  const uint8_t *field = head + lead - FIELD;
  check_init(check, field, context);
  check_update(check, head, lead - FIELD);
  check_update(check, head + lead, head_len - lead);
  /* XXH3 (format 4): each run read straight into its rows, then checked there (just
   * written, in cache). blake3 (banks before): through the staging buffer (`scatter`),
   * where its 8-chunk SIMD hashes whole runs. */
  uint8_t *stage = check->xxh3 ? NULL : staging();
  if (!check->xxh3 && stage == NULL) {
    *err = ENOMEM;
    rc = IO;
    goto out;
  }
  /* One read a run of STAGE_BYTES, nothing more: the head comes with the body's first
   * run, and the last run's read checks the file's size (`preadv_full`'s probe). A 16k-token
   * hybrid restore (257 files) made 1542 calls and makes 1028; the calls alone cost
   * ~0.1 ms on two cores, under the restores' noise (interleaved A/B: within 0.1 ms). */
  off_t at = 0;
  Py_ssize_t i = 0;
  size_t part = 0; /* bytes of segment i already read */
  uint64_t left = body;
  for (int first = 1;; first = 0) {
    size_t want = left < STAGE_BYTES ? (size_t)left : STAGE_BYTES;
    struct iovec rows[MAX_ROWS];
    int n_rows = 1;
    if (check->xxh3) {
      want = rows_of(segs, index, &i, &part, want, rows, MAX_ROWS, &n_rows);
    } else {
      rows[0] = (struct iovec){stage, want};
    }
    int last = want == left;
    rc = read_rows(fd, first ? got_head : NULL, head_len, rows, n_rows, last, at, err);
    if (rc != OK) goto out;
    if (first) {
      if (memcmp(got_head, head, head_len) != 0) {
        rc = HEAD;
        goto out;
      }
      at = (off_t)head_len;
    }
    if (check->xxh3) {
      for (int k = 0; k < n_rows; k++) check_update(check, rows[k].iov_base, rows[k].iov_len);
    } else {
      scatter(check, stage, want, segs, index, &i, &part);
    }
    at += (off_t)want;
    left -= want;
    if (last) break;
  }
  if (!check_matches(check, head + lead - FIELD)) rc = DIGEST;
out:
#if defined(__x86_64__) && defined(__SSE2__)
  _mm_sfence(); /* the streamed rows are visible before the caller hears of them */
#endif
  free(check);
  free(got_head);
  close(fd);
  return rc;
}

/* copy_runs: the (destination, source, length) int64 triples of `runs`, each copied
 * by copy_out (streamed where the CPU allows: a restore's destination rows are in no
 * cache), taking the next triple from `*next` until none is left, so threads given the
 * same counter share the work. A hot restore copies a lease this way. */
static void copy_runs(const int64_t *runs, int64_t n, int64_t *next) {
  for (;;) {
    int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    if (i >= n) break;
    copy_out((char *)(intptr_t)runs[3 * i], (const uint8_t *)(intptr_t)runs[3 * i + 1],
             (size_t)runs[3 * i + 2]);
  }
#if defined(__x86_64__) && defined(__SSE2__)
  _mm_sfence(); /* the streamed rows are visible before the caller hears of them */
#endif
}

#ifndef CAS_BANK_CORE_ONLY
/* copy_runs of `runs` on this thread and the partner (pair.h). */
typedef struct {
  const int64_t *runs;
  int64_t n;
  int64_t next;
} copy_share_t;

static void copy_share(void *arg) {
  copy_share_t *c = arg;
  copy_runs(c->runs, c->n, &c->next);
}

static void copy_pair(const int64_t *runs, int64_t n) {
  copy_share_t c = {runs, n, 0};
  pair_run(copy_share, &c);
}

/* `fill` of many files on this thread and the partner, each taking the next file from
 * a shared counter; each file's (code, errno) into `codes`. */
typedef struct {
  Py_ssize_t n;
  const char **path;
  const uint8_t **head;
  Py_ssize_t *head_len;
  const int64_t **seg;
  Py_ssize_t *seg_n;
  const int64_t *index;
  size_t lead;
  const char *context;
  int32_t *codes;
  int64_t next;
} reads_t;

static void read_share(void *arg) {
  reads_t *r = arg;
  for (;;) {
    int64_t i = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
    if (i >= r->n) break;
    int err = 0;
    r->codes[2 * i] = fill(r->path[i], r->head[i], (size_t)r->head_len[i], r->lead, r->seg[i],
                           r->seg_n[i], r->index[i], r->context, &err);
    r->codes[2 * i + 1] = err;
  }
}

static PyObject *copy_runs_py(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer runs;
  int two = 1;
  if (!PyArg_ParseTuple(args, "y*|p", &runs, &two)) return NULL;
  PyObject *out = NULL;
  if (runs.len % (3 * (Py_ssize_t)sizeof(int64_t)) != 0 ||
      ((uintptr_t)runs.buf % sizeof(int64_t)) != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "runs must be 8-aligned int64 (destination, source, length) triples");
  } else {
    const int64_t *at = runs.buf;
    int64_t n = (int64_t)(runs.len / (Py_ssize_t)(3 * sizeof(int64_t)));
    for (int64_t i = 0; i < n; i++) {
      if (at[3 * i + 2] < 0) {
        PyErr_SetString(PyExc_ValueError, "a run's length is negative");
        goto done;
      }
    }
    Py_BEGIN_ALLOW_THREADS
    if (two) {
      copy_pair(at, n);
    } else {
      int64_t next = 0;
      copy_runs(at, n, &next);
    }
    Py_END_ALLOW_THREADS
    out = Py_NewRef(Py_None);
  }
done:
  PyBuffer_Release(&runs);
  return out;
}

static PyObject *read_into(PyObject *self, PyObject *args) {
  (void)self;
  const char *path, *context;
  Py_buffer head, segs;
  Py_ssize_t lead;
  long long index;
  if (!PyArg_ParseTuple(args, "sy*ny*Ls", &path, &head, &lead, &segs, &index, &context)) {
    return NULL;
  }
  PyObject *out = NULL;
  if (lead < BLAKE3_OUT_LEN || lead > head.len) {
    PyErr_Format(PyExc_ValueError, "lead of %zd bytes does not fit a head of %zd", lead,
                 head.len);
  } else if (segs.len % (3 * (Py_ssize_t)sizeof(int64_t)) != 0) {
    PyErr_SetString(PyExc_ValueError, "segments must be int64 (address, length, step) triples");
  } else {
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = fill(path, head.buf, (size_t)head.len, (size_t)lead, segs.buf,
              segs.len / (Py_ssize_t)(3 * sizeof(int64_t)), (int64_t)index, context, &err);
    Py_END_ALLOW_THREADS
    out = Py_BuildValue("(ii)", rc, err);
  }
  PyBuffer_Release(&head);
  PyBuffer_Release(&segs);
  return out;
}

/* read_many: `fill` of many files, the GIL released for all of them, on this thread
 * and the partner (pair.h). */
static PyObject *read_many(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *paths, *heads, *segments;
  Py_buffer index, codes;
  Py_ssize_t lead;
  const char *context;
  if (!PyArg_ParseTuple(args, "O!O!y*nO!sw*", &PyTuple_Type, &paths, &PyTuple_Type, &heads,
                        &index, &lead, &PyTuple_Type, &segments, &context, &codes)) {
    return NULL;
  }
  PyObject *out = NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(paths);
  reads_t r = {0};
  r.n = n;
  r.lead = (size_t)lead;
  r.context = context;
  if (PyTuple_GET_SIZE(heads) != n || PyTuple_GET_SIZE(segments) != n ||
      index.len != n * (Py_ssize_t)sizeof(int64_t) ||
      codes.len != 2 * n * (Py_ssize_t)sizeof(int32_t) || ((uintptr_t)index.buf % 8) != 0 ||
      ((uintptr_t)codes.buf % 4) != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "read_many needs one head, one segments, one int64 index and two int32 "
                    "codes a path (aligned)");
    goto done;
  }
  r.path = PyMem_Calloc((size_t)n + 1, sizeof(char *));
  r.head = PyMem_Calloc((size_t)n + 1, sizeof(uint8_t *));
  r.head_len = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
  r.seg = PyMem_Calloc((size_t)n + 1, sizeof(int64_t *));
  r.seg_n = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
  if (r.path == NULL || r.head == NULL || r.head_len == NULL || r.seg == NULL ||
      r.seg_n == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *p = PyTuple_GET_ITEM(paths, i), *h = PyTuple_GET_ITEM(heads, i);
    PyObject *g = PyTuple_GET_ITEM(segments, i);
    if (!PyBytes_Check(p) || !PyBytes_Check(h) || !PyBytes_Check(g)) {
      PyErr_SetString(PyExc_TypeError, "paths, heads and segments must be bytes");
      goto done;
    }
    if (PyBytes_GET_SIZE(g) % (3 * (Py_ssize_t)sizeof(int64_t)) != 0) {
      PyErr_SetString(PyExc_ValueError,
                      "segments must be int64 (address, length, step) triples");
      goto done;
    }
    r.path[i] = PyBytes_AS_STRING(p);
    r.head[i] = (const uint8_t *)PyBytes_AS_STRING(h);
    r.head_len[i] = PyBytes_GET_SIZE(h);
    r.seg[i] = (const int64_t *)PyBytes_AS_STRING(g);
    if ((uintptr_t)r.seg[i] % sizeof(int64_t) != 0) {  /* CPython's bytes are 8-aligned */
      PyErr_SetString(PyExc_ValueError, "segments are not 8-byte aligned");
      goto done;
    }
    r.seg_n[i] = PyBytes_GET_SIZE(g) / (Py_ssize_t)(3 * sizeof(int64_t));
    if (lead < BLAKE3_OUT_LEN || lead > r.head_len[i]) {
      PyErr_Format(PyExc_ValueError, "lead of %zd bytes does not fit a head of %zd", lead,
                   r.head_len[i]);
      goto done;
    }
  }
  r.index = index.buf;
  r.codes = codes.buf;
  Py_BEGIN_ALLOW_THREADS
  pair_run(read_share, &r);
  Py_END_ALLOW_THREADS
  Py_ssize_t failed = 0;
  for (Py_ssize_t i = 0; i < n; i++) failed += r.codes[2 * i] != 0;
  out = PyLong_FromSsize_t(failed);
done:
  PyMem_Free(r.path);
  PyMem_Free(r.head);
  PyMem_Free(r.head_len);
  PyMem_Free(r.seg);
  PyMem_Free(r.seg_n);
  PyBuffer_Release(&index);
  PyBuffer_Release(&codes);
  return out;
}

/* block_jobs(prefix, keys, digests, lead_prefix, desc) -> (paths, heads): the file of
 * each block and the head its plain payload starts with, for read_many. Key i is
 * keys[32i:32i+32] and its digest field digests[32i:32i+32]; its file is prefix +
 * hex(key) + "." + hex(first 8 bytes of the digest) (cas_bank.blocks.files names them
 * so) and its head lead_prefix + digest + desc. A reopened restore named and headed
 * each block in Python: ~5 us a block, cold. */
static void hex_into(char *out, const uint8_t *in, Py_ssize_t n) {
  static const char digits[] = "0123456789abcdef";
  for (Py_ssize_t i = 0; i < n; i++) {
    out[2 * i] = digits[in[i] >> 4];
    out[2 * i + 1] = digits[in[i] & 15];
  }
}

/* A new bytes object of len bytes put in tuple[i] (which owns it); its buffer, or NULL
 * with the error set. */
static char *new_item(PyObject *tuple, Py_ssize_t i, Py_ssize_t len) {
  PyObject *item = PyBytes_FromStringAndSize(NULL, len);
  if (item == NULL) return NULL;
  PyTuple_SET_ITEM(tuple, i, item);
  return PyBytes_AS_STRING(item);
}

static PyObject *block_jobs(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer prefix, keys, digests, lead, desc;
  if (!PyArg_ParseTuple(args, "y*y*y*y*y*", &prefix, &keys, &digests, &lead, &desc)) {
    return NULL;
  }
  PyObject *paths = NULL, *heads = NULL, *out = NULL;
  if (keys.len % FIELD != 0 || digests.len != keys.len) {
    PyErr_SetString(PyExc_ValueError,
                    "block_jobs needs 32-byte keys and one 32-byte digest field a key");
    goto done;
  }
  Py_ssize_t n = keys.len / FIELD;
  const Py_ssize_t path_len = prefix.len + 2 * FIELD + 1 + 16;
  const Py_ssize_t head_len = lead.len + FIELD + desc.len;
  paths = PyTuple_New(n);
  heads = PyTuple_New(n);
  if (paths == NULL || heads == NULL) goto done;
  for (Py_ssize_t i = 0; i < n; i++) {
    const uint8_t *key = (const uint8_t *)keys.buf + i * FIELD;
    const uint8_t *digest = (const uint8_t *)digests.buf + i * FIELD;
    char *at = new_item(paths, i, path_len), *h = NULL;
    if (at == NULL || (h = new_item(heads, i, head_len)) == NULL) goto done;
    memcpy(at, prefix.buf, (size_t)prefix.len);
    hex_into(at + prefix.len, key, FIELD);
    at[prefix.len + 2 * FIELD] = '.';
    hex_into(at + prefix.len + 2 * FIELD + 1, digest, 8);
    memcpy(h, lead.buf, (size_t)lead.len);
    memcpy(h + lead.len, digest, FIELD);
    memcpy(h + lead.len + FIELD, desc.buf, (size_t)desc.len);
  }
  out = PyTuple_Pack(2, paths, heads);
done:
  Py_XDECREF(paths);
  Py_XDECREF(heads);
  PyBuffer_Release(&prefix);
  PyBuffer_Release(&keys);
  PyBuffer_Release(&digests);
  PyBuffer_Release(&lead);
  PyBuffer_Release(&desc);
  return out;
}

/* place(triples, counts, addresses, column): a copy of the int64 triples with
 * addresses[v] added to element `column` of each of the counts[v] triples of view v, in
 * order: a template of row runs at address 0 placed at a restore's arrays. One call
 * where numpy took four (a copy, a repeat, an add, tobytes: ~40 us of a cold restore
 * for one set of destinations). */
static PyObject *place(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer triples, counts, addresses;
  int column;
  if (!PyArg_ParseTuple(args, "y*y*y*i", &triples, &counts, &addresses, &column)) return NULL;
  PyObject *out = NULL;
  const Py_ssize_t triple = 3 * (Py_ssize_t)sizeof(int64_t);
  if (triples.len % triple != 0 || counts.len % 8 != 0 || addresses.len != counts.len ||
      ((uintptr_t)triples.buf % 8) != 0 || ((uintptr_t)counts.buf % 8) != 0 ||
      ((uintptr_t)addresses.buf % 8) != 0 || column < 0 || column > 2) {
    PyErr_SetString(PyExc_ValueError,
                    "place needs 8-aligned int64 triples, one int64 count and address a "
                    "view, and a column of 0-2");
    goto done;
  }
  Py_ssize_t n = triples.len / triple, views = counts.len / 8, total = 0;
  const int64_t *count = counts.buf, *address = addresses.buf;
  for (Py_ssize_t v = 0; v < views; v++) {
    if (count[v] < 0 || count[v] > n - total) {
      PyErr_SetString(PyExc_ValueError, "the counts do not add up to the triples");
      goto done;
    }
    total += (Py_ssize_t)count[v];
  }
  if (total != n) {
    PyErr_SetString(PyExc_ValueError, "the counts do not add up to the triples");
    goto done;
  }
  out = PyBytes_FromStringAndSize(triples.buf, triples.len);
  if (out == NULL) goto done;
  int64_t *at = (int64_t *)PyBytes_AS_STRING(out); /* CPython's bytes are 8-aligned */
  for (Py_ssize_t v = 0, k = 0; v < views; v++) {
    for (int64_t j = 0; j < count[v]; j++, k++) at[3 * k + column] += address[v];
  }
done:
  PyBuffer_Release(&triples);
  PyBuffer_Release(&counts);
  PyBuffer_Release(&addresses);
  return out;
}

static PyObject *partner_tid(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLong(pair_thread_id());
}

static PyMethodDef methods[] = {
    {"read_into", read_into, METH_VARARGS,
     "read_into(path, head, lead, segments, index, context) -> (code, errno): read the "
     "payload file at path into the (address + index * step, length) of the int64 "
     "(address, length, step) triples of segments, "
     "checking its first len(head) bytes equal head and its check equals the digest "
     "field head[lead-32:lead]: XXH3-128 where the field ends with b'cas_bank xxh3128', "
     "else blake3 (derive-key context). code: 0 good, 1 missing, 2 size, 3 head, "
     "4 digest, 5 I/O error (errno)."},
    {"read_many", read_many, METH_VARARGS,
     "read_many(paths, heads, indices, lead, segments, context, codes) -> int: "
     "read_into of each (path, head, segments, index) of the tuples paths, heads and "
     "segments (bytes) and the int64 indices, on this thread and the module's partner "
     "thread at once, each taking the next file until none is left. Each file's "
     "(code, errno) goes to codes (int32 pairs, one pair a path); returns how many "
     "files failed (a code other than 0)."},
    {"block_jobs", block_jobs, METH_VARARGS,
     "block_jobs(prefix, keys, digests, lead_prefix, desc) -> (paths, heads): for each "
     "32-byte key of keys and its 32-byte digest field in digests, the file prefix + "
     "hex(key) + '.' + hex(digest[:8]) and the head lead_prefix + digest + desc (bytes, "
     "two tuples in key order): read_many's paths and heads of plain block payloads."},
    {"copy_runs", copy_runs_py, METH_VARARGS,
     "copy_runs(runs, two_threads=True) -> None: copy each (destination, source, length) "
     "of the int64 triples of runs (memory the caller holds), on this thread and (two_"
     "threads) the module's partner thread at once, each taking the next run until none "
     "is left. Streaming stores on x86-64."},
    {"place", place, METH_VARARGS,
     "place(triples, counts, addresses, column) -> bytes: the int64 triples with "
     "addresses[v] (int64) added to element column of each of the counts[v] (int64) "
     "triples of view v, in order."},
    {"partner_tid", partner_tid, METH_NOARGS,
     "partner_tid() -> int: the partner thread's id (Linux), 0 before it first ran."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cas_bank._fill", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fill(void) {
  pair_init();
  return PyModule_Create(&module);
}
#endif /* CAS_BANK_CORE_ONLY */
