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
 * without it (a test runs both on the same inputs). Knows nothing else of the policy. The draws
 * are all taken first (the Python loop takes each as it goes), so neither callback may draw from
 * ``random``'s stream; the policy's do not. The arrays' buffers are held between callbacks only.
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

/* The classes' and lasts' buffers, held only while no Python code runs. */
typedef struct {
    PyObject *class_array, *last_array;
    Py_buffer classes, lasts;
    int held;
} LeafArrays;

static void let_go(LeafArrays *arrays) {
    if (arrays->held) {
        PyBuffer_Release(&arrays->classes);
        PyBuffer_Release(&arrays->lasts);
        arrays->held = 0;
    }
}

/* Leaf ``at``'s class and last reference, from the arrays' buffers (taken if not held; the
 * caller lets them go before any callback, so the policy may resize the arrays meanwhile). 0
 * with an exception set when a buffer is of the wrong type or too short. */
static int read_leaf(LeafArrays *arrays, Py_ssize_t at, unsigned short *cls, long long *last) {
    if (!arrays->held) {
        if (!typed_buffer(arrays->class_array, &arrays->classes, "H", "classes")) return 0;
        if (!typed_buffer(arrays->last_array, &arrays->lasts, "q", "lasts")) {
            PyBuffer_Release(&arrays->classes);
            return 0;
        }
        arrays->held = 1;
    }
    if (at >= arrays->classes.len / (Py_ssize_t)sizeof(unsigned short) ||
        at >= arrays->lasts.len / (Py_ssize_t)sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "classes and lasts need an item per leaf");
        return 0;
    }
    *cls = ((const unsigned short *)arrays->classes.buf)[at];
    *last = ((const long long *)arrays->lasts.buf)[at];
    return 1;
}

/* ``draws`` calls of ``random``, each checked to lie in [0, 1), into ``out``. 0 with an
 * exception set otherwise. */
static int draw_all(PyObject *random, Py_ssize_t draws, double *out) {
    for (Py_ssize_t i = 0; i < draws; i++) {
        PyObject *drawn = PyObject_CallNoArgs(random);
        if (drawn == NULL) return 0;
        out[i] = PyFloat_AsDouble(drawn);
        Py_DECREF(drawn);
        if (out[i] == -1.0 && PyErr_Occurred()) return 0;
        if (!(out[i] >= 0.0 && out[i] < 1.0)) {
            PyErr_SetString(PyExc_ValueError, "random() must return a float in [0, 1)");
            return 0;
        }
    }
    return 1;
}

#define STACK_DRAWS 64

static PyObject *least_dense(PyObject *self, PyObject *args) {
    Py_ssize_t samples;
    long long now;
    PyObject *random, *leaves, *class_array, *last_array, *densities, *small, *bucket_slow, *eligible;
    if (!PyArg_ParseTuple(args, "nOO!OOO!O!LOO", &samples, &random, &PyList_Type, &leaves, &class_array,
                          &last_array, &PyList_Type, &densities, &PyTuple_Type, &small, &now, &bucket_slow,
                          &eligible))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(leaves);  /* as the Python loop: drawn over the length at the start */
    const Py_ssize_t draws = samples < n ? samples : n;
    double on_stack[STACK_DRAWS];
    double *drawn = draws <= STACK_DRAWS ? on_stack : PyMem_New(double, draws);
    if (drawn == NULL) return PyErr_NoMemory();
    LeafArrays arrays = {class_array, last_array, .held = 0};
    PyObject *best = Py_None;
    Py_INCREF(best);
    if (!draw_all(random, draws, drawn)) goto fail;
    const Py_ssize_t smallest_slow = PyTuple_GET_SIZE(small);
    double best_density = INFINITY;
    for (Py_ssize_t i = 0; i < draws; i++) {
        const Py_ssize_t at = (Py_ssize_t)(drawn[i] * (double)n);
        unsigned short cls;
        long long last;
        if (!read_leaf(&arrays, at, &cls, &last)) goto fail;
        const long long age = now - last;
        Py_ssize_t bucket;
        if (age < smallest_slow) {  /* a negative age indexes from the end, as in Python */
            const Py_ssize_t small_at = (Py_ssize_t)(age < 0 ? age + smallest_slow : age);
            if (!in_range(small_at, smallest_slow, "small age")) goto fail;
            bucket = PyLong_AsSsize_t(PyTuple_GET_ITEM(small, small_at));
        } else {
            let_go(&arrays);  /* Python code runs next */
            PyObject *boxed = PyLong_FromLongLong(age);
            PyObject *result = boxed == NULL ? NULL : PyObject_CallOneArg(bucket_slow, boxed);
            Py_XDECREF(boxed);
            if (result == NULL) goto fail;
            bucket = PyLong_AsSsize_t(result);
            Py_DECREF(result);
        }
        if (bucket == -1 && PyErr_Occurred()) goto fail;
        if (!in_range(cls, PyList_GET_SIZE(densities), "class")) goto fail;
        PyObject *row = PyList_GET_ITEM(densities, cls);
        if (!PyList_Check(row)) {
            PyErr_SetString(PyExc_TypeError, "densities must be a list of lists");
            goto fail;
        }
        if (!in_range(bucket, PyList_GET_SIZE(row), "age bucket")) goto fail;
        PyObject *item = PyList_GET_ITEM(row, bucket);
        Py_INCREF(item);
        if (!PyFloat_CheckExact(item)) let_go(&arrays);  /* its __float__ is Python code */
        const double density = PyFloat_AsDouble(item);
        Py_DECREF(item);
        if (density == -1.0 && PyErr_Occurred()) goto fail;
        if (!(density < best_density)) continue;
        let_go(&arrays);  /* Python code runs next */
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
    let_go(&arrays);
    if (drawn != on_stack) PyMem_Free(drawn);
    return best;
fail:
    let_go(&arrays);
    if (drawn != on_stack) PyMem_Free(drawn);
    Py_DECREF(best);
    return NULL;
}

static PyMethodDef methods[] = {
    {"least_dense", least_dense, METH_VARARGS, "HitDensity's sampling loop; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sampling", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sampling(void) { return PyModule_Create(&module); }
