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

/* hist_list[v] += counts[v] for v in 0..top (the list holds them all). */
static int
add_counts(PyObject *hist_list, const long long *counts, Py_ssize_t top)
{
    for (Py_ssize_t v = 0; v <= top; v++) {
        if (!counts[v])
            continue;
        PyObject *sum = PyLong_FromLongLong(
            PyLong_AsLongLong(PyList_GET_ITEM(hist_list, v)) + counts[v]);
        if (sum == NULL)
            return -1;
        PyList_SetItem(hist_list, v, sum); /* steals sum, drops the old count */
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* The row's previous owner leaves it: its tally, if any, goes to spills. */
static int
reassign(PyObject *owners, Py_ssize_t i, PyObject *req_id, long long *acc, long long *drf,
         PyObject *spills)
{
    PyObject *old = PyList_GET_ITEM(owners, i);
    if (old != Py_None && (acc[i] || drf[i])) {
        PyObject *spill = Py_BuildValue("(OLL)", old, drf[i], acc[i]);
        if (spill == NULL || PyList_Append(spills, spill) < 0) {
            Py_XDECREF(spill);
            return -1;
        }
        Py_DECREF(spill);
    }
    acc[i] = 0;
    drf[i] = 0;
    Py_INCREF(req_id);
    PyList_SetItem(owners, i, req_id);
    return 0;
}

static PyObject *
scan(PyObject *module, PyObject *args)
{
    PyObject *rows, *sampled, *spec, *scheduled, *owners, *requests, *acc_list, *drf_list;
    Py_buffer acc_buf = {0}, drf_buf = {0}, out_buf = {0};
    int prev_valid, track_padding, check_stale;
    PyObject *spills = NULL, *suspects = NULL, *overflow = NULL, *result = NULL;
    long long acc_hist[HIST_SIZE] = {0}, drf_hist[HIST_SIZE] = {0};
    Py_ssize_t acc_top = -1, drf_top = -1, padding = 0, empty = 0;

    if (!PyArg_ParseTuple(args, "O!O!O!O!O!w*w*w*pppO!O!O!", &PyList_Type, &rows,
                          &PyList_Type, &sampled, &PyDict_Type, &spec, &PyDict_Type,
                          &scheduled, &PyList_Type, &owners, &acc_buf, &drf_buf, &out_buf,
                          &prev_valid, &track_padding, &check_stale, &PyDict_Type, &requests,
                          &PyList_Type, &acc_list, &PyList_Type, &drf_list))
        return NULL;

    Py_ssize_t n = PyList_GET_SIZE(rows);
    if (PyList_GET_SIZE(sampled) != n || PyList_GET_SIZE(owners) < n ||
        acc_buf.len < n * (Py_ssize_t)sizeof(long long) ||
        drf_buf.len < n * (Py_ssize_t)sizeof(long long) || out_buf.len < n) {
        PyErr_SetString(PyExc_ValueError, "scan: buffers smaller than the batch");
        goto done;
    }
    if (check_stale) {
        int stale = any_stale(rows, spec, requests);
        if (stale < 0)
            goto done;
        if (stale) { /* a preempted request's in-flight output: the exact path's */
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
    }
    spills = PyList_New(0);
    suspects = PyList_New(0);
    overflow = PyList_New(0);
    if (spills == NULL || suspects == NULL || overflow == NULL)
        goto done;
    /* Values the totals' lists hold (and the local arrays). */
    Py_ssize_t acc_cap = PyList_GET_SIZE(acc_list), drf_cap = PyList_GET_SIZE(drf_list);
    if (acc_cap > HIST_SIZE)
        acc_cap = HIST_SIZE;
    if (drf_cap > HIST_SIZE)
        drf_cap = HIST_SIZE;

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
        if (same < 0 || (!same && reassign(owners, i, req_id, acc, drf, spills) < 0))
            goto done;
        /* vLLM skips output of a request no longer in the scheduler (freed
         * while its step was in flight). */
        if (PyDict_GetItemWithError(requests, req_id) == NULL) {
            if (PyErr_Occurred())
                goto done;
            had_output[i] = 0;
            continue;
        }
        if (d > 0 && s > 0) { /* a verified draft */
            Py_ssize_t a = s - 1;
            if (a < acc_cap && d < drf_cap) {
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
            acc[i] += a;
            drf[i] += d;
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

    if (add_counts(acc_list, acc_hist, acc_top) < 0 || add_counts(drf_list, drf_hist, drf_top) < 0)
        goto done;
    result = Py_BuildValue("(nnOOO)", padding, empty, spills, suspects, overflow);

done:
    Py_XDECREF(spills);
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

/* First index whose bound is >= rate (Python's bisect_left). */
static Py_ssize_t
bucket_of(const double *bounds, Py_ssize_t nb, double rate)
{
    Py_ssize_t lo = 0, hi = nb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (bounds[mid] < rate)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

#define MAX_BOUNDS 64

static PyObject *
release(PyObject *module, PyObject *args)
{
    PyObject *ids, *row_of, *owners, *spilled, *bounds_seq, *buckets;
    Py_buffer acc_buf = {0}, drf_buf = {0};
    PyObject *iter = NULL, *req_id = NULL, *result = NULL;
    double bounds[MAX_BOUNDS], rate_sum = 0.0, lo = 0.0, hi = 0.0;
    Py_ssize_t count = 0;

    if (!PyArg_ParseTuple(args, "OO!O!w*w*O!OO!", &ids, &PyDict_Type, &row_of, &PyList_Type,
                          &owners, &acc_buf, &drf_buf, &PyDict_Type, &spilled, &bounds_seq,
                          &PyList_Type, &buckets))
        return NULL;
    Py_ssize_t nb = PySequence_Size(bounds_seq);
    if (nb < 0)
        goto done;
    if (nb > MAX_BOUNDS || PyList_GET_SIZE(buckets) != nb + 1) {
        PyErr_SetString(PyExc_ValueError, "release: bounds and buckets do not match");
        goto done;
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        PyObject *bound = PySequence_GetItem(bounds_seq, b);
        if (bound == NULL)
            goto done;
        bounds[b] = PyFloat_AsDouble(bound);
        Py_DECREF(bound);
        if (bounds[b] == -1.0 && PyErr_Occurred())
            goto done;
    }
    long long *acc = (long long *)acc_buf.buf;
    long long *drf = (long long *)drf_buf.buf;
    Py_ssize_t rows = acc_buf.len / (Py_ssize_t)sizeof(long long);
    if (drf_buf.len / (Py_ssize_t)sizeof(long long) < rows)
        rows = drf_buf.len / (Py_ssize_t)sizeof(long long);
    if (PyList_GET_SIZE(owners) < rows)
        rows = PyList_GET_SIZE(owners);

    iter = PyObject_GetIter(ids);
    if (iter == NULL)
        goto done;
    while ((req_id = PyIter_Next(iter)) != NULL) {
        long long drafted = 0, accepted = 0;
        Py_ssize_t row = -1;
        PyObject *row_obj = PyDict_GetItemWithError(row_of, req_id);
        if (row_obj != NULL) {
            Py_ssize_t i = PyLong_AsSsize_t(row_obj);
            if (i == -1 && PyErr_Occurred())
                goto done;
            if (i >= 0 && i < rows) {
                int same = same_owner(PyList_GET_ITEM(owners, i), req_id);
                if (same < 0)
                    goto done;
                if (same)
                    row = i;
            }
        } else if (PyErr_Occurred()) {
            goto done;
        }
        /* Not where the index says (an index changed since): search the rows. */
        for (Py_ssize_t i = 0; row < 0 && i < rows; i++) {
            int same = same_owner(PyList_GET_ITEM(owners, i), req_id);
            if (same < 0)
                goto done;
            if (same)
                row = i;
        }
        if (row >= 0) {
            drafted += drf[row];
            accepted += acc[row];
            drf[row] = 0;
            acc[row] = 0;
            Py_INCREF(Py_None);
            PyList_SetItem(owners, row, Py_None);
        }
        if (PyDict_GET_SIZE(spilled)) {
            PyObject *tally = PyDict_GetItemWithError(spilled, req_id);
            if (tally != NULL) {
                long long d, a;
                if (!PyArg_ParseTuple(tally, "LL", &d, &a))
                    goto done;
                drafted += d;
                accepted += a;
                if (PyDict_DelItem(spilled, req_id) < 0)
                    goto done;
            } else if (PyErr_Occurred()) {
                goto done;
            }
        }
        Py_CLEAR(req_id);
        if (drafted <= 0)
            continue;
        double rate = (double)accepted / (double)drafted;
        Py_ssize_t b = bucket_of(bounds, nb, rate);
        PyObject *bumped = PyLong_FromLongLong(PyLong_AsLongLong(PyList_GET_ITEM(buckets, b)) + 1);
        if (bumped == NULL)
            goto done;
        PyList_SetItem(buckets, b, bumped);
        if (count == 0 || rate < lo)
            lo = rate;
        if (count == 0 || rate > hi)
            hi = rate;
        rate_sum += rate;
        count++;
    }
    if (PyErr_Occurred())
        goto done;
    result = Py_BuildValue("(nddd)", count, rate_sum, lo, hi);

done:
    Py_XDECREF(req_id);
    Py_XDECREF(iter);
    PyBuffer_Release(&acc_buf);
    PyBuffer_Release(&drf_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"release", release, METH_VARARGS,
     "release(ids, row_of, owners, accepted, drafted, spilled, bounds, buckets)"
     " -> (count, rate_sum, min, max): finished requests' tallies become rates"},
    {"scan", scan, METH_VARARGS,
     "scan(rows, sampled, spec_tokens, num_scheduled, owners, accepted, drafted, had_output,"
     " prev_valid, track_padding, check_stale, requests, accepted_hist, drafted_hist)"
     " -> (padding, empty, spills, suspects, overflow) or None"},
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
