/* storage_gateway._blockread: one Full Block read and hashed in one call that holds no GIL.
 *
 * Why: the gateway's I/O threads read a block as open, ~10 preadv+xxh3 steps and close. In
 * Python each of those is a GIL release and re-take; with one core taken by other work the
 * threads spend their time waiting to get the GIL back from the event loop between steps
 * (docs/storage.md "Benchmark": ~0.26 CPU-s/GB against pread's 0.155). Here the whole block —
 * open, header, every step's preadv and the hash of what it read, close — runs after one
 * release. The Python side (storage_gateway/backend_fs.py) judges the header and the checksum
 * exactly as on its own path; this module only moves bytes and hashes them.
 *
 * read_block(path: bytes, flags: int, head: writable buffer, views: sequence of writable
 *            buffers, chunk: int) -> (head_bytes, payload_bytes, payload_xxh3_64)
 *   Reads the file from offset 0: first ``head`` (not hashed), then the concatenation of
 *   ``views``, ``chunk`` payload bytes per preadv step (the first step also carries the head);
 *   after each step the payload bytes it read are hashed while they are in cache. A short read
 *   (end of file) ends the read; the counts tell the caller. Raises OSError (with the path)
 *   when open or a read fails. The file is always closed.
 * read_block_runs(path, flags, head, arena, offsets, lengths, chunk) -> the same
 *   The payload's destination given as runs of one arena (``ArenaRuns``: the gateway's shared
 *   memory and staging reads), each checked to lie inside it; no view per run is made.
 *
 * xxh3_64 (seed 0) is xxHash's own implementation, vendored from the ``xxhash`` Python package's
 * sdist (4.1.0: xxhash.h/.c, xxh_x86dispatch.c/.h, BSD-2, LICENSE.xxhash) and built the way it
 * builds it: the same code the stored checksums were made with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include "xxhash.h"
#ifdef XXHASH_X86_DISPATCH
/* x86: XXH3 updates go to xxHash's runtime dispatcher (AVX-512 / AVX2 / SSE2 by the CPU), as in
 * the xxhash Python package's build; baseline compiler flags, so the module runs anywhere */
#include "xxh_x86dispatch.h"
#endif

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    char *base;
    size_t len;
} segment;

/* Fill iov[0..cnt) from ``offset`` on, resuming short reads; bytes read, or -1 (errno set). */
static ssize_t preadv_full(int fd, struct iovec *iov, int cnt, off_t offset)
{
    ssize_t total = 0;
    int i = 0;
    while (i < cnt) {
        int batch = cnt - i < IOV_MAX ? cnt - i : IOV_MAX;
        ssize_t n = preadv(fd, iov + i, batch, offset + total);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (n == 0)
            break; /* end of file: the caller compares the count with what it asked */
        total += n;
        while (n > 0 && i < cnt) { /* skip what was filled; trim a part-filled iovec */
            if ((size_t)n >= iov[i].iov_len) {
                n -= (ssize_t)iov[i].iov_len;
                i++;
            } else {
                iov[i].iov_base = (char *)iov[i].iov_base + n;
                iov[i].iov_len -= (size_t)n;
                n = 0;
            }
        }
    }
    return total;
}

typedef struct {
    size_t head_got;
    size_t payload_got;
    XXH64_hash_t digest;
    int err; /* errno of a failed open or read, else 0 */
} read_result;

