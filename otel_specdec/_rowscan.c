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
 * _accounting.py uses its exact path. _accounting.py documents the
 * rules; this file follows them.
 */
#define PY_SSIZE_T_CLEAN
/* Python's stable ABI from 3.10 on: one binary (an abi3 wheel) serves every
 * later Python, and nothing here reads CPython's internals. */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <string.h>
#include <time.h>

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

/* CPython keeps one object for each small int (the C API's documented
 * behaviour for -5..256, on every version): every -1 that the interpreter,
 * PyLong_FromLong or .tolist() makes is the one PyLong_FromLong(-1) returns,
 * so a -1 placeholder is told by its address, without reading the (cold)
 * object. */
static PyObject *minus_one;

/* Replace the reference in dst by src, then drop the old one. */
#define SET_REF(dst, src)              \
    do {                               \
        PyObject *old_ = (PyObject *)(dst); \
        (dst) = (src);                 \
        Py_XDECREF(old_);              \
    } while (0)
static PyObject *str_status, *str_is_finished, *str_trace_headers;

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
    long long step_ns;  /* when step() took the current step (request detail on) */
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
    /* Per-request detail for request spans (detail 0: spans off, none kept;
     * see "Request detail" below). */
    int detail;
    PyObject *decide;       /* the sampling plan (_request_details.DetailHandover.decide):
                             * requests -> keep each one's detail; None: keep all */
    Py_ssize_t dsize;       /* entries of a request's histogram: k + 1 */
    long long *det;         /* per row: accepted-length then drafted-length counts */
    long long *first_ns;    /* per row: time of the owner's first verified draft there (0: none) */
    signed char *want;      /* per row: keep the owner's detail: -1 not decided yet */
    PyObject **det_req;     /* per row: the owner's Request where detail is kept */
    /* Rows whose new owner's decision waits for the end of the pass
     * (decide_pending). */
    Py_ssize_t *pending;
    Py_ssize_t n_pending;
    PyObject *det_spilled;  /* dict: req_id -> [request, first_ns, acc list, drf list] */
    PyObject *to_release;   /* list: this call's finished requests' detail */
    PyObject *on_release;   /* takes that list at the end of the call (the hand-over) */
    PyObject *totals;       /* handed over with each detail */
} Scanner;

typedef struct {
    Py_ssize_t count;
    double sum, lo, hi;
} Rates;

