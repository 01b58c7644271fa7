/*
 * The accounting's common step in C: one pass over a step's batch rows.
 *
 * Inside the engine's step the plugin's data and code are cold in the CPU
 * caches (the host's own loop has just run): each pure-Python pass over the
 * batch costs 25-60 ns per request, and each Python-level call about a
 * microsecond. A Scanner keeps the per-row tallies in C arrays and does a
 * step in one call and one pass, touching each row's objects once.
 *
 * It only reads the host's objects (lists, dicts, ints; the scheduler's
 * request table); it writes its own state and the plugin's totals (Python
 * lists of ints handed over at construction). All of it runs under the GIL.
 *
 * Optional: without a C compiler the package installs without it and
 * _accounting.py uses its pure-Python paths. _accounting.py documents the
 * rules; this file follows them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Values (accepted or drafted tokens per draft) counted in local arrays;
 * larger ones are returned one by one in the overflow list. */
#define HIST_SIZE 64
#define MAX_BOUNDS 64

static PyObject *stale_attr; /* "num_stale_output_tokens", interned */

typedef struct {
    PyObject_HEAD
    PyObject *owners;   /* list: row -> req_id or None */
    long long *acc;     /* per row: accepted tokens of the owner in this row */
    long long *drf;     /* per row: drafted tokens */
    unsigned char *had_output; /* per row: produced output in the previous step */
    Py_ssize_t cap;     /* rows allocated */
    int prev_valid;     /* the previous step went through scan() */
    int track_padding;
    int in_flight;      /* steps can be in flight (async scheduling, pipelines) */
    int check_stale;
    PyObject *spilled;  /* dict: req_id -> (drafted, accepted) of rows left */
    PyObject *requests; /* the scheduler's request table (dict) */
    PyObject *released; /* dict: req_id -> step it was released at (recent ones) */
    long long step;     /* scan() calls so far */
    long long keep_steps; /* steps a released id is remembered */
    PyObject *row_of;   /* the current step's batch index (dict), or NULL */
    PyObject *acc_hist; /* totals: drafts per accepted-prefix length (list) */
    PyObject *drf_hist; /* totals: drafts per drafted length (list) */
    PyObject *buckets;  /* totals: finished requests per rate bucket (list) */
    double bounds[MAX_BOUNDS];
    Py_ssize_t nb;
} Scanner;

typedef struct {
    Py_ssize_t count;
    double sum, lo, hi;
} Rates;

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

/* spilled[req_id] += (drafted, accepted) */
static int
spill(Scanner *self, PyObject *req_id, long long drafted, long long accepted)
{
    if (!drafted && !accepted)
        return 0;
    PyObject *previous = PyDict_GetItemWithError(self->spilled, req_id);
    if (previous != NULL) {
        long long d, a;
        if (!PyArg_ParseTuple(previous, "LL", &d, &a))
            return -1;
        drafted += d;
        accepted += a;
    } else if (PyErr_Occurred()) {
        return -1;
    }
    PyObject *tally = Py_BuildValue("(LL)", drafted, accepted);
    if (tally == NULL)
        return -1;
    int rc = PyDict_SetItem(self->spilled, req_id, tally);
    Py_DECREF(tally);
    return rc;
}

/* The row's owner leaves it (to new_owner, or None): its tally is spilled. */
static int
reassign(Scanner *self, Py_ssize_t i, PyObject *new_owner)
{
    PyObject *old = PyList_GET_ITEM(self->owners, i);
    if (old != Py_None && spill(self, old, self->drf[i], self->acc[i]) < 0)
        return -1;
    self->acc[i] = 0;
    self->drf[i] = 0;
    Py_INCREF(new_owner);
    PyList_SetItem(self->owners, i, new_owner); /* drops the old owner */
    return 0;
}

