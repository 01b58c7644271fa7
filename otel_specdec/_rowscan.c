/*
 * One pass over a step's batch rows: the accounting's common step in C.
 *
 * The pure-Python accounting makes about six C-level passes over the batch
 * per step; inside the engine, where the batch's objects are cold in the
 * CPU caches, each pass costs 25-60 ns per request. This module makes one
 * pass and touches each row's objects once. It only reads the host's
 * objects (lists, dicts, ints); it writes the plugin's own buffers.
 *
 * Optional: without a C compiler the package installs without it and the
 * pure-Python paths in _accounting.py are used. See _native.py for how the
 * Python side uses it, and for the meaning of each argument.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Values (accepted or drafted tokens per draft) counted in local arrays;
 * larger ones are returned one by one in the overflow list. */
#define HIST_SIZE 64

static PyObject *stale_attr; /* "num_stale_output_tokens", interned */

static Py_ssize_t
sized_len(PyObject *obj)
{
    if (PyList_CheckExact(obj))
        return PyList_GET_SIZE(obj);
    if (PyTuple_CheckExact(obj))
        return PyTuple_GET_SIZE(obj);
    return PyObject_Length(obj);
}

/* 1 if the row's recorded owner is req_id, 0 if not, -1 on error. */
static int
same_owner(PyObject *owner, PyObject *req_id)
{
    if (owner == req_id)
        return 1;
    if (owner == Py_None)
        return 0;
    return PyObject_RichCompareBool(owner, req_id, Py_EQ);
}

/* -1 sentinels in a draft whose last entry is negative (padding). */
static Py_ssize_t
padding_in(PyObject *drafts, Py_ssize_t d)
{
    PyObject *last = PySequence_GetItem(drafts, d - 1);
    if (last == NULL)
        return -1;
    long value = PyLong_Check(last) ? PyLong_AsLong(last) : 0;
    Py_DECREF(last);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value >= 0)
        return 0;
    Py_ssize_t count = 0;
    for (Py_ssize_t j = 0; j < d; j++) {
        PyObject *item = PySequence_GetItem(drafts, j);
        if (item == NULL)
            return -1;
        if (PyLong_Check(item) && PyLong_AsLong(item) == -1)
            count++;
        Py_DECREF(item);
    }
    return PyErr_Occurred() ? -1 : count;
}

/* 1 if a live request of the step has stale output pending, 0 if none. */
static int
any_stale(PyObject *rows, PyObject *spec, PyObject *requests)
{
    Py_ssize_t n = PyList_GET_SIZE(rows);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req_id = PyList_GET_ITEM(rows, i);
        if (PyDict_GetItemWithError(spec, req_id) == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        PyObject *request = PyDict_GetItemWithError(requests, req_id);
        if (request == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        PyObject *stale = PyObject_GetAttr(request, stale_attr);
        if (stale == NULL)
            return -1;
        int truth = PyObject_IsTrue(stale);
        Py_DECREF(stale);
        if (truth != 0)
            return truth;
    }
    return 0;
}

static int
append_index(PyObject *list, Py_ssize_t i)
{
    PyObject *value = PyLong_FromSsize_t(i);
    if (value == NULL)
        return -1;
    int rc = PyList_Append(list, value);
    Py_DECREF(value);
    return rc;
}

static PyObject *
counts_list(const long long *hist, Py_ssize_t top)
{
    PyObject *out = PyList_New(top + 1);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t v = 0; v <= top; v++) {
        PyObject *count = PyLong_FromLongLong(hist[v]);
        if (count == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, v, count);
    }
    return out;
}