static Py_ssize_t
sized_len(PyObject *obj)
{
    if (PyList_CheckExact(obj))
        return PyList_Size(obj);
    if (PyTuple_CheckExact(obj))
        return PyTuple_Size(obj);
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
        if (PyList_GetItem(drafts, d - 1) != minus_one)
            return 0;
        Py_ssize_t count = 0;
        for (Py_ssize_t j = 0; j < d; j++)
            count += PyList_GetItem(drafts, j) == minus_one;
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
    if (!PyTuple_CheckExact(tally) || PyTuple_Size(tally) != 2) {
        PyErr_SetString(PyExc_TypeError, "spilled tally: (drafted, accepted) expected");
        return -1;
    }
    long long d = PyLong_AsLongLong(PyTuple_GetItem(tally, 0));
    long long a = PyLong_AsLongLong(PyTuple_GetItem(tally, 1));
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

/* ---- Request detail (request spans on) -------------------------------
 *
 * A span reports a request's drafts: the counts of its drafts by accepted
 * length and by drafted length (k + 1 entries each, from which follow its
 * drafts, tokens and per-position counts) and the time of its first
 * verified draft. They are kept where its tally is: by row in C arrays,
 * moved to det_spilled when the request leaves its row (or a draft is too
 * long for the row's counts, or a Python-path step adds one), and summed
 * when it is released. Only for requests whose span can be sampled: the
 * sampling plan, which reads the trace context, is the Python side's
 * (decide, called once per step for the requests it first schedules). A
 * finished request's detail is queued and passed, once per call, to the
 * Python side's hand-over (on_release), which bounds it and gives it to
 * the span worker. */

static PyObject *field(PyObject *obj, PyObject *name);
static int bump(PyObject *list, Py_ssize_t i, long long delta);

static long long
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline long long *
row_detail(Scanner *self, Py_ssize_t i)
{
    return self->det + i * 2 * self->dsize;
}

/* The sampling plan's answers for requests (a list): a new list of one
 * truth value per request, from decide (the Python side reads the trace
 * context: the decision lives there only). */
static PyObject *
decisions_for(Scanner *self, PyObject *requests)
{
    PyObject *answers = PyObject_CallFunctionObjArgs(self->decide, requests, NULL);
    if (answers != NULL &&
        (!PyList_Check(answers) || PyList_Size(answers) != PyList_Size(requests))) {
        PyErr_SetString(PyExc_TypeError, "Scanner: decide must answer each request");
        Py_CLEAR(answers);
    }
    return answers;
}

/* 1 if the request's detail is kept, 0 if not, -1 on error. */
static int
keeps_detail(Scanner *self, PyObject *request)
{
    if (self->decide == Py_None)
        return 1;
    PyObject *one = PyList_New(1);
    if (one == NULL)
        return -1;
    PyList_SetItem(one, 0, Py_NewRef(request));
    PyObject *answers = decisions_for(self, one);
    Py_DECREF(one);
    if (answers == NULL)
        return -1;
    int keep = PyObject_IsTrue(PyList_GetItem(answers, 0));
    Py_DECREF(answers);
    return keep;
}

/* list[v] += count, growing the list with zeros. */
static int
list_add(PyObject *list, Py_ssize_t v, long long count)
{
    while (PyList_Size(list) <= v) {
        PyObject *zero = PyLong_FromLong(0);
        int rc = zero == NULL ? -1 : PyList_Append(list, zero);
        Py_XDECREF(zero);
        if (rc < 0)
            return -1;
    }
    return bump(list, v, count);
}

/* entry[1] = the earlier of its first time and first (0: none). */
static int
entry_first(PyObject *entry, long long first)
{
    long long old = PyLong_AsLongLong(PyList_GetItem(entry, 1));
    if (old == -1 && PyErr_Occurred())
        return -1;
    if (!first || (old && old <= first))
        return 0;
    PyObject *value = PyLong_FromLongLong(first);
    if (value == NULL)
        return -1;
    PyList_SetItem(entry, 1, value);
    return 0;
}

/* det_spilled[req_id] (borrowed), made empty where missing: [request,
 * first_ns, accepted-length counts, drafted-length counts]. */
static PyObject *
spilled_detail(Scanner *self, PyObject *req_id, PyObject *request)
{
    PyObject *entry = PyDict_GetItemWithError(self->det_spilled, req_id);
    if ((entry != NULL && entry != Py_None) || PyErr_Occurred())
        return entry;
    PyObject *acc = PyList_New(0), *drf = PyList_New(0);
    entry = acc && drf ? Py_BuildValue("[OiOO]", request, 0, acc, drf) : NULL;
    Py_XDECREF(acc);
    Py_XDECREF(drf);
    if (entry == NULL)
        return NULL;
    int rc = PyDict_SetItem(self->det_spilled, req_id, entry);
    Py_DECREF(entry);
    return rc < 0 ? NULL : entry;
}

/* One draft's detail outside the rows (a Python-path step, or a draft too
 * long for the row's counts). */
static int
add_spilled_detail(Scanner *self, PyObject *req_id, PyObject *request, Py_ssize_t a,
                   Py_ssize_t d, long long when)
{
    PyObject *entry = spilled_detail(self, req_id, request);
    if (entry == NULL)
        return -1;
    if (list_add(PyList_GetItem(entry, 2), a, 1) < 0 ||
        list_add(PyList_GetItem(entry, 3), d, 1) < 0)
        return -1;
    return entry_first(entry, when);
}

static void
reset_row_detail(Scanner *self, Py_ssize_t i)
{
    if (self->want[i] > 0) { /* only a kept owner's row holds anything */
        memset(row_detail(self, i), 0, 2 * self->dsize * sizeof(long long));
        self->first_ns[i] = 0;
        Py_CLEAR(self->det_req[i]);
    }
    self->want[i] = -1;
}

/* The row's owner leaves it: its detail moves to det_spilled, or, for a
 * request the plan keeps none of, the decision does (None), so that its
 * next row does not read its trace context again. */
static int
spill_row_detail(Scanner *self, Py_ssize_t i)
{
    PyObject *owner = PyList_GetItem(self->owners, i);
    if (self->want[i] == 0 && owner != Py_None &&
        PyDict_SetItem(self->det_spilled, owner, Py_None) < 0)
        return -1;
    if (self->want[i] > 0 && self->first_ns[i]) {
        PyObject *entry = spilled_detail(self, PyList_GetItem(self->owners, i),
                                         self->det_req[i]);
        if (entry == NULL)
            return -1;
        const long long *row = row_detail(self, i);
        for (Py_ssize_t v = 0; v < self->dsize; v++) {
            if ((row[v] && list_add(PyList_GetItem(entry, 2), v, row[v]) < 0) ||
                (row[self->dsize + v] &&
                 list_add(PyList_GetItem(entry, 3), v, row[self->dsize + v]) < 0))
                return -1;
        }
        if (entry_first(entry, self->first_ns[i]) < 0)
            return -1;
    }
    reset_row_detail(self, i);
    return 0;
}

/* Row i's owner's decision: keep its detail (1, request its Request) or not. */
static inline void
set_want(Scanner *self, Py_ssize_t i, int keep, PyObject *request)
{
    self->want[i] = (signed char)keep;
    if (keep)
        self->det_req[i] = Py_NewRef(request);
}

/* Row i's owner was decided in an earlier row (it moved): that decision
 * (None in det_spilled) or detail (an entry: kept) applies. 1 if so, 0 if
 * not known, -1 on error. */
static int
decided_before(Scanner *self, Py_ssize_t i, PyObject *req_id)
{
    PyObject *known = PyDict_Size(self->det_spilled)
                          ? PyDict_GetItemWithError(self->det_spilled, req_id) : NULL;
    if (known == NULL)
        return PyErr_Occurred() ? -1 : 0;
    set_want(self, i, known != Py_None, known != Py_None ? PyList_GetItem(known, 0) : NULL);
    return 1;
}

/* Whether row i's owner keeps detail (want[i]), decided now: the fallback
 * for an owner still undecided at its first verified draft. Left undecided
 * (-1) for a request no longer in the table. */
static int
decide_row(Scanner *self, Py_ssize_t i, PyObject *req_id)
{
    int known = decided_before(self, i, req_id);
    if (known != 0)
        return known < 0 ? -1 : 0;
    PyObject *request = PyDict_GetItemWithError(self->requests, req_id);
    if (request == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int keep = keeps_detail(self, request);
    if (keep >= 0)
        set_want(self, i, keep, request);
    return keep < 0 ? -1 : 0;
}

/* Row i has a new owner (req_id): its decision, where known, else queued
 * for decide_pending at the end of the pass: normally the step that first
 * schedules the request, while vLLM has just touched it. */
static int
claim_row(Scanner *self, Py_ssize_t i, PyObject *req_id)
{
    int known = decided_before(self, i, req_id);
    if (known != 0)
        return known < 0 ? -1 : 0;
    if (self->n_pending >= self->cap)
        return decide_row(self, i, req_id);
    self->pending[self->n_pending++] = i;
    return 0;
}

/* The queued rows' decisions, in one call to decide for the step's new
 * requests (held in a list of their own from the moment they are read:
 * decide runs Python code). */
static int
decide_pending(Scanner *self)
{
    Py_ssize_t n = self->n_pending, m = 0, j;
    Py_ssize_t *rows = self->pending;
    self->n_pending = 0;
    if (n == 0)
        return 0;
    PyObject *requests = PyList_New(0);
    if (requests == NULL)
        return -1;
    for (j = 0; j < n; j++) { /* the requests, from the scheduler's table */
        Py_ssize_t i = rows[j];
        if (self->want[i] >= 0) /* decided since, at a verified draft */
            continue;
        PyObject *request = PyDict_GetItemWithError(self->requests,
                                                    PyList_GetItem(self->owners, i));
        if (request == NULL && PyErr_Occurred())
            goto fail;
        if (request == NULL)
            continue; /* left undecided */
        if (PyList_Append(requests, request) < 0)
            goto fail;
        rows[m++] = i;
    }
    PyObject *answers = NULL;
    if (m > 0 && self->decide != Py_None && (answers = decisions_for(self, requests)) == NULL)
        goto fail;
    for (j = 0; j < m; j++) {
        int keep = answers == NULL ? 1 : PyObject_IsTrue(PyList_GetItem(answers, j));
        if (keep < 0) {
            Py_DECREF(answers);
            goto fail;
        }
        set_want(self, rows[j], keep, PyList_GetItem(requests, j));
    }
    Py_XDECREF(answers);
    Py_DECREF(requests);
    return 0;
fail:
    Py_DECREF(requests);
    return -1;
}

/* A verified draft's detail, in its row. */
static int
add_row_detail(Scanner *self, Py_ssize_t i, PyObject *req_id, Py_ssize_t a, Py_ssize_t d,
               long long when)
{
    if (self->want[i] < 0 && decide_row(self, i, req_id) < 0)
        return -1;
    if (self->want[i] <= 0)
        return 0;
    if (a >= self->dsize || d >= self->dsize)
        return add_spilled_detail(self, req_id, self->det_req[i], a, d, when);
    long long *row = row_detail(self, i);
    row[a]++;
    row[self->dsize + d]++;
    if (!self->first_ns[i])
        self->first_ns[i] = when;
    return 0;
}

/* The request's counts, row (or NULL) plus spilled entry (or NULL), as
 * the bytes of 2n native long longs: n accepted-length counts, then n
 * drafted-length counts (one allocation; the worker reads them with
 * memoryview.cast("q")). */
static PyObject *
packed_counts(const long long *row, Py_ssize_t dsize, PyObject *entry)
{
    PyObject *spilled[2] = {entry ? PyList_GetItem(entry, 2) : NULL,
                            entry ? PyList_GetItem(entry, 3) : NULL};
    Py_ssize_t n = dsize;
    for (int h = 0; h < 2; h++)
        if (spilled[h] != NULL && PyList_Size(spilled[h]) > n)
            n = PyList_Size(spilled[h]);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 2 * n * sizeof(long long));
    if (out == NULL)
        return NULL;
    long long *counts = (long long *)PyBytes_AsString(out);
    memset(counts, 0, 2 * n * sizeof(long long));
    for (int h = 0; h < 2; h++) {
        long long *into = counts + h * n;
        if (row != NULL)
            for (Py_ssize_t v = 0; v < dsize; v++)
                into[v] = row[h * dsize + v];
        Py_ssize_t m = spilled[h] != NULL ? PyList_Size(spilled[h]) : 0;
        for (Py_ssize_t v = 0; v < m; v++) {
            long long more = PyLong_AsLongLong(PyList_GetItem(spilled[h], v));
            if (more == -1 && PyErr_Occurred()) {
                Py_DECREF(out);
                return NULL;
            }
            into[v] += more;
        }
    }
    return out;
}

/* One finished request's detail, queued for the hand-over at the end of
 * the call: (totals, trace headers, status, first ns, end ns, packed
 * counts), what the span needs and no more (the request itself, with its
 * token lists, is not kept while the span waits). */
static int
queue_release(Scanner *self, PyObject *request, long long first, const long long *row,
              PyObject *entry)
{
    PyObject *headers = field(request, str_trace_headers);
    PyObject *status = headers == NULL && PyErr_Occurred() ? NULL : field(request, str_status);
    PyObject *packed = PyErr_Occurred() ? NULL : packed_counts(row, self->dsize, entry);
    PyObject *item = packed == NULL ? NULL : Py_BuildValue(
        "(OOOLLO)", self->totals, headers ? headers : Py_None, status ? status : Py_None,
        first, now_ns(), packed);
    Py_XDECREF(headers);
    Py_XDECREF(status);
    Py_XDECREF(packed);
    if (item == NULL)
        return -1;
    int rc = PyList_Append(self->to_release, item);
    Py_DECREF(item);
    return rc;
}

/* The call's finished requests' detail to on_release, in one call (the
 * Python side bounds it and hands it to the span worker). */
static int
flush_released(Scanner *self)
{
    if (!self->detail || PyList_Size(self->to_release) == 0)
        return 0;
    PyObject *batch = self->to_release;
    if ((self->to_release = PyList_New(0)) == NULL) {
        self->to_release = batch;
        return -1;
    }
    PyObject *result = PyObject_CallFunctionObjArgs(self->on_release, batch, NULL);
    Py_DECREF(batch);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* A released request's detail (row, -1: none, and spilled) is queued for
 * the hand-over (queue_release). */
static int
hand_over_detail(Scanner *self, PyObject *req_id, Py_ssize_t row)
{
    PyObject *entry = NULL;
    if (PyDict_Size(self->det_spilled)) {
        entry = PyDict_GetItemWithError(self->det_spilled, req_id);
        if (entry == NULL && PyErr_Occurred())
            return -1;
        Py_XINCREF(entry);
        if (entry != NULL && PyDict_DelItem(self->det_spilled, req_id) < 0) {
            Py_DECREF(entry);
            return -1;
        }
        if (entry == Py_None) /* a request the plan keeps none of */
            Py_CLEAR(entry);
    }
    int in_row = row >= 0 && self->want[row] > 0 && self->first_ns[row];
    int rc = 0;
    if (entry != NULL || in_row) {
        PyObject *request = in_row ? self->det_req[row] : PyList_GetItem(entry, 0);
        long long first = in_row ? self->first_ns[row] : 0;
        if (entry != NULL) {
            long long other = PyLong_AsLongLong(PyList_GetItem(entry, 1));
            if (other == -1 && PyErr_Occurred())
                rc = -1;
            else if (other && (!first || other < first))
                first = other;
        }
        if (rc == 0)
            rc = queue_release(self, request, first, in_row ? row_detail(self, row) : NULL,
                               entry);
    }
    Py_XDECREF(entry);
    if (row >= 0)
        reset_row_detail(self, row);
    return rc < 0 ? -1 : 0;
}

/* The row's owner leaves it (to new_owner, or None): its tally is spilled. */
static int
reassign(Scanner *self, Py_ssize_t i, PyObject *new_owner)
{
    PyObject *old = PyList_GetItem(self->owners, i);
    if (old != Py_None && spill(self, old, self->drf[i], self->acc[i]) < 0)
        return -1;
    if (self->detail && spill_row_detail(self, i) < 0)
        return -1;
    self->acc[i] = 0;
    self->drf[i] = 0;
    Py_hash_t hash = new_owner == Py_None ? -1 : PyObject_Hash(new_owner);
    if (hash == -1 && PyErr_Occurred())
        return -1;
    self->hashes[i] = hash;
    Py_INCREF(new_owner);
    PyList_SetItem(self->owners, i, new_owner); /* drops the old owner */
    if (self->detail && new_owner != Py_None)
        return claim_row(self, i, new_owner);
    return 0;
}

/* array resized to n items of item bytes; where that fails, array as it
 * was and *failed set. */
static void *
resized(void *array, Py_ssize_t n, size_t item, int *failed)
{
    void *larger = PyMem_Realloc(array, (size_t)n * item);
    if (larger == NULL) {
        *failed = 1;
        return array;
    }
    return larger;
}

#define RESIZE(array, n, failed) ((array) = resized((array), (n), sizeof(*(array)), &(failed)))

/* Room for cap rows of detail (rows from self->cap on start empty). */
static int
grow_detail(Scanner *self, Py_ssize_t cap)
{
    Py_ssize_t width = 2 * self->dsize;
    int failed = 0;
    RESIZE(self->det, cap * width, failed);
    RESIZE(self->first_ns, cap, failed);
    RESIZE(self->want, cap, failed);
    RESIZE(self->det_req, cap, failed);
    RESIZE(self->pending, cap, failed);
    if (failed)
        return -1;
    for (Py_ssize_t i = self->cap; i < cap; i++) {
        memset(row_detail(self, i), 0, width * sizeof(long long));
        self->first_ns[i] = 0;
        self->want[i] = -1;
        self->det_req[i] = NULL;
    }
    return 0;
}

/* Hold exactly n rows: new rows are empty; rows past n are spilled. */
static int
fit(Scanner *self, Py_ssize_t n)
{
    Py_ssize_t m = PyList_Size(self->owners);
    if (n > self->cap) {
        Py_ssize_t cap = n > 2 * self->cap ? n : 2 * self->cap;
        int failed = 0;
        RESIZE(self->acc, cap, failed);
        RESIZE(self->drf, cap, failed);
        RESIZE(self->had_output, cap, failed);
        RESIZE(self->hashes, cap, failed);
        if (failed || (self->detail && grow_detail(self, cap) < 0))
            goto nomem;
        self->cap = cap;
    }
    for (Py_ssize_t i = m; i < n; i++) {
        if (PyList_Append(self->owners, Py_None) < 0)
            return -1;
        self->acc[i] = 0;
        self->drf[i] = 0;
        self->had_output[i] = 0;
        self->hashes[i] = -1;
        if (self->detail)
            reset_row_detail(self, i);
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
    for (Py_ssize_t i = 0; i < PyList_Size(expired); i++)
        if (PyDict_DelItem(dict, PyList_GetItem(expired, i)) < 0)
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
    Py_ssize_t n = PyList_Size(rows);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req_id = PyList_GetItem(rows, i);
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
    long long old = PyLong_AsLongLong(PyList_GetItem(list, i));
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
    double old = PyFloat_AsDouble(PyList_GetItem(self->rate_sum, 0));
    if (old == -1.0 && PyErr_Occurred())
        return -1;
    PyObject *sum = PyFloat_FromDouble(old + rates->sum);
    if (sum == NULL)
        return -1;
    PyList_SetItem(self->rate_sum, 0, sum);
    PyObject *key, *tracker;
    Py_ssize_t pos = 0;
    while (PyDict_Next(self->trackers, &pos, &key, &tracker)) {
        if (!PyList_Check(tracker) || PyList_Size(tracker) != 2) {
            PyErr_SetString(PyExc_TypeError, "rate tracker: [min, max] expected");
            return -1;
        }
        double lo = PyFloat_AsDouble(PyList_GetItem(tracker, 0));
        double hi = PyFloat_AsDouble(PyList_GetItem(tracker, 1));
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
    Py_ssize_t rows = PyList_Size(self->owners);
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
            int same = same_owner(PyList_GetItem(self->owners, i), req_id);
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
        int same = same_owner(PyList_GetItem(self->owners, i), req_id);
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
    if (PyDict_Size(self->spilled)) {
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
    if (self->detail && hand_over_detail(self, req_id, row) < 0)
        return -1;
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
    Py_ssize_t n = PyList_Size(in->rows);
    if (n == 0 || PyList_Size(in->sampled) != n)
        return 0;
    if (in->row_of == NULL)
        goto in_row_order;
    /* Outputs in row order: the index agrees at both ends. */
    PyObject *first = PyDict_GetItemWithError(in->row_of, PyList_GetItem(in->rows, 0));
    PyObject *last = first ? PyDict_GetItemWithError(in->row_of, PyList_GetItem(in->rows, n - 1))
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
        PyObject *result = PyObject_CallMethodObjArgs(request, str_is_finished, NULL);
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
    Py_ssize_t n = PyList_Size(in->rows);
    Py_ssize_t acc_cap = PyList_Size(self->acc_hist);
    Py_ssize_t drf_cap = PyList_Size(self->drf_hist);
    if (acc_cap > HIST_SIZE)
        acc_cap = HIST_SIZE;
    if (drf_cap > HIST_SIZE)
        drf_cap = HIST_SIZE;
    long long *acc = self->acc, *drf = self->drf;
    unsigned char *had_output = self->had_output;
    int prev_valid = self->prev_valid;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req_id = PyList_GetItem(in->rows, i);
        PyObject *sampled = PyList_GetItem(in->sampled, i);
        PyObject *owner = PyList_GetItem(self->owners, i);
        if (req_id == NULL || sampled == NULL || owner == NULL)
            return -1;
        Py_ssize_t s = sized_len(sampled);
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
        int same = same_owner(owner, req_id);
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
            if (self->detail && add_row_detail(self, i, req_id, a, d, self->step_ns) < 0)
                return -1;
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
        (delete_where_not(self->spilled, is_live, self) < 0 ||
         delete_where_not(self->det_spilled, is_live, self) < 0))
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
    SET_REF(self->row_of, in.row_of);
    if (fit(self, PyList_Size(in.rows)) < 0)
        goto done;
    self->prev_valid = 0; /* until this step is through */
    if (tick(self) < 0)
        goto done;
    self->native_steps++;
    if (self->detail) {
        self->step_ns = now_ns();
        self->n_pending = 0;
    }
    if (scan_rows(self, &in, freed, &p) < 0)
        goto done;
    if (self->detail && decide_pending(self) < 0)
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
    if (result != NULL && flush_released(self) < 0)
        Py_CLEAR(result);
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
    if (rc < 0 || flush_released(self) < 0)
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
Scanner_add_detail(Scanner *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "add_detail: (req_id, request, drafted, accepted, when_ns) expected");
        return NULL;
    }
    Py_ssize_t d = PyLong_AsSsize_t(args[2]), a = PyLong_AsSsize_t(args[3]);
    long long when = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (!self->detail || d < 0 || a < 0)
        Py_RETURN_NONE;
    /* Decided once per request: None in det_spilled where it keeps none. */
    PyObject *known = PyDict_GetItemWithError(self->det_spilled, args[0]);
    if (known == Py_None || (known == NULL && PyErr_Occurred()))
        return known == NULL ? NULL : Py_NewRef(Py_None);
    if (known == NULL) {
        int keep = keeps_detail(self, args[1]);
        if (keep < 0 || (!keep && PyDict_SetItem(self->det_spilled, args[0], Py_None) < 0))
            return NULL;
        if (!keep)
            Py_RETURN_NONE;
    }
    if (add_spilled_detail(self, args[0], args[1], a, d, when) < 0)
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
    if (rc == 0)
        rc = delete_where_not(self->det_spilled, is_live, self);
    self->requests = requests;
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Scanner_clear(Scanner *self, PyObject *Py_UNUSED(ignored))
{
    if (PyList_SetSlice(self->owners, 0, PyList_Size(self->owners), NULL) < 0)
        return NULL;
    PyDict_Clear(self->spilled);
    PyDict_Clear(self->released);
    PyDict_Clear(self->det_spilled);
    if (self->detail)
        for (Py_ssize_t i = 0; i < self->cap; i++)
            reset_row_detail(self, i);
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
    if (value != NULL && (!PyList_CheckExact(value) || PyList_Size(value) < min_size)) {
        PyErr_Format(PyExc_TypeError, "Scanner: totals.%s is not a list of %zd", name,
                     min_size);
        Py_CLEAR(value);
    }
    return value;
}

/* Request detail: on where on_release (the hand-over, called with the
 * list of each call's finished requests' detail) is given; decide (None:
 * every request's detail kept) answers which requests keep it. */
static int
init_detail(Scanner *self, PyObject *totals, PyObject *decide, PyObject *on_release)
{
    if (self->detail || self->det_spilled != NULL) {
        PyErr_SetString(PyExc_TypeError, "Scanner: initialised twice");
        return -1;
    }
    if ((self->det_spilled = PyDict_New()) == NULL ||
        (self->to_release = PyList_New(0)) == NULL)
        return -1;
    self->decide = Py_NewRef(decide);
    self->on_release = Py_NewRef(on_release);
    self->totals = Py_NewRef(totals);
    if (on_release == Py_None)
        return 0;
    if (!PyCallable_Check(on_release) || (decide != Py_None && !PyCallable_Check(decide))) {
        PyErr_SetString(PyExc_TypeError, "Scanner: on_release and decide must be callable");
        return -1;
    }
    PyObject *k = PyObject_GetAttrString(totals, "num_speculative_tokens");
    long value = k != NULL ? PyLong_AsLong(k) : -1;
    Py_XDECREF(k);
    if (value < 1 || value > HIST_SIZE) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Scanner: num_speculative_tokens out of range");
        return -1;
    }
    self->dsize = value + 1;
    self->detail = 1;
    return 0;
}

static int
Scanner_init(Scanner *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"totals", "requests", "rate_bounds", "fields", "counts",
                               "track_padding", "in_flight", "skip_finished",
                               "finished_above", "keep_steps", "prune_every", "sweep_every",
                               "detail_decide", "detail_release", NULL};
    PyObject *totals, *requests, *bounds, *fields, *count_names, *finished_above;
    PyObject *decide = Py_None, *on_release = Py_None;
    int track_padding, in_flight, skip_finished;
    long long keep_steps, prune_every, sweep_every;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!OpppOLLL|OO", keywords, &totals,
                                     &PyDict_Type, &requests, &bounds, &PyDict_Type, &fields,
                                     &count_names, &track_padding, &in_flight, &skip_finished,
                                     &finished_above, &keep_steps, &prune_every, &sweep_every,
                                     &decide, &on_release))
        return -1;
    if (init_detail(self, totals, decide, on_release) < 0)
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
    if (PyDict_Size(fields) != N_FIELDS) {
        PyErr_Format(PyExc_ValueError, "Scanner: %d fields expected, got %zd", N_FIELDS,
                     PyDict_Size(fields));
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
        SET_REF(self->fields[i], name);
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
    SET_REF(self->acc_hist, acc_hist);
    SET_REF(self->drf_hist, drf_hist);
    SET_REF(self->buckets, buckets);
    SET_REF(self->counts, counts);
    SET_REF(self->rate_sum, rate_sum);
    SET_REF(self->trackers, trackers);
    SET_REF(self->owners, owners);
    SET_REF(self->spilled, spilled);
    SET_REF(self->released, released);
    Py_INCREF(requests);
    SET_REF(self->requests, requests);
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
    Py_VISIT(Py_TYPE(self)); /* a heap type */
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
    Py_VISIT(self->det_spilled);
    Py_VISIT(self->to_release);
    Py_VISIT(self->decide);
    Py_VISIT(self->on_release);
    Py_VISIT(self->totals);
    if (self->det_req != NULL)
        for (Py_ssize_t i = 0; i < self->cap; i++)
            Py_VISIT(self->det_req[i]);
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
    Py_CLEAR(self->det_spilled);
    Py_CLEAR(self->to_release);
    Py_CLEAR(self->decide);
    Py_CLEAR(self->on_release);
    Py_CLEAR(self->totals);
    if (self->det_req != NULL)
        for (Py_ssize_t i = 0; i < self->cap; i++)
            Py_CLEAR(self->det_req[i]);
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
    PyMem_Free(self->det);
    PyMem_Free(self->first_ns);
    PyMem_Free(self->want);
    PyMem_Free(self->det_req);
    PyMem_Free(self->pending);
    PyTypeObject *type = Py_TYPE(self);
    freefunc free_slot = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_slot(self);
    Py_DECREF(type); /* instances of a heap type hold a reference to it */
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
    {"add_detail", (PyCFunction)(void (*)(void))Scanner_add_detail, METH_FASTCALL,
     "add_detail(req_id, request, drafted, accepted, when_ns): one draft's request detail "
     "from a Python-path step (kept where the sampling plan keeps the request's)"},
    {"drop_missing", (PyCFunction)Scanner_drop_missing, METH_O,
     "drop_missing(requests): forget tallies outside the rows of requests not in it"},
    {"clear", (PyCFunction)Scanner_clear, METH_NOARGS, "forget every tally"},
    {"advance", (PyCFunction)Scanner_advance, METH_NOARGS,
     "a step taken by the Python path: counted, and prunes as step() does"},
    {NULL, NULL, 0, NULL},
};

static PyObject *
Scanner_get_det_spilled(Scanner *self, void *closure)
{
    return Py_NewRef(self->det_spilled);
}

static PyObject *
Scanner_get_detail_owners(Scanner *self, void *closure)
{
    PyObject *out = PyList_New(0);
    if (out != NULL && self->detail)
        for (Py_ssize_t i = 0; i < PyList_Size(self->owners); i++)
            if (self->det_req[i] != NULL &&
                PyList_Append(out, PyList_GetItem(self->owners, i)) < 0) {
                Py_CLEAR(out);
                break;
            }
    return out;
}

static PyGetSetDef Scanner_getset[] = {
    {"detail_spilled", (getter)Scanner_get_det_spilled, NULL,
     "request id -> [request, first ns, counts, counts]: request detail outside the rows "
     "(None: a request that moved rows and keeps none)",
     NULL},
    {"detail_owners", (getter)Scanner_get_detail_owners, NULL,
     "the requests whose detail a row keeps", NULL},
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

static PyType_Slot Scanner_slots[] = {
    {Py_tp_doc, (void *)PyDoc_STR("Per-row tallies of one scheduler, and its common step in one call.")},
    {Py_tp_new, (void *)PyType_GenericNew},
    {Py_tp_init, (void *)Scanner_init},
    {Py_tp_dealloc, (void *)Scanner_dealloc},
    {Py_tp_traverse, (void *)Scanner_traverse},
    {Py_tp_clear, (void *)Scanner_clear_refs},
    {Py_tp_methods, Scanner_methods},
    {Py_tp_getset, Scanner_getset},
    {0, NULL},
};

/* A heap type (PyType_FromSpec): the limited API has no static types. */
static PyType_Spec Scanner_spec = {
    .name = "otel_specdec._rowscan.Scanner",
    .basicsize = sizeof(Scanner),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = Scanner_slots,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_rowscan",
    .m_doc = "The accounting's common step in one C call.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__rowscan(void)
{
    minus_one = PyLong_FromLong(-1);
    str_status = PyUnicode_InternFromString("status");
    str_is_finished = PyUnicode_InternFromString("is_finished");
    str_trace_headers = PyUnicode_InternFromString("trace_headers");
    if (minus_one == NULL || str_status == NULL || str_is_finished == NULL ||
        str_trace_headers == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    PyObject *type = PyType_FromSpec(&Scanner_spec);
    if (type == NULL || PyModule_AddObject(module, "Scanner", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