/* Hold exactly n rows: new rows are empty; rows past n are spilled. */
static int
fit(Scanner *self, Py_ssize_t n)
{
    Py_ssize_t m = PyList_GET_SIZE(self->owners);
    if (n > self->cap) {
        Py_ssize_t cap = n > 2 * self->cap ? n : 2 * self->cap;
        long long *acc = PyMem_Realloc(self->acc, cap * sizeof(long long));
        if (acc == NULL)
            goto nomem;
        self->acc = acc;
        long long *drf = PyMem_Realloc(self->drf, cap * sizeof(long long));
        if (drf == NULL)
            goto nomem;
        self->drf = drf;
        unsigned char *out = PyMem_Realloc(self->had_output, cap);
        if (out == NULL)
            goto nomem;
        self->had_output = out;
        self->cap = cap;
    }
    for (Py_ssize_t i = m; i < n; i++) {
        if (PyList_Append(self->owners, Py_None) < 0)
            return -1;
        self->acc[i] = 0;
        self->drf[i] = 0;
        self->had_output[i] = 0;
    }
    if (n < m) {
        for (Py_ssize_t i = n; i < m; i++)
            if (reassign(self, i, Py_None) < 0)
                return -1;
        if (PyList_SetSlice(self->owners, n, m, NULL) < 0)
            return -1;
    }
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* Forget released ids older than keep_steps. */
static int
prune_released(Scanner *self)
{
    PyObject *expired = PyList_New(0), *key, *value;
    Py_ssize_t pos = 0;
    if (expired == NULL)
        return -1;
    while (PyDict_Next(self->released, &pos, &key, &value)) {
        if (PyLong_AsLongLong(value) < self->step - self->keep_steps &&
            PyList_Append(expired, key) < 0)
            goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(expired); i++)
        if (PyDict_DelItem(self->released, PyList_GET_ITEM(expired, i)) < 0)
            goto fail;
    Py_DECREF(expired);
    return PyErr_Occurred() ? -1 : 0;
fail:
    Py_DECREF(expired);
    return -1;
}

/* 1 if a live request of the step has stale output pending, 0 if none. */
static int
any_stale(Scanner *self, PyObject *rows, PyObject *spec)
{
    Py_ssize_t n = PyList_GET_SIZE(rows);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req_id = PyList_GET_ITEM(rows, i);
        if (PyDict_GetItemWithError(spec, req_id) == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        PyObject *request = PyDict_GetItemWithError(self->requests, req_id);
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
append_index(PyObject **list, Py_ssize_t i)
{
    if (*list == NULL && (*list = PyList_New(0)) == NULL)
        return -1;
    PyObject *value = PyLong_FromSsize_t(i);
    if (value == NULL)
        return -1;
    int rc = PyList_Append(*list, value);
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
        PyList_SetItem(hist_list, v, sum); /* drops the old count */
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* First index whose bound is >= rate (Python's bisect_left). */
static Py_ssize_t
bucket_of(const Scanner *self, double rate)
{
    Py_ssize_t lo = 0, hi = self->nb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (self->bounds[mid] < rate)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The row req_id owns: where row_of says, else (no index) a search; -1: none. */
static int
find_row(Scanner *self, PyObject *req_id, Py_ssize_t *row)
{
    Py_ssize_t rows = PyList_GET_SIZE(self->owners);
    *row = -1;
    if (self->row_of != NULL) {
        /* The rows are this step's: a request not at its index is in none. */
        PyObject *index = PyDict_GetItemWithError(self->row_of, req_id);
        if (index == NULL)
            return PyErr_Occurred() ? -1 : 0;
        Py_ssize_t i = PyLong_AsSsize_t(index);
        if (i == -1 && PyErr_Occurred())
            return -1;
        if (i >= 0 && i < rows) {
            int same = same_owner(PyList_GET_ITEM(self->owners, i), req_id);
            if (same < 0)
                return -1;
            if (same)
                *row = i;
        }
        return 0;
    }
    for (Py_ssize_t i = 0; i < rows; i++) {
        int same = same_owner(PyList_GET_ITEM(self->owners, i), req_id);
        if (same < 0)
            return -1;
        if (same) {
            *row = i;
            return 0;
        }
    }
    return 0;
}

/* Finished requests: each tally (row plus spilled) becomes one rate. A
 * request released before has no tally left: releasing is idempotent. */
static int
release_ids(Scanner *self, PyObject *ids, Rates *rates)
{
    PyObject *iter = PyObject_GetIter(ids), *req_id;
    if (iter == NULL)
        return -1;
    PyObject *when = PyLong_FromLongLong(self->step);
    if (when == NULL) {
        Py_DECREF(iter);
        return -1;
    }
    while ((req_id = PyIter_Next(iter)) != NULL) {
        long long drafted = 0, accepted = 0;
        Py_ssize_t row;
        if (find_row(self, req_id, &row) < 0)
            goto fail;
        if (PyDict_SetItem(self->released, req_id, when) < 0)
            goto fail;
        if (row >= 0) {
            drafted += self->drf[row];
            accepted += self->acc[row];
            self->drf[row] = 0;
            self->acc[row] = 0;
        }
        if (PyDict_GET_SIZE(self->spilled)) {
            PyObject *tally = PyDict_GetItemWithError(self->spilled, req_id);
            if (tally != NULL) {
                long long d, a;
                if (!PyArg_ParseTuple(tally, "LL", &d, &a))
                    goto fail;
                drafted += d;
                accepted += a;
                if (PyDict_DelItem(self->spilled, req_id) < 0)
                    goto fail;
            } else if (PyErr_Occurred()) {
                goto fail;
            }
        }
        Py_DECREF(req_id);
        if (drafted <= 0)
            continue;
        double rate = (double)accepted / (double)drafted;
        Py_ssize_t b = bucket_of(self, rate);
        PyObject *bumped =
            PyLong_FromLongLong(PyLong_AsLongLong(PyList_GET_ITEM(self->buckets, b)) + 1);
        if (bumped == NULL)
            goto fail_iter;
        PyList_SetItem(self->buckets, b, bumped);
        if (rates->count == 0 || rate < rates->lo)
            rates->lo = rate;
        if (rates->count == 0 || rate > rates->hi)
            rates->hi = rate;
        rates->sum += rate;
        rates->count++;
    }
    Py_DECREF(when);
    Py_DECREF(iter);
    return PyErr_Occurred() ? -1 : 0;
fail:
    Py_DECREF(req_id);
fail_iter:
    Py_DECREF(when);
    Py_DECREF(iter);
    return -1;
}

static PyObject *
rates_or_none(const Rates *rates)
{
    if (!rates->count)
        Py_RETURN_NONE;
    return Py_BuildValue("(ddd)", rates->sum, rates->lo, rates->hi);
}

PyDoc_STRVAR(scan_doc,
"scan(rows, sampled, spec_tokens, num_scheduled, row_of, released)\n"
"-> (padding, empty, suspects, overflow, rates) or None\n\n"
"Account one step in row space (rows: the model runner's req_ids, in\n"
"row order; row_of: its req_id -> row index). Adds each verified draft\n"
"to the totals' histograms and to its row; rows whose owner changed get\n"
"the new owner (the old one's tally is spilled). Then releases the\n"
"requests in ``released`` (None or a collection of ids).\n\n"
"None: a request of the step has stale output (a preemption while a step\n"
"was in flight); nothing was changed. Otherwise: padding tokens; empty\n"
"proposals it could confirm; suspects: rows (or None) with one scheduled\n"
"token and no draft whose request it could not tell was decoding;\n"
"overflow: (accepted, drafted) pairs (or None) too large for the\n"
"histograms; rates: (sum, min, max) of released requests' rates, or None.");

static PyObject *
Scanner_scan(Scanner *self, PyObject *args)
{
    PyObject *rows, *sampled, *spec, *scheduled, *row_of, *released;
    PyObject *suspects = NULL, *overflow = NULL, *result = NULL;
    long long acc_hist[HIST_SIZE] = {0}, drf_hist[HIST_SIZE] = {0};
    Py_ssize_t acc_top = -1, drf_top = -1, padding = 0, empty = 0;
    Rates rates = {0, 0.0, 0.0, 0.0};

    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O", &PyList_Type, &rows, &PyList_Type, &sampled,
                          &PyDict_Type, &spec, &PyDict_Type, &scheduled, &PyDict_Type, &row_of,
                          &released))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows);
    if (PyList_GET_SIZE(sampled) != n) {
        PyErr_SetString(PyExc_ValueError, "scan: one output per row expected");
        return NULL;
    }
    if (self->check_stale) {
        int stale = any_stale(self, rows, spec);
        if (stale < 0)
            return NULL;
        if (stale) /* a preempted request's in-flight output: the exact path's */
            Py_RETURN_NONE;
    }
    Py_INCREF(row_of);
    Py_XSETREF(self->row_of, row_of);
    if (fit(self, n) < 0)
        return NULL;
    /* Values the totals' lists hold (and the local arrays). */
    Py_ssize_t acc_cap = PyList_GET_SIZE(self->acc_hist);
    Py_ssize_t drf_cap = PyList_GET_SIZE(self->drf_hist);
    if (acc_cap > HIST_SIZE)
        acc_cap = HIST_SIZE;
    if (drf_cap > HIST_SIZE)
        drf_cap = HIST_SIZE;
    long long *acc = self->acc, *drf = self->drf;
    unsigned char *had_output = self->had_output;
    int prev_valid = self->prev_valid;
    self->prev_valid = 0; /* until this step is through */
    self->step++;
    if (self->step % 8 == 0 && prune_released(self) < 0)
        return NULL;
    int check_released = PyDict_GET_SIZE(self->released) > 0;

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
        int same = same_owner(PyList_GET_ITEM(self->owners, i), req_id);
        if (same < 0 || (!same && reassign(self, i, req_id) < 0))
            goto done;
        /* vLLM skips output of a request no longer in the scheduler (freed
         * while its step was in flight). With one step at a time, such a
         * request was freed since this step's schedule, and every request
         * freed since the schedule is released before the step (_patch):
         * the few recent ids tell, without a lookup in the scheduler's
         * large, cold request table. With steps in flight, look it up. */
        int gone = 0;
        if (self->in_flight) {
            if (PyDict_GetItemWithError(self->requests, req_id) == NULL) {
                if (PyErr_Occurred())
                    goto done;
                gone = 1;
            }
        } else if (check_released && (gone = PyDict_Contains(self->released, req_id)) < 0) {
            goto done;
        }
        if (gone) {
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
                if (overflow == NULL && (overflow = PyList_New(0)) == NULL)
                    goto done;
                PyObject *pair = Py_BuildValue("(nn)", a, d);
                if (pair == NULL || PyList_Append(overflow, pair) < 0) {
                    Py_XDECREF(pair);
                    goto done;
                }
                Py_DECREF(pair);
            }
            acc[i] += a;
            drf[i] += d;
            if (self->track_padding) {
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
                else if (append_index(&suspects, i) < 0)
                    goto done;
            } else if (PyErr_Occurred()) {
                goto done;
            }
        }
        had_output[i] = s > 0;
    }
    if (add_counts(self->acc_hist, acc_hist, acc_top) < 0 ||
        add_counts(self->drf_hist, drf_hist, drf_top) < 0)
        goto done;
    self->prev_valid = 1;
    if (released != Py_None && release_ids(self, released, &rates) < 0)
        goto done;
    PyObject *rates_obj = rates_or_none(&rates);
    if (rates_obj == NULL)
        goto done;
    result = Py_BuildValue("(nnOON)", padding, empty, suspects ? suspects : Py_None,
                           overflow ? overflow : Py_None, rates_obj);

done:
    Py_XDECREF(suspects);
    Py_XDECREF(overflow);
    return result;
}

PyDoc_STRVAR(release_doc,
"release(ids, end_of_step=False) -> (sum, min, max) of the rates, or None\n\n"
"Finished requests: each tally becomes one rate in the totals' buckets.\n"
"Idempotent. end_of_step: afterwards let go of the step's batch index.");

static PyObject *
Scanner_release(Scanner *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"ids", "end_of_step", NULL};
    PyObject *ids;
    int end_of_step = 0;
    Rates rates = {0, 0.0, 0.0, 0.0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", keywords, &ids, &end_of_step))
        return NULL;
    int rc = ids == Py_None ? 0 : release_ids(self, ids, &rates);
    if (end_of_step)
        Py_CLEAR(self->row_of);
    if (rc < 0)
        return NULL;
    return rates_or_none(&rates);
}

static PyObject *
Scanner_add(Scanner *self, PyObject *args)
{
    Py_ssize_t row;
    long long drafted, accepted;
    if (!PyArg_ParseTuple(args, "nLL", &row, &drafted, &accepted))
        return NULL;
    if (row < 0 || row >= PyList_GET_SIZE(self->owners)) {
        PyErr_SetString(PyExc_IndexError, "add: no such row");
        return NULL;
    }
    self->drf[row] += drafted;
    self->acc[row] += accepted;
    Py_RETURN_NONE;
}

static PyObject *
Scanner_add_spilled(Scanner *self, PyObject *args)
{
    PyObject *req_id;
    long long drafted, accepted;
    if (!PyArg_ParseTuple(args, "OLL", &req_id, &drafted, &accepted))
        return NULL;
    if (spill(self, req_id, drafted, accepted) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Scanner_clear(Scanner *self, PyObject *Py_UNUSED(ignored))
{
    if (PyList_SetSlice(self->owners, 0, PyList_GET_SIZE(self->owners), NULL) < 0)
        return NULL;
    PyDict_Clear(self->spilled);
    PyDict_Clear(self->released);
    Py_CLEAR(self->row_of);
    self->prev_valid = 0;
    Py_RETURN_NONE;
}

static PyObject *
Scanner_invalidate(Scanner *self, PyObject *Py_UNUSED(ignored))
{
    self->prev_valid = 0;
    Py_RETURN_NONE;
}

static int
Scanner_init(Scanner *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"requests", "accepted_hist", "drafted_hist", "rate_bounds",
                               "rate_buckets", "track_padding", "in_flight", "keep_steps",
                               NULL};
    PyObject *requests, *acc_hist, *drf_hist, *bounds, *buckets;
    int track_padding, in_flight;
    long long keep_steps;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!OO!ppL", keywords, &PyDict_Type,
                                     &requests, &PyList_Type, &acc_hist, &PyList_Type,
                                     &drf_hist, &bounds, &PyList_Type, &buckets,
                                     &track_padding, &in_flight, &keep_steps))
        return -1;
    Py_ssize_t nb = PySequence_Size(bounds);
    if (nb < 0)
        return -1;
    if (nb > MAX_BOUNDS || PyList_GET_SIZE(buckets) != nb + 1) {
        PyErr_SetString(PyExc_ValueError, "Scanner: rate bounds and buckets do not match");
        return -1;
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        PyObject *bound = PySequence_GetItem(bounds, b);
        if (bound == NULL)
            return -1;
        self->bounds[b] = PyFloat_AsDouble(bound);
        Py_DECREF(bound);
        if (self->bounds[b] == -1.0 && PyErr_Occurred())
            return -1;
    }
    self->nb = nb;
    PyObject *owners = PyList_New(0), *spilled = PyDict_New(), *released = PyDict_New();
    if (owners == NULL || spilled == NULL || released == NULL) {
        Py_XDECREF(owners);
        Py_XDECREF(spilled);
        Py_XDECREF(released);
        return -1;
    }
    Py_XSETREF(self->owners, owners);
    Py_XSETREF(self->spilled, spilled);
    Py_XSETREF(self->released, released);
    self->keep_steps = keep_steps;
    self->step = 0;
    Py_INCREF(requests);
    Py_XSETREF(self->requests, requests);
    Py_INCREF(acc_hist);
    Py_XSETREF(self->acc_hist, acc_hist);
    Py_INCREF(drf_hist);
    Py_XSETREF(self->drf_hist, drf_hist);
    Py_INCREF(buckets);
    Py_XSETREF(self->buckets, buckets);
    Py_CLEAR(self->row_of);
    self->track_padding = track_padding;
    self->in_flight = in_flight;
    self->check_stale = 0;
    self->prev_valid = 0;
    return 0;
}

