/* cas_bank._chain: the chain hash of every block of a token buffer in one call.
 *
 * Block i is named blake3(derive_key=context, parent || tokens of block i), block
 * 0's parent being the namespace root: exactly cas_bank.blocks.hashing's format v1,
 * computed with the official BLAKE3 C implementation (vendored under blake3/: the
 * portable code, and on x86-64 its SSE2/SSE4.1 intrinsics, picked at run time). One Python call per prompt instead of one per block; the
 * loop runs without the GIL.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blake3/blake3.h"

/* The chain hash of each of the n step-byte blocks at src into dst (n * 32 bytes). The
 * context key is derived once; each block starts from a copy of that state (up to its
 * empty stack of chaining values, which a fresh hasher never reads). */
static void chain_hashes(const uint8_t *root, const uint8_t *src, size_t n, size_t step,
                         const char *context, uint8_t *dst) {
  blake3_hasher base, h;
  blake3_hasher_init_derive_key(&base, context);
  const uint8_t *parent = root;
  for (size_t i = 0; i < n; i++) {
    memcpy(&h, &base, offsetof(blake3_hasher, cv_stack));
    blake3_hasher_update(&h, parent, BLAKE3_OUT_LEN);
    blake3_hasher_update(&h, src + i * step, step);
    blake3_hasher_finalize(&h, dst + i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
    parent = dst + i * BLAKE3_OUT_LEN;
  }
}

/* The prefix keys of the len bytes at src (cas_bank.index.prefixes) into dst, how many:
 * key 0 is blake3(derive_key=context, root) (root itself where context is NULL: the
 * key of the prefix the bytes go on from); each next is blake3 keyed by the one before
 * over a step-byte segment; the last, short segment's key comes at the end of each of
 * its `block`-byte blocks where block > 0 (digests of one keyed hasher: the candidates
 * of a lookup whose stored chain ends inside it), else once at its end. */
static size_t prefix_keys(const uint8_t *root, const uint8_t *src, size_t len, size_t step,
                          size_t block, const char *context, uint8_t *dst) {
  blake3_hasher h;
  uint8_t key[BLAKE3_KEY_LEN];
  if (context != NULL) {
    blake3_hasher_init_derive_key(&h, context);
    blake3_hasher_update(&h, root, BLAKE3_OUT_LEN);
    blake3_hasher_finalize(&h, key, BLAKE3_KEY_LEN);
  } else { /* `root` is the key the hashing goes on from (a prefix's, a lookup's tail) */
    memcpy(key, root, BLAKE3_KEY_LEN);
  }
  size_t at = 0, i = 0;
  for (; at + step <= len; at += step, i++) {
    blake3_hasher_init_keyed(&h, key);
    blake3_hasher_update(&h, src + at, step);
    blake3_hasher_finalize(&h, dst + i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
    memcpy(key, dst + i * BLAKE3_OUT_LEN, BLAKE3_KEY_LEN);
  }
  if (at < len) {
    blake3_hasher_init_keyed(&h, key);
    size_t each = block > 0 ? block : len - at;
    for (; at < len; at += each, i++) {
      size_t n = len - at < each ? len - at : each;
      blake3_hasher_update(&h, src + at, n);
      blake3_hasher_finalize(&h, dst + i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
    }
  }
  return i;
}

/* CAS_BANK_CORE_ONLY: the C functions above without the Python module below (the C
 * test, tests/native/test_native.c, builds them for other CPUs). */
#ifndef CAS_BANK_CORE_ONLY
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *chain(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer root, data;
  Py_ssize_t step;
  const char *context;
  if (!PyArg_ParseTuple(args, "y*y*ns", &root, &data, &step, &context)) {
    return NULL;
  }
  PyObject *out = NULL;
  if (root.len != BLAKE3_OUT_LEN) {
    PyErr_Format(PyExc_ValueError, "root must be %d bytes, got %zd", BLAKE3_OUT_LEN, root.len);
    goto done;
  }
  if (step <= 0 || data.len % step != 0) {
    PyErr_Format(PyExc_ValueError, "data of %zd bytes is not a whole number of %zd-byte blocks",
                 data.len, step);
    goto done;
  }
  Py_ssize_t n = data.len / step;
  uint8_t *dst = PyMem_Malloc(n > 0 ? n * BLAKE3_OUT_LEN : 1);
  if (dst == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  Py_BEGIN_ALLOW_THREADS
  chain_hashes(root.buf, data.buf, (size_t)n, (size_t)step, context, dst);
  Py_END_ALLOW_THREADS
  out = PyList_New(n);
  for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
    PyObject *name = PyBytes_FromStringAndSize((const char *)dst + i * BLAKE3_OUT_LEN,
                                               BLAKE3_OUT_LEN);
    if (name == NULL) {
      Py_CLEAR(out);
    } else {
      PyList_SET_ITEM(out, i, name);
    }
  }
  PyMem_Free(dst);
done:
  PyBuffer_Release(&root);
  PyBuffer_Release(&data);
  return out;
}

static PyObject *prefixes(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer root, data;
  Py_ssize_t step, block = 0;
  const char *context; /* None: root is the key to go on from */
  if (!PyArg_ParseTuple(args, "y*y*nz|n", &root, &data, &step, &context, &block)) return NULL;
  PyObject *out = NULL;
  if (root.len != BLAKE3_OUT_LEN || step <= 0 || block < 0) {
    PyErr_SetString(PyExc_ValueError, "root must be 32 bytes, step > 0 and block >= 0");
    goto done;
  }
  Py_ssize_t tail = data.len % step;
  Py_ssize_t n = data.len / step + (tail == 0 ? 0 : block > 0 ? (tail + block - 1) / block : 1);
  uint8_t *dst = PyMem_Malloc(n > 0 ? n * BLAKE3_OUT_LEN : 1);
  if (dst == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  Py_BEGIN_ALLOW_THREADS
  prefix_keys(root.buf, data.buf, (size_t)data.len, (size_t)step, (size_t)block, context, dst);
  Py_END_ALLOW_THREADS
  out = PyList_New(n);
  for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
    PyObject *key = PyBytes_FromStringAndSize((const char *)dst + i * BLAKE3_OUT_LEN,
                                              BLAKE3_OUT_LEN);
    if (key == NULL) {
      Py_CLEAR(out);
    } else {
      PyList_SET_ITEM(out, i, key);
    }
  }
  PyMem_Free(dst);
done:
  PyBuffer_Release(&root);
  PyBuffer_Release(&data);
  return out;
}

/* The keys of the end records a lookup asks for under `parent` (cas_bank.index.ends:
 * `find_end`): parent || blake3(derive_key=context, parent || the first t tokens of
 * data), 64 bytes each, for t = len(data) / 4 down to 0 (deepest first), one hasher's
 * digests. In Python (the blake3 package, a join a key) this cost a reopened lookup
 * ~20 us with the caches cold; the hasher here is the one the prefix keys just ran. */
static PyObject *end_keys(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer parent, data;
  const char *context;
  if (!PyArg_ParseTuple(args, "y*y*s", &parent, &data, &context)) return NULL;
  PyObject *out = NULL;
  if (parent.len != BLAKE3_OUT_LEN || data.len % 4 != 0) {
    PyErr_SetString(PyExc_ValueError, "parent must be 32 bytes, data whole uint32s");
    goto done;
  }
  Py_ssize_t n = data.len / 4 + 1;
  out = PyList_New(n);
  if (out == NULL) goto done;
  blake3_hasher h;
  uint8_t key[2 * BLAKE3_OUT_LEN];
  memcpy(key, parent.buf, BLAKE3_OUT_LEN);
  blake3_hasher_init_derive_key(&h, context);
  blake3_hasher_update(&h, parent.buf, BLAKE3_OUT_LEN);
  for (Py_ssize_t t = 0; t < n; t++) {
    if (t > 0) blake3_hasher_update(&h, (const uint8_t *)data.buf + 4 * (t - 1), 4);
    blake3_hasher_finalize(&h, key + BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
    PyObject *item = PyBytes_FromStringAndSize((const char *)key, sizeof key);
    if (item == NULL) {
      Py_CLEAR(out);
      goto done;
    }
    PyList_SET_ITEM(out, n - 1 - t, item);
  }
done:
  PyBuffer_Release(&parent);
  PyBuffer_Release(&data);
  return out;
}

/* The largest of the little-endian uint32 ids in a buffer (0 if empty): a prompt's
 * vocabulary check. numpy's `max` of a 1k-token prompt cost a restore ~50 us with the
 * caches cold (its reduction machinery is large); this loop is a few lines. */
static PyObject *max_id(PyObject *self, PyObject *arg) {
  (void)self;
  Py_buffer data;
  if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) != 0) return NULL;
  PyObject *out = NULL;
  if (data.len % 4 != 0) {
    PyErr_Format(PyExc_ValueError, "ids of %zd bytes are not whole uint32s", data.len);
  } else {
    const uint8_t *at = data.buf;
    uint32_t top = 0;
    for (Py_ssize_t i = 0; i < data.len; i += 4) {
      uint32_t v = (uint32_t)at[i] | (uint32_t)at[i + 1] << 8 | (uint32_t)at[i + 2] << 16 |
                   (uint32_t)at[i + 3] << 24; /* one load on a little-endian CPU */
      top = v > top ? v : top;
    }
    out = PyLong_FromUnsignedLong(top);
  }
  PyBuffer_Release(&data);
  return out;
}

/* A block header's record, decoded (cas_bank.index.chain: `Header.encode`'s layout,
 * "<BBHIQQ32s32s32s32s" then the tokens): a reopened restore decodes one a block, and
 * struct's unpack, the slices and the named tuple cost ~1-2 us each in Python. */
#define HEADER_FIXED 152 /* 1 + 1 + 2 + 4 + 8 + 8 + 4 * 32 */
#define HEADER_VERSION 1
#define HEADER_FLAG_STATE 1
#define HEADER_FIELDS 9

static PyTypeObject *header_type = NULL; /* cas_bank.index.chain.Header, set at import */

static PyObject *set_header_type(PyObject *self, PyObject *arg) {
  (void)self;
  if (!PyType_Check(arg) || !PyType_IsSubtype((PyTypeObject *)arg, &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "the header type must be a tuple subclass");
    return NULL;
  }
  Py_INCREF(arg);
  Py_XSETREF(header_type, (PyTypeObject *)arg);
  Py_RETURN_NONE;
}

static uint64_t le(const uint8_t *at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = v << 8 | at[i];
  return v;
}

/* The fields of a header record in the named tuple's order, or NULL with no error set
 * where the record is unreadable (truncated, another version, a bad token list). */
static PyObject *header_of(PyObject *chain_hash, const uint8_t *at, Py_ssize_t len) {
  if (len < HEADER_FIXED || at[0] != HEADER_VERSION) return NULL;
  uint64_t n = le(at + 2, 2);
  if ((uint64_t)(len - HEADER_FIXED) != 4 * n) return NULL;
  const uint8_t *digests = at + 24;
  PyObject *fields[HEADER_FIELDS] = {
      Py_NewRef(chain_hash),
      PyBytes_FromStringAndSize((const char *)digests, 32),
      PyLong_FromUnsignedLongLong(le(at + 4, 4)),
      PyBytes_FromStringAndSize((const char *)digests + 32, 32),
      PyBytes_FromStringAndSize((const char *)digests + 64, 32),
      PyLong_FromUnsignedLongLong(le(at + 8, 8)),
      PyBytes_FromStringAndSize((const char *)at + HEADER_FIXED, len - HEADER_FIXED),
      at[1] & HEADER_FLAG_STATE ? PyBytes_FromStringAndSize((const char *)digests + 96, 32)
                                : Py_NewRef(Py_None),
      PyLong_FromUnsignedLongLong(le(at + 16, 8)),
  };
  PyObject *out = header_type->tp_alloc(header_type, HEADER_FIELDS);
  for (int i = 0; i < HEADER_FIELDS; i++) {
    if (fields[i] == NULL || out == NULL) {
      for (int j = 0; j < HEADER_FIELDS; j++) Py_XDECREF(fields[j]);
      Py_XDECREF(out);
      return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
  }
  for (int i = 0; i < HEADER_FIELDS; i++) PyTuple_SET_ITEM(out, i, fields[i]);
  return out;
}

static PyObject *header(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "header() takes 2 arguments (%zd given)", nargs);
    return NULL;
  }
  if (header_type == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "set_header_type() was not called");
    return NULL;
  }
  Py_buffer raw;
  if (PyObject_GetBuffer(args[1], &raw, PyBUF_SIMPLE) != 0) return NULL;
  PyObject *out = header_of(args[0], raw.buf, raw.len);
  PyBuffer_Release(&raw);
  if (out == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
  return out;
}

/* A new reference to the int `v`: *last where it holds v already (a chain's blocks
 * mostly have one payload size: one int object for all of them), else a new one kept
 * in *last (the caller releases *last). */
static PyObject *same_size(PyObject **last, unsigned long long v) {
  if (*last == NULL || PyLong_AsUnsignedLongLong(*last) != v) {
    PyObject *made = PyLong_FromUnsignedLongLong(v);
    if (made == NULL) return NULL;
    Py_XSETREF(*last, made);
  }
  return Py_NewRef(*last);
}

/* The header one chain-record entry `e` makes for block i (a new reference), named
 * `name` under `parent` (borrowed), with the block's tokens from `tokens`; NULL with no
 * error set where the entry is not that block (another version, index, root, parent
 * or token count), NULL with an error set where memory ran out. */
static PyObject *entry_header(const uint8_t *e, Py_ssize_t i, PyObject *name, PyObject *parent,
                              PyObject *root, const Py_buffer *tokens, Py_ssize_t step,
                              PyObject **size) {
  if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) != 32 || !PyBytes_Check(name)) {
    return NULL;
  }
  if (e[0] != HEADER_VERSION || (Py_ssize_t)(4 * le(e + 2, 2)) != step ||
      (Py_ssize_t)le(e + 4, 4) != i || memcmp(e + 24, PyBytes_AS_STRING(parent), 32) != 0 ||
      memcmp(e + 56, PyBytes_AS_STRING(root), 32) != 0) {
    return NULL;
  }
  PyObject *fields[HEADER_FIELDS] = {
      Py_NewRef(name),
      Py_NewRef(parent),
      PyLong_FromSsize_t(i),
      Py_NewRef(root),
      PyBytes_FromStringAndSize((const char *)e + 88, 32),
      same_size(size, le(e + 8, 8)),
      PyBytes_FromStringAndSize((const char *)tokens->buf + i * step, step),
      e[1] & HEADER_FLAG_STATE ? PyBytes_FromStringAndSize((const char *)e + 120, 32)
                               : Py_NewRef(Py_None),
      PyLong_FromUnsignedLongLong(le(e + 16, 8)),
  };
  PyObject *h = header_type->tp_alloc(header_type, HEADER_FIELDS);
  int failed = h == NULL;
  for (int f = 0; f < HEADER_FIELDS; f++) failed |= fields[f] == NULL;
  if (failed) {
    for (int f = 0; f < HEADER_FIELDS; f++) Py_XDECREF(fields[f]);
    Py_XDECREF(h);
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return NULL;
  }
  for (int f = 0; f < HEADER_FIELDS; f++) PyTuple_SET_ITEM(h, f, fields[f]);
  return h;
}

