/*
 * The accounting's common step in C: one call and one pass per engine step.
 *
 * Inside the engine's step the plugin's data and code are cold in the CPU
 * caches (the host's own loop has just run): each pure-Python pass over the
 * batch costs 25-60 ns per request, and each Python-level call about a
 * microsecond. A Scanner keeps the per-row tallies in C arrays and accounts
 * a whole step in one call (Scanner.step): it reads the step's inputs from
 * vLLM's own objects, passes over the rows once, touching each row's objects
 * once, and adds the results to the totals itself. A step it cannot take
 * whole it declines before changing anything, and the exact Python path
 * (_accounting.py) runs instead.
 *
 * It only reads the host's objects (lists, dicts, ints; the scheduler's
 * request table); it writes its own state and the plugin's totals (the
 * Python lists and dict of a SpecDecodeTotals, taken at construction). All
 * of it runs under the GIL.
 *
 * Optional: without a C compiler the package installs without it and
 * _accounting.py uses its pure-Python paths. _accounting.py documents the
 * rules; this file follows them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Values (accepted or drafted tokens per draft) counted in local arrays;
 * larger ones are returned one by one for Python to add. */
#define HIST_SIZE 64
#define MAX_BOUNDS 64
/* Where the step's inputs are: attribute names handed over by _vllm_compat
 * (its STEP_FIELDS, as a dict keyed by these roles; None: the running vLLM
 * has no such field). */
enum {
    F_SPEC, F_SCHEDULED, F_INVALID, F_FINISHED, /* on the SchedulerOutput */
    F_SAMPLED, F_ROW_OF, F_ROWS, F_KV,          /* on the ModelRunnerOutput */
    F_KV_FAILED,                                /* on its KV connector output */
    F_STALE,                                    /* on a Request */
    N_FIELDS
};
static const char *const field_roles[N_FIELDS] = {
    "spec_tokens", "num_scheduled", "invalid_spec_tokens", "finished_ids",
    "sampled", "row_of", "rows", "kv_output", "kv_failed", "stale_tokens",
};
/* SpecDecodeTotals.step_counts, slot by slot: the constructor checks the
 * names it is given (_totals.STEP_COUNTS) against these. */
enum { COUNT_EMPTY, COUNT_PADDING, N_COUNTS };
static const char *const count_roles[N_COUNTS] = {"empty_proposals", "padding_tokens"};

/* CPython keeps one object for each small int: every -1 that the
 * interpreter, PyLong_FromLong or .tolist() makes is this one, so a -1
 * placeholder is told by its address, without reading the (cold) object. */
static PyObject *minus_one;
static PyObject *str_status, *str_is_finished;

