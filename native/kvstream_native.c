/* _kvstream_native: a chunk read and its checksum in one loop, without the GIL.
 *
 * read_hashed(fd, segs, offset, lo, hi, piece) -> (moved, digest, errno)
 *
 * Reads the (address, length) segments in order from file offset `offset`, `piece` bytes per
 * pread(2), and feeds the bytes at op positions [lo, hi) to an XXH3-64 state (seed 0) as each
 * piece lands, while it is still in this core's cache. Stops at end of file or at the first
 * error other than EINTR. Returns the bytes moved, the digest of the span's bytes read, and
 * the errno of the failed pread (0: none). The memory behind the addresses must stay valid and
 * unshared for the call; the caller (kvstream_backend.io.threads) owns it.
 *
 * The same digest as xxhash.xxh3_64() over the same bytes: xxhash.h is the reference
 * implementation (BSD-2-Clause, native/LICENSE-xxhash), the one python-xxhash builds on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static PyObject *read_hashed(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    PyObject *segs;
    long long offset, lo, hi, piece;
    if (!PyArg_ParseTuple(args, "iOLLLL", &fd, &segs, &offset, &lo, &hi, &piece))
        return NULL;
    if (piece <= 0 || offset < 0)
        return PyErr_Format(PyExc_ValueError, "piece must be > 0 and offset >= 0");
    PyObject *seq = PySequence_Fast(segs, "segs must be a sequence of (address, length)");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uintptr_t *addr = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uintptr_t));
    size_t *len = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(size_t));
    if (addr == NULL || len == NULL) {
        PyMem_Free(addr);
        PyMem_Free(len);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long long a, l;
        if (!PyArg_ParseTuple(item, "KK;a segment is (address, length)", &a, &l)) {
            PyMem_Free(addr);
            PyMem_Free(len);
            Py_DECREF(seq);
            return NULL;
        }
        addr[i] = (uintptr_t)a;
        len[i] = (size_t)l;
    }
    Py_DECREF(seq);

    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    long long pos = 0, moved = 0;
    int err = 0, eof = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !err && !eof; i++) {
        size_t at = 0;
        while (at < len[i]) {
            size_t want = len[i] - at;
            if (want > (size_t)piece)
                want = (size_t)piece;
            ssize_t got = pread(fd, (void *)(addr[i] + at), want, (off_t)(offset + pos + at));
            if (got < 0) {
                if (errno == EINTR)
                    continue;
                err = errno;
                break;
            }
            if (got == 0) {
                eof = 1;
                break;
            }
            long long a = pos + (long long)at, b = a + got;
            if (a < lo)
                a = lo;
            if (b > hi)
                b = hi;
            if (a < b)
                XXH3_64bits_update(&state, (const void *)(addr[i] + (uintptr_t)(a - pos)),
                                   (size_t)(b - a));
            at += (size_t)got;
            moved += got;
        }
        pos += (long long)len[i];
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(addr);
    PyMem_Free(len);
    return Py_BuildValue("(LKi)", moved, (unsigned long long)XXH3_64bits_digest(&state), err);
}

static PyMethodDef methods[] = {
    {"read_hashed", read_hashed, METH_VARARGS,
     "read_hashed(fd, segs, offset, lo, hi, piece) -> (moved, digest, errno): read segs "
     "piece by piece and XXH3-64 the bytes at [lo, hi) as they land, without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kvstream_native",
    .m_doc = "A chunk read and its checksum in one loop, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kvstream_native(void) { return PyModule_Create(&module); }