/* A record's entries and what they are read against: the record and tokens buffers
 * (released by the caller on success), offset, first, count, step and root; `run`'s
 * from its arguments, checked (`parse_run_args`), `prefix_record`'s from the record's
 * head. */
typedef struct {
  Py_buffer raw, tokens;
  Py_ssize_t offset, first, count, step;
  PyObject *root;
} run_args;

static int parse_run_args(PyObject *const *args, int record, int tokens, int nums[4], int root,
                          run_args *a) {
  if (header_type == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "set_header_type() was not called");
    return -1;
  }
  a->offset = PyLong_AsSsize_t(args[nums[0]]);
  a->first = PyLong_AsSsize_t(args[nums[1]]);
  a->count = PyLong_AsSsize_t(args[nums[2]]);
  a->step = PyLong_AsSsize_t(args[nums[3]]);
  if (PyErr_Occurred()) return -1;
  a->root = args[root];
  if (!PyBytes_Check(a->root) || PyBytes_GET_SIZE(a->root) != 32) {
    PyErr_SetString(PyExc_TypeError, "root must be 32 bytes");
    return -1;
  }
  if (a->offset < 0 || a->first < 0 || a->count < 0 || a->step <= 0) {
    PyErr_SetString(PyExc_ValueError, "offset, first and count must be >= 0, step > 0");
    return -1;
  }
  if (PyObject_GetBuffer(args[record], &a->raw, PyBUF_SIMPLE) != 0) return -1;
  if (PyObject_GetBuffer(args[tokens], &a->tokens, PyBUF_SIMPLE) != 0) {
    PyBuffer_Release(&a->raw);
    return -1;
  }
  return 0;
}