typedef struct {
    PyObject_HEAD
    PyObject *owners;   /* list: row -> req_id or None */
    long long *acc;     /* per row: accepted tokens of the owner in this row */
    long long *drf;     /* per row: drafted tokens */
    unsigned char *had_output; /* per row: produced output in the previous step */
    Py_hash_t *hashes;  /* per row: the owner's hash (-1: none), to find a row */
    Py_ssize_t cap;     /* rows allocated */
    int prev_valid;     /* the previous step went through step() */
    int track_padding;
    int in_flight;      /* steps can be in flight (async scheduling, pipelines) */
    int skip_finished;  /* skip rows of finished requests still in the table */
    long finished_above; /* statuses above it are finished; -1: ask is_finished() */
    int check_stale;    /* -1: not known yet (asked of the first request seen) */
    PyObject *spilled;  /* dict: req_id -> (drafted, accepted) of rows left */
    PyObject *requests; /* the scheduler's request table (dict) */
    PyObject *released; /* dict: req_id -> step it was released at (recent ones) */
    long long step;     /* steps seen, by step() or advance() */
    long long native_steps; /* step() calls that took their step */
    long long keep_steps; /* steps a released id is remembered */
    long long prune_every; /* steps between prunes of released ids */
    long long sweep_every; /* steps between sweeps of spilled tallies */
    PyObject *row_of;   /* the current step's batch index (dict), or NULL (none,
                         * or a vLLM whose output has no index: search) */
    PyObject *acc_hist; /* totals: drafts per accepted-prefix length (list) */
    PyObject *drf_hist; /* totals: drafts per drafted length (list) */
    PyObject *buckets;  /* totals: finished requests per rate bucket (list) */
    PyObject *counts;   /* totals: [empty proposals, padding tokens] (list) */
    PyObject *rate_sum; /* totals: [sum of request rates] (list) */
    PyObject *trackers; /* totals: reader -> [min, max] of rates since (dict) */
    PyObject *fields[N_FIELDS];
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

/* -1 placeholders in a draft whose last entry is negative (padding). */
static Py_ssize_t
padding_in(PyObject *drafts, Py_ssize_t d)
{
    if (PyList_CheckExact(drafts)) {
        if (PyList_GET_ITEM(drafts, d - 1) != minus_one)
            return 0;
        Py_ssize_t count = 0;
        for (Py_ssize_t j = 0; j < d; j++)
            count += PyList_GET_ITEM(drafts, j) == minus_one;
        return count;
    }
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

/* A spilled tally, (drafted, accepted): added to *drafted and *accepted. */
static int
add_tally(PyObject *tally, long long *drafted, long long *accepted)
{
    if (!PyTuple_CheckExact(tally) || PyTuple_GET_SIZE(tally) != 2) {
        PyErr_SetString(PyExc_TypeError, "spilled tally: (drafted, accepted) expected");
        return -1;
    }
    long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(tally, 0));
    long long a = PyLong_AsLongLong(PyTuple_GET_ITEM(tally, 1));
    if (PyErr_Occurred())
        return -1;
    *drafted += d;
    *accepted += a;
    return 0;
}

/* spilled[req_id] += (drafted, accepted) */
static int
spill(Scanner *self, PyObject *req_id, long long drafted, long long accepted)
{
    if (!drafted && !accepted)
        return 0;
    PyObject *previous = PyDict_GetItemWithError(self->spilled, req_id);
    if (previous != NULL) {
        if (add_tally(previous, &drafted, &accepted) < 0)
            return -1;
    } else if (PyErr_Occurred()) {
        return -1;
    }
    PyObject *d = PyLong_FromLongLong(drafted), *a = PyLong_FromLongLong(accepted);
    PyObject *tally = d && a ? PyTuple_Pack(2, d, a) : NULL;
    Py_XDECREF(d);
    Py_XDECREF(a);
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
    Py_hash_t hash = new_owner == Py_None ? -1 : PyObject_Hash(new_owner);
    if (hash == -1 && PyErr_Occurred())
        return -1;
    self->hashes[i] = hash;
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
        Py_hash_t *hashes = PyMem_Realloc(self->hashes, cap * sizeof(Py_hash_t));
        if (hashes == NULL)
            goto nomem;
        self->hashes = hashes;
        self->cap = cap;
    }
    for (Py_ssize_t i = m; i < n; i++) {
        if (PyList_Append(self->owners, Py_None) < 0)
            return -1;
        self->acc[i] = 0;
        self->drf[i] = 0;
        self->had_output[i] = 0;
        self->hashes[i] = -1;
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

/* Delete from dict the keys for which keep(key, value) is 0. */
static int
delete_where_not(PyObject *dict, int (*keep)(Scanner *, PyObject *, PyObject *),
                 Scanner *self)
{
    PyObject *expired = PyList_New(0), *key, *value;
    Py_ssize_t pos = 0;
    if (expired == NULL)
        return -1;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        int kept = keep(self, key, value);
        if (kept < 0 || (!kept && PyList_Append(expired, key) < 0))
            goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(expired); i++)
        if (PyDict_DelItem(dict, PyList_GET_ITEM(expired, i)) < 0)
            goto fail;
    Py_DECREF(expired);
    return 0;
fail:
    Py_DECREF(expired);
    return -1;
}

static int
is_recent(Scanner *self, PyObject *key, PyObject *step)
{
    long long when = PyLong_AsLongLong(step);
    if (when == -1 && PyErr_Occurred())
        return -1;
    return when >= self->step - self->keep_steps;
}

static int
is_live(Scanner *self, PyObject *req_id, PyObject *value)
{
    return PyDict_Contains(self->requests, req_id);
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
        PyObject *stale = PyObject_GetAttr(request, self->fields[F_STALE]);
        if (stale == NULL)
            return -1;
        int truth = PyObject_IsTrue(stale);
        Py_DECREF(stale);
        if (truth != 0)
            return truth;
    }
    return 0;
}

static PyObject *field(PyObject *obj, PyObject *name);

/* Whether this vLLM's requests carry stale-output counts (asked once). */
static int
learn_check_stale(Scanner *self)
{
    PyObject *key, *request;
    Py_ssize_t pos = 0;
    if (!self->in_flight) {
        self->check_stale = 0; /* stale output needs a step in flight */
        return 0;
    }
    if (!PyDict_Next(self->requests, &pos, &key, &request))
        return 0; /* no request yet: ask again next step */
    PyObject *stale = field(request, self->fields[F_STALE]);
    if (stale == NULL && PyErr_Occurred())
        return -1;
    self->check_stale = stale != NULL;
    Py_XDECREF(stale);
    return 0;
}

static int
append_new(PyObject **list, PyObject *item)
{
    if (*list == NULL && (*list = PyList_New(0)) == NULL)
        return -1;
    return PyList_Append(*list, item);
}

