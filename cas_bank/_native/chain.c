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

static PyMethodDef methods[] = {
    {"set_header_type", set_header_type, METH_O,
     "set_header_type(cls): the named tuple `header` makes (cas_bank.index.chain.Header)."},
    {"header", (PyCFunction)(void (*)(void))header, METH_FASTCALL,
     "header(chain_hash, raw) -> Header | None: a header record decoded, None where it is "
     "unreadable (truncated, another version, a bad token list)."},
    {"chain", chain, METH_VARARGS,
     "chain(root, data, step, context) -> list[bytes]: the 32-byte chain hash of "
     "every step-byte block of data, in order."},
    {"max_id", max_id, METH_O,
     "max_id(ids) -> int: the largest little-endian uint32 of the buffer ids (0 if "
     "empty)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cas_bank._chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
#endif /* CAS_BANK_CORE_ONLY */