static PyObject *
scan(PyObject *module, PyObject *args)
{
    PyObject *rows, *sampled, *spec, *scheduled, *owners, *requests;
    Py_buffer acc_buf = {0}, drf_buf = {0}, out_buf = {0};
    int prev_valid, track_padding;
    PyObject *changed = NULL, *suspects = NULL, *overflow = NULL, *result = NULL;
    long long acc_hist[HIST_SIZE] = {0}, drf_hist[HIST_SIZE] = {0};
    Py_ssize_t acc_top = -1, drf_top = -1, padding = 0, empty = 0;

    if (!PyArg_ParseTuple(args, "O!O!O!O!O!w*w*w*ppO", &PyList_Type, &rows, &PyList_Type,
                          &sampled, &PyDict_Type, &spec, &PyDict_Type, &scheduled,
                          &PyList_Type, &owners, &acc_buf, &drf_buf, &out_buf, &prev_valid,
                          &track_padding, &requests))
        return NULL;

    Py_ssize_t n = PyList_GET_SIZE(rows);
    if (PyList_GET_SIZE(sampled) != n || PyList_GET_SIZE(owners) < n ||
        acc_buf.len < n * (Py_ssize_t)sizeof(long long) ||
        drf_buf.len < n * (Py_ssize_t)sizeof(long long) || out_buf.len < n) {
        PyErr_SetString(PyExc_ValueError, "scan: buffers smaller than the batch");
        goto done;
    }
    if (requests != Py_None) {
        if (!PyDict_Check(requests)) {
            PyErr_SetString(PyExc_TypeError, "scan: requests must be a dict or None");
            goto done;
        }
        int stale = any_stale(rows, spec, requests);
        if (stale < 0)
            goto done;
        if (stale) { /* a preempted request's in-flight output: the exact path's */
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
    }
    changed = PyList_New(0);
    suspects = PyList_New(0);
    overflow = PyList_New(0);
    if (changed == NULL || suspects == NULL || overflow == NULL)
        goto done;

    long long *acc = (long long *)acc_buf.buf;
    long long *drf = (long long *)drf_buf.buf;
    unsigned char *had_output = (unsigned char *)out_buf.buf;

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req_id = PyList_GET_ITEM(rows, i);
        Py_ssize_t s = sized_len(PyList_GET_ITEM(sampled, i));
        if (s < 0)
            goto done;
        PyObject *drafts = PyDict_GetItemWithError(spec, req_id);
        Py_ssize_t d = 0;
        if (drafts != NULL) {
            d = sized_len(drafts);
            if (d < 0)
                goto done;
        } else if (PyErr_Occurred()) {
            goto done;
        }
        int same = same_owner(PyList_GET_ITEM(owners, i), req_id);
        if (same < 0 || (!same && append_index(changed, i) < 0))
            goto done;
        if (d > 0 && s > 0) { /* a verified draft */
            Py_ssize_t a = s - 1;
            if (a < HIST_SIZE && d < HIST_SIZE) {
                acc_hist[a]++;
                drf_hist[d]++;
                if (a > acc_top)
                    acc_top = a;
                if (d > drf_top)
                    drf_top = d;
            } else {
                PyObject *pair = Py_BuildValue("(nn)", a, d);
                if (pair == NULL || PyList_Append(overflow, pair) < 0) {
                    Py_XDECREF(pair);
                    goto done;
                }
                Py_DECREF(pair);
            }
            if (same) {
                acc[i] += a;
                drf[i] += d;
            }
            if (track_padding) {
                Py_ssize_t pad = padding_in(drafts, d);
                if (pad < 0)
                    goto done;
                padding += pad;
            }
        } else if (d == 0 && s > 0) { /* no draft: an empty proposal if decoding */
            PyObject *count = PyDict_GetItemWithError(scheduled, req_id);
            if (count == NULL) {
                if (PyErr_Occurred())
                    goto done;
            } else if (PyLong_Check(count) && PyLong_AsLong(count) == 1) {
                /* Same owner with output last step: decoding. Others: Python checks. */
                if (same && prev_valid && had_output[i])
                    empty++;
                else if (append_index(suspects, i) < 0)
                    goto done;
            } else if (PyErr_Occurred()) {
                goto done;
            }
        }
        had_output[i] = s > 0;
    }

    PyObject *acc_counts = counts_list(acc_hist, acc_top);
    PyObject *drf_counts = acc_counts ? counts_list(drf_hist, drf_top) : NULL;
    if (drf_counts == NULL) {
        Py_XDECREF(acc_counts);
        goto done;
    }
    result = Py_BuildValue("(NNnnOOO)", acc_counts, drf_counts, padding, empty, changed,
                           suspects, overflow);

done:
    Py_XDECREF(changed);
    Py_XDECREF(suspects);
    Py_XDECREF(overflow);
    if (acc_buf.obj)
        PyBuffer_Release(&acc_buf);
    if (drf_buf.obj)
        PyBuffer_Release(&drf_buf);
    if (out_buf.obj)
        PyBuffer_Release(&out_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(rows, sampled, spec_tokens, num_scheduled, owners, accepted, drafted, had_output,"
     " prev_valid, track_padding, requests_or_None) -> tuple or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_rowscan", "The accounting's common step in one C pass.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__rowscan(void)
{
    stale_attr = PyUnicode_InternFromString("num_stale_output_tokens");
    if (stale_attr == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