/* list[i] += delta for a list of ints (a totals' count). */
static int
bump(PyObject *list, Py_ssize_t i, long long delta)
{
    if (!delta)
        return 0;
    long long old = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    if (old == -1 && PyErr_Occurred())
        return -1;
    PyObject *sum = PyLong_FromLongLong(old + delta);
    if (sum == NULL)
        return -1;
    PyList_SetItem(list, i, sum); /* drops the old count */
    return 0;
}

/* hist_list[v] += counts[v] for v in 0..top (the list holds them all). */
static int
add_counts(PyObject *hist_list, const long long *counts, Py_ssize_t top)
{
    for (Py_ssize_t v = 0; v <= top; v++)
        if (bump(hist_list, v, counts[v]) < 0)
            return -1;
    return 0;
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

/* The totals' rate sum and every reader's min/max take in released rates
 * (their buckets were counted as each one was released). */
static int
add_rates(Scanner *self, const Rates *rates)
{
    if (!rates->count)
        return 0;
    double old = PyFloat_AsDouble(PyList_GET_ITEM(self->rate_sum, 0));
    if (old == -1.0 && PyErr_Occurred())
        return -1;
    PyObject *sum = PyFloat_FromDouble(old + rates->sum);
    if (sum == NULL)
        return -1;
    PyList_SetItem(self->rate_sum, 0, sum);
    PyObject *key, *tracker;
    Py_ssize_t pos = 0;
    while (PyDict_Next(self->trackers, &pos, &key, &tracker)) {
        if (!PyList_Check(tracker) || PyList_GET_SIZE(tracker) != 2) {
            PyErr_SetString(PyExc_TypeError, "rate tracker: [min, max] expected");
            return -1;
        }
        double lo = PyFloat_AsDouble(PyList_GET_ITEM(tracker, 0));
        double hi = PyFloat_AsDouble(PyList_GET_ITEM(tracker, 1));
        if (PyErr_Occurred())
            return -1;
        if (rates->lo < lo) {
            PyObject *value = PyFloat_FromDouble(rates->lo);
            if (value == NULL)
                return -1;
            PyList_SetItem(tracker, 0, value);
        }
        if (rates->hi > hi) {
            PyObject *value = PyFloat_FromDouble(rates->hi);
            if (value == NULL)
                return -1;
            PyList_SetItem(tracker, 1, value);
        }
    }
    return 0;
}

/* The row req_id owns: where row_of says, else (no index) a search of the
 * owners' hashes; -1: none. */
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
    Py_hash_t hash = PyObject_Hash(req_id);
    if (hash == -1)
        return PyErr_Occurred() ? -1 : 0;
    const Py_hash_t *hashes = self->hashes;
    for (Py_ssize_t i = 0; i < rows; i++) {
        if (hashes[i] != hash)
            continue;
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

/* One finished request: its tally (row plus spilled) becomes one rate. */
static int
release_one(Scanner *self, PyObject *req_id, PyObject *when, Rates *rates)
{
    long long drafted = 0, accepted = 0;
    Py_ssize_t row;
    if (find_row(self, req_id, &row) < 0)
        return -1;
    if (PyDict_SetItem(self->released, req_id, when) < 0)
        return -1;
    if (row >= 0) {
        drafted += self->drf[row];
        accepted += self->acc[row];
        self->drf[row] = 0;
        self->acc[row] = 0;
    }
    if (PyDict_GET_SIZE(self->spilled)) {
        PyObject *tally = PyDict_GetItemWithError(self->spilled, req_id);
        if (tally != NULL) {
            if (add_tally(tally, &drafted, &accepted) < 0)
                return -1;
            if (PyDict_DelItem(self->spilled, req_id) < 0)
                return -1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
    }
    if (drafted <= 0)
        return 0;
    double rate = (double)accepted / (double)drafted;
    if (bump(self->buckets, bucket_of(self, rate), 1) < 0)
        return -1;
    if (rates->count == 0 || rate < rates->lo)
        rates->lo = rate;
    if (rates->count == 0 || rate > rates->hi)
        rates->hi = rate;
    rates->sum += rate;
    rates->count++;
    return 0;
}

/* Finished requests, released once each: an id released in the last
 * keep_steps steps is passed over (vLLM hands the same id over twice). */
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
    int rc = 0;
    while (rc == 0 && (req_id = PyIter_Next(iter)) != NULL) {
        rc = PyDict_Contains(self->released, req_id);
        if (rc == 0)
            rc = release_one(self, req_id, when, rates);
        else if (rc > 0)
            rc = 0;
        Py_DECREF(req_id);
    }
    Py_DECREF(when);
    Py_DECREF(iter);
    return rc < 0 || PyErr_Occurred() ? -1 : 0;
}

/* getattr(obj, name), or NULL without an error where it has none. */
static PyObject *
field(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError))
        PyErr_Clear();
    return value;
}