/* The read itself: runs with the GIL released (touches no Python object). */
static void read_and_hash(const char *path, int flags, char *head, size_t head_len,
                          const segment *segs, Py_ssize_t nsegs, size_t chunk,
                          struct iovec *iov, struct iovec *hash_iov, read_result *out)
{
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    out->head_got = out->payload_got = 0;
    out->err = 0;
    int fd = open(path, flags);
    if (fd < 0) {
        out->err = errno;
        out->digest = XXH3_64bits_digest(&state);
        return;
    }
    Py_ssize_t seg = 0;
    size_t seg_off = 0;
    off_t file_off = 0;
    int first = 1;
    for (;;) {
        int cnt = 0, hcnt = 0;
        size_t want = 0, step = 0;
        if (first && head_len) {
            iov[cnt].iov_base = head;
            iov[cnt++].iov_len = head_len;
            want += head_len;
        }
        while (step < chunk && seg < nsegs) {
            size_t left = segs[seg].len - seg_off;
            size_t take = chunk - step < left ? chunk - step : left;
            if (take) {
                iov[cnt].iov_base = segs[seg].base + seg_off;
                iov[cnt++].iov_len = take;
                hash_iov[hcnt].iov_base = segs[seg].base + seg_off;
                hash_iov[hcnt++].iov_len = take;
                step += take;
            }
            seg_off += take;
            if (seg_off == segs[seg].len) {
                seg++;
                seg_off = 0;
            }
        }
        want += step;
        if (want == 0)
            break;
        ssize_t n = preadv_full(fd, iov, cnt, file_off);
        if (n < 0) {
            out->err = errno;
            break;
        }
        file_off += n;
        size_t got = (size_t)n;
        if (first && head_len) {
            size_t h = got < head_len ? got : head_len;
            out->head_got = h;
            got -= h;
        }
        out->payload_got += got;
        for (int k = 0; k < hcnt && got; k++) { /* hash what this step read, in order */
            size_t part = got < hash_iov[k].iov_len ? got : hash_iov[k].iov_len;
            XXH3_64bits_update(&state, hash_iov[k].iov_base, part);
            got -= part;
        }
        first = 0;
        if ((size_t)n < want)
            break; /* short: end of file */
    }
    out->digest = XXH3_64bits_digest(&state);
    if (close(fd) < 0 && out->err == 0 && errno != EINTR)
        out->err = errno;
}

/* Read ``path`` into head + segs without the GIL; the (head, payload, digest) tuple, or NULL with
 * OSError (naming ``path_arg``) set. */
static PyObject *read_into(PyObject *path_arg, PyObject *path_obj, int flags, Py_buffer *head,
                           const segment *segs, Py_ssize_t nsegs, Py_ssize_t chunk)
{
    /* one step spans at most every segment plus the head */
    struct iovec *iov = PyMem_Calloc((size_t)nsegs + 1, sizeof(struct iovec));
    struct iovec *hash_iov = PyMem_Calloc((size_t)nsegs + 1, sizeof(struct iovec));
    PyObject *result = NULL;
    if (!iov || !hash_iov) {
        PyErr_NoMemory();
        goto done;
    }
    read_result r;
    const char *path = PyBytes_AS_STRING(path_obj);
    Py_BEGIN_ALLOW_THREADS
    read_and_hash(path, flags, head->buf, (size_t)head->len, segs, nsegs, (size_t)chunk, iov,
                  hash_iov, &r);
    Py_END_ALLOW_THREADS
    if (r.err) {
        errno = r.err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_arg);
        goto done;
    }
    result = Py_BuildValue("nnK", (Py_ssize_t)r.head_got, (Py_ssize_t)r.payload_got,
                           (unsigned long long)r.digest);
done:
    PyMem_Free(iov);
    PyMem_Free(hash_iov);
    return result;
}