/* Whether entry j of the record (block first + j) lies within it and its tokens within
 * the tokens. */
static int entry_fits(const run_args *a, Py_ssize_t j) {
  return a->offset + (j + 1) * HEADER_FIXED <= a->raw.len &&
         (a->first + j + 1) * a->step <= a->tokens.len;
}

/* A chain record's entries made into headers (cas_bank.index.chain_records: `read_runs`):
 * each entry is a header's fixed part; the header's tokens are the prompt's own (its
 * chain hash commits to them), its chain hash and parent the caller's hash objects, its
 * root the caller's. An entry that is not the block it stands for (another version,
 * index, root, parent or token count) ends the list there. A reopened 16k-token lookup
 * makes 256 headers this way: in Python, ~1.5 us each. */
static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 8) {
    PyErr_Format(PyExc_TypeError, "run() takes 8 arguments (%zd given)", nargs);
    return NULL;
  }
  run_args a;
  int nums[4] = {1, 2, 3, 7};
  if (parse_run_args(args, 0, 6, nums, 4, &a) != 0) return NULL;
  PyObject *hashes = PySequence_Fast(args[5], "hashes must be a sequence");
  if (hashes == NULL) {
    PyBuffer_Release(&a.tokens);
    PyBuffer_Release(&a.raw);
    return NULL;
  }
  Py_ssize_t n_hashes = PySequence_Fast_GET_SIZE(hashes);
  PyObject **items = PySequence_Fast_ITEMS(hashes);
  PyObject *out = PyList_New(0);
  PyObject *size = NULL;
  for (Py_ssize_t j = 0; out != NULL && j < a.count; j++) {
    Py_ssize_t i = a.first + j;
    if (!entry_fits(&a, j) || i >= n_hashes) break;
    const uint8_t *e = (const uint8_t *)a.raw.buf + a.offset + j * HEADER_FIXED;
    PyObject *parent = i == 0 ? a.root : items[i - 1];
    PyObject *h = entry_header(e, i, items[i], parent, a.root, &a.tokens, a.step, &size);
    if (h == NULL) {
      if (PyErr_Occurred()) Py_CLEAR(out);
      break;
    }
    if (PyList_Append(out, h) != 0) Py_CLEAR(out);
    Py_DECREF(h);
  }
  Py_XDECREF(size);
  PyBuffer_Release(&a.tokens);
  PyBuffer_Release(&a.raw);
  Py_DECREF(hashes);
  return out;
}