static int
Scanner_traverse(Scanner *self, visitproc visit, void *arg)
{
    Py_VISIT(self->owners);
    Py_VISIT(self->spilled);
    Py_VISIT(self->released);
    Py_VISIT(self->requests);
    Py_VISIT(self->row_of);
    Py_VISIT(self->acc_hist);
    Py_VISIT(self->drf_hist);
    Py_VISIT(self->buckets);
    return 0;
}

static int
Scanner_clear_refs(Scanner *self)
{
    Py_CLEAR(self->owners);
    Py_CLEAR(self->spilled);
    Py_CLEAR(self->released);
    Py_CLEAR(self->requests);
    Py_CLEAR(self->row_of);
    Py_CLEAR(self->acc_hist);
    Py_CLEAR(self->drf_hist);
    Py_CLEAR(self->buckets);
    return 0;
}

static void
Scanner_dealloc(Scanner *self)
{
    PyObject_GC_UnTrack(self);
    Scanner_clear_refs(self);
    PyMem_Free(self->acc);
    PyMem_Free(self->drf);
    PyMem_Free(self->had_output);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Scanner_get_owners(Scanner *self, void *closure)
{
    return Py_NewRef(self->owners);
}

static PyObject *
Scanner_get_spilled(Scanner *self, void *closure)
{
    return Py_NewRef(self->spilled);
}

static PyObject *
Scanner_get_released(Scanner *self, void *closure)
{
    return Py_NewRef(self->released);
}

static PyObject *
Scanner_get_check_stale(Scanner *self, void *closure)
{
    return PyBool_FromLong(self->check_stale);
}

static int
Scanner_set_check_stale(Scanner *self, PyObject *value, void *closure)
{
    int truth = value == NULL ? 0 : PyObject_IsTrue(value);
    if (truth < 0)
        return -1;
    self->check_stale = truth;
    return 0;
}

static PyObject *
Scanner_row_counts(Scanner *self, PyObject *args)
{
    Py_ssize_t row;
    if (!PyArg_ParseTuple(args, "n", &row))
        return NULL;
    if (row < 0 || row >= PyList_GET_SIZE(self->owners)) {
        PyErr_SetString(PyExc_IndexError, "row_counts: no such row");
        return NULL;
    }
    return Py_BuildValue("(LL)", self->drf[row], self->acc[row]);
}

static PyMethodDef Scanner_methods[] = {
    {"scan", (PyCFunction)Scanner_scan, METH_VARARGS, scan_doc},
    {"release", (PyCFunction)(void (*)(void))Scanner_release, METH_VARARGS | METH_KEYWORDS,
     release_doc},
    {"add", (PyCFunction)Scanner_add, METH_VARARGS,
     "add(row, drafted, accepted): correct one row's tally"},
    {"add_spilled", (PyCFunction)Scanner_add_spilled, METH_VARARGS,
     "add_spilled(req_id, drafted, accepted): add to a request's tally outside the rows"},
    {"row_counts", (PyCFunction)Scanner_row_counts, METH_VARARGS,
     "row_counts(row) -> (drafted, accepted)"},
    {"clear", (PyCFunction)Scanner_clear, METH_NOARGS, "forget every tally"},
    {"invalidate", (PyCFunction)Scanner_invalidate, METH_NOARGS,
     "the last step did not go through scan()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Scanner_getset[] = {
    {"owners", (getter)Scanner_get_owners, NULL, "row -> request id (or None)", NULL},
    {"spilled", (getter)Scanner_get_spilled, NULL,
     "request id -> (drafted, accepted) of requests not in a row", NULL},
    {"released", (getter)Scanner_get_released, NULL,
     "request id -> step, of the requests released in the last keep_steps steps", NULL},
    {"check_stale", (getter)Scanner_get_check_stale, (setter)Scanner_set_check_stale,
     "look for stale in-flight output before each step", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_specdec._rowscan.Scanner",
    .tp_doc = PyDoc_STR("Per-row tallies of one scheduler, and its common step in one pass."),
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_traverse = (traverseproc)Scanner_traverse,
    .tp_clear = (inquiry)Scanner_clear_refs,
    .tp_methods = Scanner_methods,
    .tp_getset = Scanner_getset,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_rowscan", "The accounting's common step in one C pass.", -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__rowscan(void)
{
    stale_attr = PyUnicode_InternFromString("num_stale_output_tokens");
    if (stale_attr == NULL || PyType_Ready(&ScannerType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(module, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