static PyObject *read_block(PyObject *self, PyObject *args)
{
    PyObject *path_arg, *path_obj, *head_obj, *views_obj;
    int flags;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "OiOOn", &path_arg, &flags, &head_obj, &views_obj, &chunk))
        return NULL;
    if (!PyUnicode_FSConverter(path_arg, &path_obj))   /* str or bytes -> bytes */
        return NULL;
    PyObject *result = NULL, *seq = NULL;
    Py_buffer head = {0};
    Py_buffer *bufs = NULL;
    segment *segs = NULL;
    Py_ssize_t nviews = 0, held = 0;
    if (chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        goto done;
    }
    if (PyObject_GetBuffer(head_obj, &head, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    seq = PySequence_Fast(views_obj, "views must be a sequence of buffers");
    if (seq == NULL)
        goto done;
    nviews = PySequence_Fast_GET_SIZE(seq);
    bufs = PyMem_Calloc((size_t)(nviews ? nviews : 1), sizeof(Py_buffer));
    segs = PyMem_Calloc((size_t)(nviews ? nviews : 1), sizeof(segment));
    if (!bufs || !segs) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < nviews; held++) {
        PyObject *v = PySequence_Fast_GET_ITEM(seq, held);
        if (PyObject_GetBuffer(v, &bufs[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        segs[held].base = bufs[held].buf;
        segs[held].len = (size_t)bufs[held].len;
    }
    result = read_into(path_arg, path_obj, flags, &head, segs, nviews, chunk);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&bufs[i]);
    if (head.obj)
        PyBuffer_Release(&head);
    PyMem_Free(bufs);
    PyMem_Free(segs);
    Py_XDECREF(seq);
    Py_DECREF(path_obj);
    return result;
}

/* The destination as one arena and (offset, length) runs in it (storage_gateway.destinations.
 * ArenaRuns, computed in closed form): no view per run is made, each run is checked to lie in
 * the arena. */
static PyObject *read_block_runs(PyObject *self, PyObject *args)
{
    PyObject *path_arg, *path_obj, *head_obj, *arena_obj, *offsets_obj, *lengths_obj;
    int flags;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "OiOOOOn", &path_arg, &flags, &head_obj, &arena_obj, &offsets_obj,
                          &lengths_obj, &chunk))
        return NULL;
    if (!PyUnicode_FSConverter(path_arg, &path_obj))
        return NULL;
    PyObject *result = NULL, *offs = NULL, *lens = NULL;
    Py_buffer head = {0}, arena = {0};
    segment *segs = NULL;
    if (chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        goto done;
    }
    if (PyObject_GetBuffer(head_obj, &head, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(arena_obj, &arena, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    offs = PySequence_Fast(offsets_obj, "offsets must be a sequence of ints");
    lens = offs ? PySequence_Fast(lengths_obj, "lengths must be a sequence of ints") : NULL;
    if (lens == NULL)
        goto done;
    Py_ssize_t nruns = PySequence_Fast_GET_SIZE(offs);
    if (PySequence_Fast_GET_SIZE(lens) != nruns) {
        PyErr_SetString(PyExc_ValueError, "offsets and lengths differ in length");
        goto done;
    }
    segs = PyMem_Calloc((size_t)(nruns ? nruns : 1), sizeof(segment));
    if (!segs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nruns; i++) {
        Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(offs, i));
        Py_ssize_t len = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(lens, i));
        if ((off == -1 || len == -1) && PyErr_Occurred())
            goto done;
        if (off < 0 || len < 0 || off > arena.len || len > arena.len - off) {
            PyErr_Format(PyExc_ValueError, "run %zd (%zd B at %zd) lies outside the %zd B arena",
                         i, len, off, arena.len);
            goto done;
        }
        segs[i].base = (char *)arena.buf + off;
        segs[i].len = (size_t)len;
    }
    result = read_into(path_arg, path_obj, flags, &head, segs, nruns, chunk);
done:
    if (head.obj)
        PyBuffer_Release(&head);
    if (arena.obj)
        PyBuffer_Release(&arena);
    PyMem_Free(segs);
    Py_XDECREF(offs);
    Py_XDECREF(lens);
    Py_DECREF(path_obj);
    return result;
}

static PyMethodDef methods[] = {
    {"read_block", read_block, METH_VARARGS,
     "read_block(path, flags, head, views, chunk) -> (head_bytes, payload_bytes, xxh3_64):\n"
     "read a block file into head + views, hashing the payload, without the GIL."},
    {"read_block_runs", read_block_runs, METH_VARARGS,
     "read_block_runs(path, flags, head, arena, offsets, lengths, chunk) -> (head_bytes,\n"
     "payload_bytes, xxh3_64): read_block into (offset, length) runs of one arena."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockread",
    "A Full Block read and xxh3-hashed in one GIL-free call (storage_gateway/native/blockread.c).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__blockread(void)
{
    return PyModule_Create(&module);
}