/* A prefix record (cas_bank.index.prefixes: the chain record's head "<BBHIQ", its
 * entries, then the chain hash of its block) parsed into cls(epoch, first, headers,
 * hashes): the headers of its entries and their chain hashes, as tuples. Block i is
 * named by the parent field of the entry after it, the last block by the 32 bytes after
 * the entries. The first entry's parent is taken as it stands, but for block 0 (the
 * root): the caller checks it against the block before. None where the record is not
 * one (too short, another version, flags, no entries, a length that is not theirs) or
 * an entry is not the block it stands for. One call a record: the head's checks and
 * the tuples in Python cost a reopened 16k-token lookup's 4 records ~10 us more. */
#define RUN_HEAD 16 /* version, flags, count, first block index, epoch */
#define RUN_VERSION 1
#define RUN_FIELDS 4

/* The record's headers and names into two new tuples (*headers, *names); 0 where an
 * entry is not its block (nothing made), -1 with an error set where memory ran out. */
static int prefix_entries(const run_args *a, PyObject **headers, PyObject **names) {
  Py_ssize_t last = a->offset + a->count * HEADER_FIXED;
  const uint8_t *e = (const uint8_t *)a->raw.buf + a->offset;
  PyObject *parent = a->first == 0 ? Py_NewRef(a->root)
                                   : PyBytes_FromStringAndSize((const char *)e + 24, 32);
  PyObject *size = NULL;
  *headers = PyTuple_New(a->count);
  *names = PyTuple_New(a->count);
  int ok = parent != NULL && *headers != NULL && *names != NULL;
  for (Py_ssize_t j = 0; ok && j < a->count; j++, e += HEADER_FIXED) {
    const char *name_at = j + 1 < a->count ? (const char *)e + HEADER_FIXED + 24
                                           : (const char *)a->raw.buf + last;
    PyObject *name = entry_fits(a, j) ? PyBytes_FromStringAndSize(name_at, 32) : NULL;
    PyObject *h = name != NULL
                      ? entry_header(e, a->first + j, name, parent, a->root, &a->tokens, a->step,
                                     &size)
                      : NULL;
    if (h == NULL) {
      Py_XDECREF(name);
      ok = 0;
      break;
    }
    PyTuple_SET_ITEM(*headers, j, h);
    PyTuple_SET_ITEM(*names, j, Py_NewRef(name));
    Py_SETREF(parent, name);
  }
  Py_XDECREF(parent);
  Py_XDECREF(size);
  if (ok) return 0;
  Py_CLEAR(*headers);
  Py_CLEAR(*names);
  return PyErr_Occurred() ? -1 : 0;
}

