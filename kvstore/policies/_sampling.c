/* kvstore.policies._sampling: HitDensity's sampling loop (HitDensityPolicy._least_dense) in C.
 *
 * least_dense(samples, random, leaves, classes, lasts, densities, small, now, bucket_slow, eligible)
 *     -> the sampled leaf of least density that ``eligible`` accepts, or None
 *
 *   samples      leaves to draw (with replacement), at most len(leaves) of them
 *   random       a random.Random's bound ``random`` method: leaf ``int(random() * n)`` is drawn
 *   leaves       list of leaf keys, n of them
 *   classes      array('H') of each leaf's fine class
 *   lasts        array('q') of each leaf's last reference (on the policy's clock)
 *   densities    list of lists of float: [fine class][age bucket] -> hit density
 *   small        tuple of int: the age bucket of every age below len(small)
 *   now          the policy's clock
 *   bucket_slow  callable: the age bucket of an age of len(small) or more
 *   eligible     callable on a key; asked only of a sample less dense than the best so far
 *
 * Exactly the Python loop: the same draws from the same stream, the same float comparisons in the
 * same order, ``eligible`` asked of the same keys. So a policy evicts the same blocks with or
 * without it (a test runs both on the same inputs). Knows nothing else of the policy.
 *
 * Why it exists: the loop is a fifth of an ``adaptive`` replay's time in Python, 32 draws per
 * eviction and one more per candidate's miniature.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

static int in_range(Py_ssize_t at, Py_ssize_t size, const char *what) {
    if (at < 0 || at >= size) {
        PyErr_Format(PyExc_IndexError, "%s index %zd out of range (%zd)", what, at, size);
        return 0;
    }
    return 1;
}

/* A C-contiguous buffer of ``obj`` whose items have struct format ``format``; 0 with an
 * exception set otherwise. */
static int typed_buffer(PyObject *obj, Py_buffer *view, const char *format, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return 0;
    if (view->format == NULL || strcmp(view->format, format) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be an array('%s')", what, format);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* The age bucket of ``age``: small[age] (a negative age indexes from the end, as in Python), else
 * bucket_slow(age). -1 with an exception set on failure. */
static Py_ssize_t bucket_of(long long age, PyObject *small, PyObject *bucket_slow) {
    const Py_ssize_t smallest_slow = PyTuple_GET_SIZE(small);
    if (age < smallest_slow) {
        Py_ssize_t at = (Py_ssize_t)(age < 0 ? age + smallest_slow : age);
        if (!in_range(at, smallest_slow, "small age")) return -1;
        return PyLong_AsSsize_t(PyTuple_GET_ITEM(small, at));
    }
    PyObject *boxed = PyLong_FromLongLong(age);
    if (boxed == NULL) return -1;
    PyObject *result = PyObject_CallOneArg(bucket_slow, boxed);
    Py_DECREF(boxed);
    if (result == NULL) return -1;
    Py_ssize_t bucket = PyLong_AsSsize_t(result);
    Py_DECREF(result);
    return bucket;
}

/* Leaf ``at``'s class and last reference, read from the arrays' buffers, which are let go at
 * once: no callback runs while they are held, so the policy may resize the arrays meanwhile. 0
 * with an exception set when a buffer is of the wrong type or too short. */
static int read_leaf(PyObject *class_array, PyObject *last_array, Py_ssize_t at, unsigned short *cls,
                     long long *last) {
    Py_buffer classes, lasts;
    if (!typed_buffer(class_array, &classes, "H", "classes")) return 0;
    if (!typed_buffer(last_array, &lasts, "q", "lasts")) {
        PyBuffer_Release(&classes);
        return 0;
    }
    int ok = at < classes.len / (Py_ssize_t)sizeof(unsigned short) && at < lasts.len / (Py_ssize_t)sizeof(long long);
    if (ok) {
        *cls = ((const unsigned short *)classes.buf)[at];
        *last = ((const long long *)lasts.buf)[at];
    } else {
        PyErr_SetString(PyExc_ValueError, "classes and lasts need an item per leaf");
    }
    PyBuffer_Release(&classes);
    PyBuffer_Release(&lasts);
    return ok;
}

static PyObject *least_dense(PyObject *self, PyObject *args) {
    Py_ssize_t samples;
    long long now;
    PyObject *random, *leaves, *class_array, *last_array, *densities, *small, *bucket_slow, *eligible;
    if (!PyArg_ParseTuple(args, "nOO!OOO!O!LOO", &samples, &random, &PyList_Type, &leaves, &class_array,
                          &last_array, &PyList_Type, &densities, &PyTuple_Type, &small, &now, &bucket_slow,
                          &eligible))
        return NULL;
    PyObject *best = Py_None;
    Py_INCREF(best);
    const Py_ssize_t n = PyList_GET_SIZE(leaves);  /* as the Python loop: drawn over the length at the start */
    const Py_ssize_t draws = samples < n ? samples : n;
    double best_density = INFINITY;
    for (Py_ssize_t i = 0; i < draws; i++) {
        PyObject *drawn = PyObject_CallNoArgs(random);
        if (drawn == NULL) goto fail;
        const double r = PyFloat_AsDouble(drawn);
        Py_DECREF(drawn);
        if (r == -1.0 && PyErr_Occurred()) goto fail;
        if (!(r >= 0.0 && r < 1.0)) {
            PyErr_SetString(PyExc_ValueError, "random() must return a float in [0, 1)");
            goto fail;
        }
        const Py_ssize_t at = (Py_ssize_t)(r * (double)n);
        unsigned short cls;
        long long last;
        if (!read_leaf(class_array, last_array, at, &cls, &last)) goto fail;
        const Py_ssize_t bucket = bucket_of(now - last, small, bucket_slow);
        if (bucket == -1 && PyErr_Occurred()) goto fail;
        if (!in_range(cls, PyList_GET_SIZE(densities), "class")) goto fail;
        PyObject *row = PyList_GET_ITEM(densities, cls);
        if (!PyList_Check(row)) {
            PyErr_SetString(PyExc_TypeError, "densities must be a list of lists");
            goto fail;
        }
        if (!in_range(bucket, PyList_GET_SIZE(row), "age bucket")) goto fail;
        const double density = PyFloat_AsDouble(PyList_GET_ITEM(row, bucket));
        if (density == -1.0 && PyErr_Occurred()) goto fail;
        if (!(density < best_density)) continue;
        if (!in_range(at, PyList_GET_SIZE(leaves), "leaf")) goto fail;  /* a callback may have shrunk it */
        PyObject *key = PyList_GET_ITEM(leaves, at);
        Py_INCREF(key);
        PyObject *verdict = PyObject_CallOneArg(eligible, key);
        int accepted = verdict == NULL ? -1 : PyObject_IsTrue(verdict);
        Py_XDECREF(verdict);
        if (accepted < 0) {
            Py_DECREF(key);
            goto fail;
        }
        if (accepted) {
            Py_SETREF(best, key);
            best_density = density;
        } else {
            Py_DECREF(key);
        }
    }
    return best;
fail:
    Py_DECREF(best);
    return NULL;
}

static PyMethodDef methods[] = {
    {"least_dense", least_dense, METH_VARARGS, "HitDensity's sampling loop; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sampling", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sampling(void) { return PyModule_Create(&module); }