typedef struct {
    PyObject *spec, *scheduled, *sampled, *row_of, *rows, *finished;
} StepInputs;

static void
inputs_clear(StepInputs *in)
{
    Py_CLEAR(in->spec);
    Py_CLEAR(in->scheduled);
    Py_CLEAR(in->sampled);
    Py_CLEAR(in->row_of);
    Py_CLEAR(in->rows);
    Py_CLEAR(in->finished);
}

/* 1: a truthy value at obj.name (a field that makes the step unusual). */
static int
field_is_set(PyObject *obj, PyObject *name)
{
    PyObject *value = field(obj, name);
    if (value == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int truth = value == Py_None ? 0 : PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* 1: the step's inputs are in the layout step() takes; 0: decline; -1: error. */
static int
read_inputs(Scanner *self, PyObject *so, PyObject *mro, StepInputs *in)
{
    PyObject **f = self->fields;
    if (!(in->spec = field(so, f[F_SPEC])) || !(in->scheduled = field(so, f[F_SCHEDULED])) ||
        !(in->sampled = field(mro, f[F_SAMPLED])) || !(in->rows = field(mro, f[F_ROWS])))
        return PyErr_Occurred() ? -1 : 0;
    if ((in->finished = field(so, f[F_FINISHED])) == NULL && PyErr_Occurred())
        return -1;
    /* The batch index: where the output has none (vLLM 0.34+), the rows
     * are the index (the scheduler builds it from them). */
    if ((in->row_of = field(mro, f[F_ROW_OF])) == NULL && PyErr_Occurred())
        return -1;
    if (!PyDict_CheckExact(in->spec) || !PyDict_CheckExact(in->scheduled) ||
        !PyList_CheckExact(in->sampled) || !PyList_CheckExact(in->rows) ||
        (in->row_of != NULL && !PyDict_CheckExact(in->row_of)))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(in->rows);
    if (n == 0 || PyList_GET_SIZE(in->sampled) != n)
        return 0;
    if (in->row_of == NULL)
        goto in_row_order;
    /* Outputs in row order: the index agrees at both ends. */
    PyObject *first = PyDict_GetItemWithError(in->row_of, PyList_GET_ITEM(in->rows, 0));
    PyObject *last = first ? PyDict_GetItemWithError(in->row_of, PyList_GET_ITEM(in->rows, n - 1))
                           : NULL;
    if (last == NULL || !PyLong_CheckExact(first) || !PyLong_CheckExact(last))
        return PyErr_Occurred() ? -1 : 0;
    if (PyLong_AsSsize_t(first) != 0 || PyLong_AsSsize_t(last) != n - 1)
        return PyErr_Occurred() ? -1 : 0;
in_row_order:;
    /* Grammar-invalidated drafts: the exact path's. */
    int unusual = field_is_set(so, f[F_INVALID]);
    if (unusual != 0)
        return unusual < 0 ? -1 : 0;
    /* Failed KV loads (requests vLLM skips): the exact path's. */
    PyObject *kv = field(mro, f[F_KV]);
    if (kv == NULL)
        return PyErr_Occurred() ? -1 : 1;
    unusual = kv == Py_None ? 0 : field_is_set(kv, f[F_KV_FAILED]);
    Py_DECREF(kv);
    return unusual == 0 ? 1 : (unusual < 0 ? -1 : 0);
}

/* 1 if the collection holds key (0 for None or empty), -1 on error. */
static int
holds(PyObject *collection, PyObject *key)
{
    if (PyAnySet_Check(collection))
        return PySet_Contains(collection, key);
    if (PyDict_Check(collection))
        return PyDict_Contains(collection, key);
    return PySequence_Contains(collection, key);
}

/* 1 if the request is finished, 0 if not, -1 on error. */
static int
is_finished(Scanner *self, PyObject *request)
{
    if (self->finished_above < 0) {
        PyObject *result = PyObject_CallMethodNoArgs(request, str_is_finished);
        if (result == NULL)
            return -1;
        int truth = PyObject_IsTrue(result);
        Py_DECREF(result);
        return truth;
    }
    PyObject *status = PyObject_GetAttr(request, str_status);
    if (status == NULL)
        return -1;
    long value = PyLong_AsLong(status);
    Py_DECREF(status);
    if (value == -1 && PyErr_Occurred())
        return -1;
    return value > self->finished_above;
}

/* Results of a pass over the rows. */
typedef struct {
    long long acc_hist[HIST_SIZE], drf_hist[HIST_SIZE];
    Py_ssize_t acc_top, drf_top;
    long long padding, empty;
    PyObject *suspects; /* req_ids left to Python, or NULL */
    PyObject *overflow; /* (accepted, drafted) pairs left to Python, or NULL */
} Pass;

/* The pass over the step's rows (see step()). freed: requests freed since
 * the step's schedule (NULL: none), for one step at a time. */
static int
scan_rows(Scanner *self, StepInputs *in, PyObject *freed, Pass *p)
{
    Py_ssize_t n = PyList_GET_SIZE(in->rows);
    Py_ssize_t acc_cap = PyList_GET_SIZE(self->acc_hist);
    Py_ssize_t drf_cap = PyList_GET_SIZE(self->drf_hist);
    if (acc_cap > HIST_SIZE)
        acc_cap = HIST_SIZE;
    if (drf_cap > HIST_SIZE)
        drf_cap = HIST_SIZE;
    long long *acc = self->acc, *drf = self->drf;
    unsigned char *had_output = self->had_output;
    int prev_valid = self->prev_valid;
    PyObject **rows = PySequence_Fast_ITEMS(in->rows);
    PyObject **sampled = PySequence_Fast_ITEMS(in->sampled);
    PyObject **owners = PySequence_Fast_ITEMS(self->owners);

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req_id = rows[i];
        Py_ssize_t s = sized_len(sampled[i]);
        if (s < 0)
            return -1;
        PyObject *drafts = PyDict_GetItemWithError(in->spec, req_id);
        Py_ssize_t d = 0;
        if (drafts != NULL) {
            if ((d = sized_len(drafts)) < 0)
                return -1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
        int same = same_owner(owners[i], req_id);
        if (same < 0 || (!same && reassign(self, i, req_id) < 0))
            return -1;
        /* vLLM skips output of a request no longer in the scheduler (freed
         * while its step ran). With one step at a time, such a request was
         * freed since this step's schedule: it is in the scheduler's set of
         * freed requests, almost always empty, and no lookup in the
         * scheduler's large, cold request table is needed. With steps in
         * flight, look it up. */
        int gone = 0;
        if (self->in_flight) {
            PyObject *request = PyDict_GetItemWithError(self->requests, req_id);
            if (request == NULL) {
                if (PyErr_Occurred())
                    return -1;
                gone = 1;
            } else if (self->skip_finished && (gone = is_finished(self, request)) < 0) {
                /* Finished but kept in the table (a KV connector delaying
                 * its free): vLLM skips it. */
                return -1;
            }
        } else if (freed != NULL && (gone = holds(freed, req_id)) < 0) {
            return -1;
        }
        if (gone) {
            had_output[i] = 0;
            continue;
        }
        if (d > 0 && s > 0) { /* a verified draft */
            Py_ssize_t a = s - 1;
            if (a < acc_cap && d < drf_cap) {
                p->acc_hist[a]++;
                p->drf_hist[d]++;
                if (a > p->acc_top)
                    p->acc_top = a;
                if (d > p->drf_top)
                    p->drf_top = d;
            } else {
                PyObject *pair = Py_BuildValue("(nn)", a, d);
                int rc = pair == NULL ? -1 : append_new(&p->overflow, pair);
                Py_XDECREF(pair);
                if (rc < 0)
                    return -1;
            }
            acc[i] += a;
            drf[i] += d;
            if (self->track_padding) {
                Py_ssize_t pad = padding_in(drafts, d);
                if (pad < 0)
                    return -1;
                p->padding += pad;
            }
        } else if (d == 0 && s > 0) { /* no draft: an empty proposal if decoding */
            PyObject *count = PyDict_GetItemWithError(in->scheduled, req_id);
            if (count == NULL) {
                if (PyErr_Occurred())
                    return -1;
            } else if (PyLong_Check(count) && PyLong_AsLong(count) == 1) {
                /* Same owner with output last step: decoding. Others: Python checks. */
                if (same && prev_valid && had_output[i])
                    p->empty++;
                else if (append_new(&p->suspects, req_id) < 0)
                    return -1;
            } else if (PyErr_Occurred()) {
                return -1;
            }
        }
        had_output[i] = s > 0;
    }
    return 0;
}

/* One more step, whichever path took it: released ids and spilled tallies
 * are pruned by the step count, so they stay bounded on every path. */
static int
tick(Scanner *self)
{
    self->step++;
    if (self->step % self->prune_every == 0 &&
        delete_where_not(self->released, is_recent, self) < 0)
        return -1;
    if (self->step % self->sweep_every == 0 &&
        delete_where_not(self->spilled, is_live, self) < 0)
        return -1;
    return 0;
}

PyDoc_STRVAR(step_doc,
"step(scheduler_output, model_runner_output, freed) -> True, None or a tuple\n\n"
"Account one step, before the host's update: reads the step's inputs\n"
"(the fields named at construction), releases the step's finished_req_ids,\n"
"then adds each verified draft to the totals' histograms and to its row's\n"
"tally and counts padding and empty proposals. freed: the scheduler's own\n"
"set of requests freed since the step's schedule (None or a collection);\n"
"they are released first and skipped, as vLLM skips them.\n\n"
"None: declined (an unusual step: another layout, grammar-invalidated\n"
"drafts, failed KV loads, stale output after a preemption); nothing was\n"
"changed and the exact path must take the step. True: done. A tuple\n"
"(suspects, overflow): done but for rows left to Python: suspects, ids\n"
"(or None) of one-token rows without a draft whose request it could not\n"
"tell was decoding; overflow, (accepted, drafted) pairs (or None) too\n"
"large for its counts.");

static PyObject *
Scanner_step(Scanner *self, PyObject *const *args, Py_ssize_t nargs)
{
    StepInputs in = {NULL};
    Pass p = {{0}, {0}, -1, -1, 0, 0, NULL, NULL};
    Rates rates = {0, 0.0, 0.0, 0.0};
    PyObject *result = NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "step: three arguments expected");
        return NULL;
    }
    PyObject *freed = args[2];
    int any_freed = freed == Py_None ? 0 : PyObject_IsTrue(freed);
    if (any_freed < 0)
        return NULL;
    if (!any_freed)
        freed = NULL;
    int usable = read_inputs(self, args[0], args[1], &in);
    if (usable <= 0)
        goto decline;
    if (self->check_stale < 0 && learn_check_stale(self) < 0)
        goto done;
    if (self->check_stale > 0) {
        usable = any_stale(self, in.rows, in.spec);
        if (usable != 0) /* a preempted request's in-flight output */
            goto decline;
    }

    /* From here the step is taken. Finished requests first: those freed
     * since the schedule, and the step's own set (already released by the
     * hook after the previous update, unless freed where no hook saw it).
     * Their rows are found by search: the index is this step's. */
    Py_CLEAR(self->row_of);
    if (freed != NULL && release_ids(self, freed, &rates) < 0)
        goto done;
    if (in.finished != NULL && in.finished != Py_None &&
        release_ids(self, in.finished, &rates) < 0)
        goto done;
    Py_XINCREF(in.row_of);
    Py_XSETREF(self->row_of, in.row_of);
    if (fit(self, PyList_GET_SIZE(in.rows)) < 0)
        goto done;
    self->prev_valid = 0; /* until this step is through */
    if (tick(self) < 0)
        goto done;
    self->native_steps++;
    if (scan_rows(self, &in, freed, &p) < 0)
        goto done;
    if (add_counts(self->acc_hist, p.acc_hist, p.acc_top) < 0 ||
        add_counts(self->drf_hist, p.drf_hist, p.drf_top) < 0 ||
        bump(self->counts, COUNT_PADDING, p.padding) < 0 ||
        bump(self->counts, COUNT_EMPTY, p.empty) < 0)
        goto done;
    self->prev_valid = 1;
    if (add_rates(self, &rates) < 0)
        goto done;
    if (p.suspects == NULL && p.overflow == NULL)
        result = Py_NewRef(Py_True);
    else
        result = Py_BuildValue("(OO)", p.suspects ? p.suspects : Py_None,
                               p.overflow ? p.overflow : Py_None);
    goto done;
decline:
    if (!PyErr_Occurred())
        result = Py_NewRef(Py_None);
done:
    inputs_clear(&in);
    Py_XDECREF(p.suspects);
    Py_XDECREF(p.overflow);
    return result;
}