static PyObject *prefix_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "prefix_record() takes 5 arguments (%zd given)", nargs);
    return NULL;
  }
  run_args a = {.root = args[1], .offset = RUN_HEAD, .step = PyLong_AsSsize_t(args[3])};
  PyTypeObject *cls = (PyTypeObject *)args[4];
  if (a.step == -1 && PyErr_Occurred()) return NULL;
  if (header_type == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "set_header_type() was not called");
    return NULL;
  }
  if (!PyType_Check(args[4]) || !PyType_IsSubtype(cls, &PyTuple_Type) ||
      !PyBytes_Check(a.root) || PyBytes_GET_SIZE(a.root) != 32 || a.step <= 0) {
    PyErr_SetString(PyExc_TypeError, "root must be 32 bytes, step > 0, cls a tuple subclass");
    return NULL;
  }
  if (PyObject_GetBuffer(args[0], &a.raw, PyBUF_SIMPLE) != 0) return NULL;
  if (PyObject_GetBuffer(args[2], &a.tokens, PyBUF_SIMPLE) != 0) {
    PyBuffer_Release(&a.raw);
    return NULL;
  }
  const uint8_t *at = a.raw.buf;
  PyObject *out = NULL, *headers = NULL, *names = NULL;
  if (a.raw.len >= RUN_HEAD) {
    a.count = (Py_ssize_t)le(at + 2, 2);
    a.first = (Py_ssize_t)le(at + 4, 4);
  }
  /* No entry is its block where the first block is past the tokens (the record's own
   * number, up to 2**32 - 1) or step is no entry's token count (a uint16 of tokens):
   * checked here, the products `entry_fits` and `entry_header` make of them stay
   * within the tokens' length and 2**35 more, whatever the record and the step. */
  int readable = a.raw.len >= RUN_HEAD && at[0] == RUN_VERSION && at[1] == 0 && a.count > 0 &&
                 a.raw.len == RUN_HEAD + a.count * HEADER_FIXED + 32 &&
                 a.step <= 4 * (Py_ssize_t)0xFFFF &&
                 le(at + 4, 4) < (uint64_t)(a.tokens.len / a.step);
  if (readable && prefix_entries(&a, &headers, &names) == 0 && headers != NULL) {
    PyObject *epoch = PyLong_FromUnsignedLongLong(le(at + 8, 8));
    PyObject *first = PyLong_FromSsize_t(a.first);
    out = epoch != NULL && first != NULL ? cls->tp_alloc(cls, RUN_FIELDS) : NULL;
    if (out != NULL) {
      PyObject *fields[RUN_FIELDS] = {epoch, first, headers, names};
      for (int f = 0; f < RUN_FIELDS; f++) PyTuple_SET_ITEM(out, f, fields[f]);
    } else {
      Py_XDECREF(epoch);
      Py_XDECREF(first);
      Py_DECREF(headers);
      Py_DECREF(names);
    }
  }
  PyBuffer_Release(&a.tokens);
  PyBuffer_Release(&a.raw);
  if (out == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
  return out;
}

