/* cas_bank._fill: read one payload file straight into destination memory, verified.
 *
 * A block payload file (cas_bank.blocks.files) holds the codec's bytes: a fixed lead
 * ending in the blake3 digest, the array descriptors, then each array's block slice in
 * C order. `read_into` checks the head against the one the caller expects (the layout
 * and the header's digest), then `preadv`s the body in runs of about 256 KiB straight
 * into the destination rows (one iovec per contiguous run of a destination array) and
 * hashes each run while it is still in the core's cache: one copy out of the page
 * cache, one pass of blake3 (its SIMD code, picked at run time), no GIL, no
 * intermediate buffer. The digest covers the lead before the digest, the descriptors
 * and the body, as blocks.codec computes it.
 *
 * The destination is given as raw addresses (int64 triples: block 0's address, the
 * length, how many bytes further each next block's run starts): the
 * caller (cas_bank.index.fastread) builds them from arrays it owns and keeps alive for
 * the call. On a failed check the rows already written hold unverified bytes: the
 * caller treats them as undefined (a restore ends before that block).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "blake3/blake3.h"

enum { OK = 0, MISSING = 1, SIZE = 2, HEAD = 3, DIGEST = 4, IO = 5 };

#ifndef RUN_BYTES
#define RUN_BYTES (256 * 1024)
#endif
#define MAX_IOV 256

/* preadv of every iovec in full (short reads continue); 0, or -1 with errno set, or -2
 * at an unexpected end of file. Advances the iovecs it is given. */
static int preadv_full(int fd, struct iovec *iov, int n, off_t at) {
  while (n > 0) {
    ssize_t got = preadv(fd, iov, n, at);
    if (got < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (got == 0) return -2;
    at += got;
    while (n > 0 && (size_t)got >= iov->iov_len) {
      got -= (ssize_t)iov->iov_len;
      iov++;
      n--;
    }
    if (n > 0) {
      iov->iov_base = (char *)iov->iov_base + got;
      iov->iov_len -= (size_t)got;
    }
  }
  return 0;
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
  uint8_t *got_head = NULL;
  struct stat st;
  uint64_t body = 0;
  for (Py_ssize_t i = 0; i < n_segs; i++) body += (uint64_t)segs[3 * i + 1];
  if (fstat(fd, &st) != 0) {
    *err = errno;
    rc = IO;
    goto out;
  }
  if ((uint64_t)st.st_size != head_len + body) {
    rc = SIZE;
    goto out;
  }
  got_head = malloc(head_len ? head_len : 1);
  if (got_head == NULL) {
    *err = ENOMEM;
    rc = IO;
    goto out;
  }
  struct iovec one = {got_head, head_len};
  int r = preadv_full(fd, &one, 1, 0);
  if (r != 0) {
    *err = r == -1 ? errno : 0;
    rc = r == -1 ? IO : SIZE;
    goto out;
  }
  if (memcmp(got_head, head, head_len) != 0) {
    rc = HEAD;
    goto out;
  }
  blake3_hasher h;
  blake3_hasher_init_derive_key(&h, context);
  blake3_hasher_update(&h, got_head, lead - BLAKE3_OUT_LEN);
  blake3_hasher_update(&h, got_head + lead, head_len - lead);
  off_t at = (off_t)head_len;
  struct iovec iov[MAX_IOV];
  Py_ssize_t i = 0;
  while (i < n_segs) {
    /* One run: whole segments, until RUN_BYTES are reached (one larger segment is a run). */
    int n = 0;
    size_t run = 0;
    while (i < n_segs && n < MAX_IOV && run < RUN_BYTES) {
      iov[n].iov_base = (void *)(intptr_t)(segs[3 * i] + index * segs[3 * i + 2]);
      iov[n].iov_len = (size_t)segs[3 * i + 1];
      run += iov[n].iov_len;
      n++;
      i++;
    }
    struct iovec hashed[MAX_IOV];
    memcpy(hashed, iov, sizeof(struct iovec) * (size_t)n);
    r = preadv_full(fd, iov, n, at);
    if (r != 0) {
      *err = r == -1 ? errno : 0;
      rc = r == -1 ? IO : SIZE;
      goto out;
    }
    at += (off_t)run;
    for (int k = 0; k < n; k++) blake3_hasher_update(&h, hashed[k].iov_base, hashed[k].iov_len);
  }
  uint8_t digest[BLAKE3_OUT_LEN];
  blake3_hasher_finalize(&h, digest, BLAKE3_OUT_LEN);
  if (memcmp(digest, head + lead - BLAKE3_OUT_LEN, BLAKE3_OUT_LEN) != 0) rc = DIGEST;
out:
  free(got_head);
  close(fd);
  return rc;
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

static PyMethodDef methods[] = {
    {"read_into", read_into, METH_VARARGS,
     "read_into(path, head, lead, segments, index, context) -> (code, errno): read the "
     "payload file at path into the (address + index * step, length) of the int64 "
     "(address, length, step) triples of segments, "
     "checking its first len(head) bytes equal head and its blake3 digest (derive-key "
     "context) equals head[lead-32:lead]. code: 0 good, 1 missing, 2 size, 3 head, "
     "4 digest, 5 I/O error (errno)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cas_bank._fill", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fill(void) { return PyModule_Create(&module); }