PyDoc_STRVAR(release_doc,
"release(ids, end_of_step=False)\n\n"
"Finished requests: each tally becomes one rate in the totals (buckets,\n"
"sum, every reader's min and max). Idempotent. end_of_step: afterwards\n"
"let go of the step's batch index.");

static PyObject *
Scanner_release(Scanner *self, PyObject *const *args, Py_ssize_t nargs)
{
    Rates rates = {0, 0.0, 0.0, 0.0};
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "release: (ids, end_of_step=False) expected");
        return NULL;
    }
    int end_of_step = nargs == 2 ? PyObject_IsTrue(args[1]) : 0;
    if (end_of_step < 0)
        return NULL;
    PyObject *ids = args[0];
    int rc = ids == Py_None ? 0 : release_ids(self, ids, &rates);
    if (rc == 0)
        rc = add_rates(self, &rates);
    if (end_of_step)
        Py_CLEAR(self->row_of);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Scanner_end_step(Scanner *self, PyObject *ids)
{
    PyObject *args[2] = {ids, Py_True};
    return Scanner_release(self, args, 2);
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
Scanner_drop_missing(Scanner *self, PyObject *live)
{
    if (!PyDict_Check(live)) {
        PyErr_SetString(PyExc_TypeError, "drop_missing: the scheduler's request dict expected");
        return NULL;
    }
    PyObject *requests = self->requests;
    self->requests = live;
    int rc = delete_where_not(self->spilled, is_live, self);
    self->requests = requests;
    if (rc < 0)
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
Scanner_advance(Scanner *self, PyObject *Py_UNUSED(ignored))
{
    self->prev_valid = 0;
    if (tick(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A list attribute of the totals, new reference (exactly a list). */
static PyObject *
totals_list(PyObject *totals, const char *name, Py_ssize_t min_size)
{
    PyObject *value = PyObject_GetAttrString(totals, name);
    if (value != NULL && (!PyList_CheckExact(value) || PyList_GET_SIZE(value) < min_size)) {
        PyErr_Format(PyExc_TypeError, "Scanner: totals.%s is not a list of %zd", name,
                     min_size);
        Py_CLEAR(value);
    }
    return value;
}

static int
Scanner_init(Scanner *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"totals", "requests", "rate_bounds", "fields", "counts",
                               "track_padding", "in_flight", "skip_finished",
                               "finished_above", "keep_steps", "prune_every", "sweep_every",
                               NULL};
    PyObject *totals, *requests, *bounds, *fields, *count_names, *finished_above;
    int track_padding, in_flight, skip_finished;
    long long keep_steps, prune_every, sweep_every;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!OpppOLLL", keywords, &totals,
                                     &PyDict_Type, &requests, &bounds, &PyDict_Type, &fields,
                                     &count_names, &track_padding, &in_flight, &skip_finished,
                                     &finished_above, &keep_steps, &prune_every, &sweep_every))
        return -1;
    Py_ssize_t nb = PySequence_Size(bounds);
    if (nb < 0)
        return -1;
    if (nb > MAX_BOUNDS || sweep_every < 1 || prune_every < 1) {
        PyErr_SetString(PyExc_ValueError, "Scanner: bad rate bounds, prune_every or sweep_every");
        return -1;
    }
    /* The totals' count slots, in order: the same names as this file's. */
    if (PySequence_Size(count_names) != N_COUNTS) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "Scanner: %d count slots expected", N_COUNTS);
        return -1;
    }
    for (int i = 0; i < N_COUNTS; i++) {
        PyObject *name = PySequence_GetItem(count_names, i);
        if (name == NULL)
            return -1;
        int same = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name,
                                                                              count_roles[i]) == 0;
        Py_DECREF(name);
        if (!same) {
            PyErr_Format(PyExc_ValueError, "Scanner: count slot %d must be %s", i,
                         count_roles[i]);
            return -1;
        }
    }
    long above = -1;
    if (finished_above != Py_None) {
        above = PyLong_AsLong(finished_above);
        if (above == -1 && PyErr_Occurred())
            return -1;
        if (above < 0) {
            PyErr_SetString(PyExc_ValueError, "Scanner: finished_above must be >= 0 or None");
            return -1;
        }
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
    /* Each role by its name: a field this file does not know, or one it
     * needs and is not given, is an error (the two lists have drifted). */
    if (PyDict_GET_SIZE(fields) != N_FIELDS) {
        PyErr_Format(PyExc_ValueError, "Scanner: %d fields expected, got %zd", N_FIELDS,
                     PyDict_GET_SIZE(fields));
        return -1;
    }
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *name = PyDict_GetItemString(fields, field_roles[i]);
        if (name == NULL) {
            PyErr_Format(PyExc_ValueError, "Scanner: no field for role %s", field_roles[i]);
            return -1;
        }
        if (name == Py_None) { /* absent in this vLLM: a name no object has */
            name = PyUnicode_FromString("<absent>");
            if (name == NULL)
                return -1;
        } else if (!PyUnicode_CheckExact(name)) {
            PyErr_Format(PyExc_TypeError, "Scanner: field %s must be str or None",
                         field_roles[i]);
            return -1;
        } else {
            Py_INCREF(name);
        }
        PyUnicode_InternInPlace(&name);
        Py_XSETREF(self->fields[i], name);
    }
    PyObject *acc_hist = totals_list(totals, "accepted_hist", 1);
    PyObject *drf_hist = totals_list(totals, "drafted_hist", 1);
    PyObject *buckets = totals_list(totals, "rate_buckets", nb + 1);
    PyObject *counts = totals_list(totals, "step_counts", N_COUNTS);
    PyObject *rate_sum = totals_list(totals, "rate_sum_cell", 1);
    PyObject *trackers = PyObject_GetAttrString(totals, "rate_trackers");
    PyObject *owners = PyList_New(0), *spilled = PyDict_New(), *released = PyDict_New();
    if (!acc_hist || !drf_hist || !buckets || !counts || !rate_sum || !trackers || !owners ||
        !spilled || !released || !PyDict_Check(trackers)) {
        if (trackers && !PyDict_Check(trackers))
            PyErr_SetString(PyExc_TypeError, "Scanner: totals.rate_trackers is not a dict");
        Py_XDECREF(acc_hist);
        Py_XDECREF(drf_hist);
        Py_XDECREF(buckets);
        Py_XDECREF(counts);
        Py_XDECREF(rate_sum);
        Py_XDECREF(trackers);
        Py_XDECREF(owners);
        Py_XDECREF(spilled);
        Py_XDECREF(released);
        return -1;
    }
    Py_XSETREF(self->acc_hist, acc_hist);
    Py_XSETREF(self->drf_hist, drf_hist);
    Py_XSETREF(self->buckets, buckets);
    Py_XSETREF(self->counts, counts);
    Py_XSETREF(self->rate_sum, rate_sum);
    Py_XSETREF(self->trackers, trackers);
    Py_XSETREF(self->owners, owners);
    Py_XSETREF(self->spilled, spilled);
    Py_XSETREF(self->released, released);
    Py_INCREF(requests);
    Py_XSETREF(self->requests, requests);
    Py_CLEAR(self->row_of);
    self->keep_steps = keep_steps;
    self->prune_every = prune_every;
    self->sweep_every = sweep_every;
    self->step = 0;
    self->native_steps = 0;
    self->track_padding = track_padding;
    self->in_flight = in_flight;
    self->skip_finished = skip_finished;
    self->finished_above = above;
    self->check_stale = -1;
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
    Py_VISIT(self->counts);
    Py_VISIT(self->rate_sum);
    Py_VISIT(self->trackers);
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
    Py_CLEAR(self->counts);
    Py_CLEAR(self->rate_sum);
    Py_CLEAR(self->trackers);
    for (int i = 0; i < N_FIELDS; i++)
        Py_CLEAR(self->fields[i]);
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
    PyMem_Free(self->hashes);
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
Scanner_get_native_steps(Scanner *self, void *closure)
{
    return PyLong_FromLongLong(self->native_steps);
}

