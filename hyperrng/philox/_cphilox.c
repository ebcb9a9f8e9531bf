/*
 * Philox4x32-10 words on the host CPU, for hyperrng.philox's torch backend.
 *
 * words(out, k0, k1, first): block first + i of key (k0, k1) into column i of out, a
 * C-contiguous uint64 buffer of shape (4, m) (row w holds word w of every block, each below
 * 2**32), exactly what hyperrng.philox._torch computes with NumPy when this module is absent.
 * bernoulli(out, k0, k1, start, threshold): element j of out (float32, float64 or bool)
 * becomes 1 where the word of global index start + j (lane j % 4 of block j // 4, as every
 * portable draw reads it) is below threshold: a small dropout's noise in one pass. The counter of block b is (b mod 2**32, b div 2**32, 0, 0); each round multiplies
 * words 0 and 2 by M0 and M1, and the high halves XORed with words 3 and 1 and the round
 * keys become words 2 and 0, the low halves words 3 and 1 (Salmon et al., SC'11; Random123).
 *
 * Optional: the install builds it where a C compiler is present (pyproject.toml's ext-modules),
 * and the NumPy path serves the same words everywhere else (tests/philox/test_philox_host.py proves the
 * two equal).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define PHILOX_ROUNDS 10
#define RELEASE_GIL_WORDS 16384 /* fewer take less time than handing the GIL to another thread and back */

/* The four words of block `block` of key (k0, k1). */
static inline void
philox_block(uint64_t block, uint32_t k0, uint32_t k1, uint32_t out[4])
{
    uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32), c2 = 0, c3 = 0;
    for (int r = 0; r < PHILOX_ROUNDS; r++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

static void
philox_words(uint64_t *out, Py_ssize_t m, uint32_t k0, uint32_t k1, uint64_t first)
{
    uint32_t w[4];
    for (Py_ssize_t i = 0; i < m; i++) {
        philox_block(first + (uint64_t)i, k0, k1, w);
        out[i] = w[0];
        out[m + i] = w[1];
        out[2 * m + i] = w[2];
        out[3 * m + i] = w[3];
    }
}

/* Element j of out is 1 where the word of global index start + j is below threshold, else 0. */
#define BERNOULLI_LOOP(type)                                                                  \
    do {                                                                                      \
        type *dst = (type *)out;                                                              \
        uint32_t w[4];                                                                        \
        uint64_t index = start;                                                               \
        for (Py_ssize_t j = 0; j < n;) {                                                      \
            philox_block(index >> 2, k0, k1, w);                                              \
            for (unsigned lane = (unsigned)(index & 3); lane < 4 && j < n; lane++, j++, index++) { \
                dst[j] = (type)(w[lane] < threshold);                                         \
            }                                                                                 \
        }                                                                                     \
    } while (0)

static void
philox_bernoulli(void *out, char kind, Py_ssize_t n, uint32_t k0, uint32_t k1, uint64_t start, uint64_t threshold)
{
    if (kind == 'f') {
        BERNOULLI_LOOP(float);
    } else if (kind == 'd') {
        BERNOULLI_LOOP(double);
    } else {
        BERNOULLI_LOOP(unsigned char);
    }
}

/* The element kind of a buffer: 'Q' (uint64), 'f' (float32), 'd' (float64), '?' (bool), or 0. */
static char
element_kind(const Py_buffer *view)
{
    const char *format = view->format;
    if (format == NULL) {
        return 0;
    }
    if (*format == '<' || *format == '=' || *format == '@') {
        format++;
    }
    if (format[0] == 0 || format[1] != 0) {
        return 0;
    }
    switch (format[0]) {
    case 'Q':
        return view->itemsize == 8 ? 'Q' : 0;
    case 'L':
        return view->itemsize == 8 && sizeof(unsigned long) == 8 ? 'Q' : 0;
    case 'f':
        return view->itemsize == 4 ? 'f' : 0;
    case 'd':
        return view->itemsize == 8 ? 'd' : 0;
    case '?':
        return view->itemsize == 1 ? '?' : 0;
    default:
        return 0;
    }
}

/* A PyArg converter: an int in [0, 2**64 - 1], refused (OverflowError, TypeError) rather than wrapped. */
static int
to_u64(PyObject *obj, void *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        return 0;
    }
    *(unsigned long long *)out = value;
    return 1;
}