static PyMethodDef methods[] = {
    {"prefix_record", (PyCFunction)(void (*)(void))prefix_record, METH_FASTCALL,
     "prefix_record(record, root, tokens, step, cls) -> cls(epoch, first, headers, hashes) "
     "| None: a prefix record parsed, its entries' headers named by the parents of the "
     "entries after them and the 32 bytes after the last; None where it is not one or an "
     "entry is not its block."},
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(record, offset, first, count, root, hashes, tokens, step) -> list[Header]: the "
     "headers of a chain record's entries (each a header's fixed part, from offset) for "
     "blocks first on, with the tokens of each block from tokens (step bytes a block), up "
     "to the first entry that is not its block."},
    {"set_header_type", set_header_type, METH_O,
     "set_header_type(cls): the named tuple `header` makes (cas_bank.index.chain.Header)."},
    {"header", (PyCFunction)(void (*)(void))header, METH_FASTCALL,
     "header(chain_hash, raw) -> Header | None: a header record decoded, None where it is "
     "unreadable (truncated, another version, a bad token list)."},
    {"chain", chain, METH_VARARGS,
     "chain(root, data, step, context) -> list[bytes]: the 32-byte chain hash of "
     "every step-byte block of data, in order."},
    {"prefixes", prefixes, METH_VARARGS,
     "prefixes(root, data, step, context, block=0) -> list[bytes]: the prefix key of data "
     "up to the end of every step-byte segment, then up to the end of each block-byte block "
     "of the short last one (only its end where block is 0) (index.prefixes); with context "
     "None, root is the key of the prefix data goes on from."},
    {"end_keys", end_keys, METH_VARARGS,
     "end_keys(parent, data, context) -> list[bytes]: parent followed by the end hash of "
     "parent and each prefix of the uint32s of data, the whole of data first, none last "
     "(index.ends: the keys of a lookup's candidate end records)."},
    {"max_id", max_id, METH_O,
     "max_id(ids) -> int: the largest little-endian uint32 of the buffer ids (0 if "
     "empty)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cas_bank._chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
#endif /* CAS_BANK_CORE_ONLY */