static PyObject *
Scanner_get_check_stale(Scanner *self, void *closure)
{
    return PyBool_FromLong(self->check_stale > 0);
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

static PyMethodDef Scanner_methods[] = {
    {"step", (PyCFunction)(void (*)(void))Scanner_step, METH_FASTCALL, step_doc},
    {"release", (PyCFunction)(void (*)(void))Scanner_release, METH_FASTCALL, release_doc},
    {"end_step", (PyCFunction)Scanner_end_step, METH_O,
     "end_step(ids): release(ids, end_of_step=True), after the host's update"},
    {"add_spilled", (PyCFunction)Scanner_add_spilled, METH_VARARGS,
     "add_spilled(req_id, drafted, accepted): add to a request's tally outside the rows"},
    {"drop_missing", (PyCFunction)Scanner_drop_missing, METH_O,
     "drop_missing(requests): forget tallies outside the rows of requests not in it"},
    {"clear", (PyCFunction)Scanner_clear, METH_NOARGS, "forget every tally"},
    {"advance", (PyCFunction)Scanner_advance, METH_NOARGS,
     "a step taken by the Python path: counted, and prunes as step() does"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Scanner_getset[] = {
    {"owners", (getter)Scanner_get_owners, NULL, "row -> request id (or None)", NULL},
    {"spilled", (getter)Scanner_get_spilled, NULL,
     "request id -> (drafted, accepted) of requests not in a row", NULL},
    {"released", (getter)Scanner_get_released, NULL,
     "request id -> step, of the requests released in the last keep_steps steps", NULL},
    {"native_steps", (getter)Scanner_get_native_steps, NULL,
     "steps step() took (the others went to the Python path)", NULL},
    {"check_stale", (getter)Scanner_get_check_stale, (setter)Scanner_set_check_stale,
     "look for stale in-flight output before each step", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_specdec._rowscan.Scanner",
    .tp_doc = PyDoc_STR("Per-row tallies of one scheduler, and its common step in one call."),
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
    PyModuleDef_HEAD_INIT, "_rowscan", "The accounting's common step in one C call.", -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__rowscan(void)
{
    minus_one = PyLong_FromLong(-1);
    str_status = PyUnicode_InternFromString("status");
    str_is_finished = PyUnicode_InternFromString("is_finished");
    if (minus_one == NULL || str_status == NULL || str_is_finished == NULL ||
        PyType_Ready(&ScannerType) < 0)
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