/* Check the key words and open `target` as a writable C-contiguous buffer of one of `kinds`; 0 with the buffer open, or -1 with an exception set and nothing open. */
static int
open_target(const char *name, PyObject *target, unsigned long long k0, unsigned long long k1, const char *kinds,
            const char *expected, Py_buffer *view)
{
    if (k0 > 0xFFFFFFFFull || k1 > 0xFFFFFFFFull) {
        PyErr_Format(PyExc_ValueError, "%s: key words must be below 2**32", name);
        return -1;
    }
    if (PyObject_GetBuffer(target, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    char kind = element_kind(view);
    if (kind == 0 || strchr(kinds, kind) == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: out must be a writable C-contiguous %s", name, expected);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Whether `count` items from `first` stay below 2**64, else -1 with an exception set. */
static int
check_end(const char *name, const char *what, unsigned long long first, Py_ssize_t count)
{
    if (count > 0 && first > UINT64_MAX - (unsigned long long)(count - 1)) {
        PyErr_Format(PyExc_ValueError, "%s: %s must stay below 2**64", name, what);
        return -1;
    }
    return 0;
}

static PyObject *
words(PyObject *self, PyObject *args)
{
    PyObject *target;
    unsigned long long k0, k1, first;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OO&O&O&:words", &target, to_u64, &k0, to_u64, &k1, to_u64, &first)
        || open_target("words", target, k0, k1, "Q", "uint64 buffer of shape (4, m)", &view) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (view.ndim != 2 || view.shape == NULL || view.shape[0] != 4) {
        PyErr_SetString(PyExc_ValueError, "words: out must be a writable C-contiguous uint64 buffer of shape (4, m)");
    } else if (check_end("words", "block indices", first, view.shape[1]) == 0) {
        Py_ssize_t m = view.shape[1];
        PyThreadState *released = 4 * m >= RELEASE_GIL_WORDS ? PyEval_SaveThread() : NULL; /* the buffer stays held */
        philox_words((uint64_t *)view.buf, m, (uint32_t)k0, (uint32_t)k1, (uint64_t)first);
        if (released != NULL) {
            PyEval_RestoreThread(released);
        }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return result;
}

static PyObject *
bernoulli(PyObject *self, PyObject *args)
{
    PyObject *target;
    unsigned long long k0, k1, start, threshold;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OO&O&O&O&:bernoulli", &target, to_u64, &k0, to_u64, &k1, to_u64, &start, to_u64,
                          &threshold)) {
        return NULL;
    }
    if (threshold > 0x100000000ull) {
        PyErr_SetString(PyExc_ValueError, "bernoulli: the threshold must be at most 2**32");
        return NULL;
    }
    if (open_target("bernoulli", target, k0, k1, "fd?", "float32, float64 or bool buffer", &view) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = view.len / view.itemsize;
    if (check_end("bernoulli", "global indices", start, n) == 0) {
        char kind = element_kind(&view);
        PyThreadState *released = n >= RELEASE_GIL_WORDS ? PyEval_SaveThread() : NULL;
        philox_bernoulli(view.buf, kind, n, (uint32_t)k0, (uint32_t)k1, (uint64_t)start, (uint64_t)threshold);
        if (released != NULL) {
            PyEval_RestoreThread(released);
        }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"words", words, METH_VARARGS,
     "words(out, k0, k1, first): Philox4x32-10 words of blocks first, first + 1, ... of key (k0, k1) into the\n"
     "C-contiguous uint64 buffer out of shape (4, m), row w holding word w of each block."},
    {"bernoulli", bernoulli, METH_VARARGS,
     "bernoulli(out, k0, k1, start, threshold): element j of the C-contiguous float32, float64 or bool\n"
     "buffer out becomes 1 where the Philox word of global index start + j under key (k0, k1) is below\n"
     "threshold (at most 2**32), else 0."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED}, /* no state: each call writes only its own buffer */
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hyperrng.philox._cphilox",
    .m_doc = "Philox4x32-10 words on the host CPU (optional; NumPy computes the same words without it).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__cphilox(void)
{
    return PyModuleDef_Init(&module);
}
