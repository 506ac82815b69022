/* decentd.workers.sigbus: the daemon survives a worker that truncates memory the daemon has mapped.
 *
 * A worker's registered shared memory is a file the worker can shrink at any time; the daemon's
 * next touch of a page past the new end raises SIGBUS, which would kill the daemon and every
 * other worker's ops with it. Ranges the daemon maps from workers are watched here: a SIGBUS
 * inside one maps a private zero page over the faulting page (the touch then completes and reads
 * zeros) and counts the fault against the range; the daemon fails that worker's ops from the
 * count. A SIGBUS anywhere else goes to the previous disposition.
 *
 * The handler only reads the table and calls mmap (a plain system call), both safe in a signal
 * handler; the table is changed with the GIL held, and a slot's start is published last.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_WATCHED 65536

typedef struct {
    uintptr_t start; /* 0: a free slot */
    uintptr_t end;
    long faults;
} Watched;

static Watched watched[MAX_WATCHED];
static size_t used; /* slots below this may be taken */
static long total_faults;
static uintptr_t page_size, page_mask;
static struct sigaction previous;
static int installed;

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)sig;
    (void)context;
    uintptr_t addr = (uintptr_t)info->si_addr;
    size_t n = __atomic_load_n(&used, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < n; i++) {
        uintptr_t start = __atomic_load_n(&watched[i].start, __ATOMIC_ACQUIRE);
        if (start == 0 || addr < start || addr >= watched[i].end) {
            continue;
        }
        void *page = (void *)(addr & page_mask);
        if (mmap(page, page_size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
            __atomic_add_fetch(&watched[i].faults, 1, __ATOMIC_RELAXED);
            __atomic_add_fetch(&total_faults, 1, __ATOMIC_RELEASE);
            return;
        }
        break;
    }
    sigaction(SIGBUS, &previous, NULL); /* not ours: the touch faults again, into that */
}

static PyObject *install(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    if (!installed) {
        struct sigaction action;
        memset(&action, 0, sizeof(action));
        action.sa_sigaction = on_sigbus;
        action.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&action.sa_mask);
        page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
        page_mask = ~(page_size - 1);
        if (sigaction(SIGBUS, &action, &previous) != 0) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        installed = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *watch(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address, nbytes;
    if (!PyArg_ParseTuple(args, "KK", &address, &nbytes)) {
        return NULL;
    }
    if (address == 0 || nbytes == 0) {
        PyErr_SetString(PyExc_ValueError, "watch: an empty range");
        return NULL;
    }
    for (size_t i = 0; i < MAX_WATCHED; i++) {
        if (watched[i].start != 0) {
            continue;
        }
        watched[i].end = (uintptr_t)(address + nbytes);
        watched[i].faults = 0;
        __atomic_store_n(&watched[i].start, (uintptr_t)address, __ATOMIC_RELEASE);
        if (i >= used) {
            __atomic_store_n(&used, i + 1, __ATOMIC_RELEASE);
        }
        Py_RETURN_NONE;
    }
    PyErr_SetString(PyExc_OverflowError, "watch: every slot is taken");
    return NULL;
}

static Watched *find(unsigned long long address) {
    for (size_t i = 0; i < used; i++) {
        if (watched[i].start == (uintptr_t)address) {
            return &watched[i];
        }
    }
    return NULL;
}

static PyObject *unwatch(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "K", &address)) {
        return NULL;
    }
    Watched *w = find(address);
    if (w == NULL) {
        return PyLong_FromLong(0);
    }
    __atomic_store_n(&w->start, (uintptr_t)0, __ATOMIC_RELEASE);
    return PyLong_FromLong(__atomic_load_n(&w->faults, __ATOMIC_RELAXED));
}

static PyObject *faults(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "K", &address)) {
        return NULL;
    }
    Watched *w = find(address);
    return PyLong_FromLong(w == NULL ? 0 : __atomic_load_n(&w->faults, __ATOMIC_RELAXED));
}

static PyObject *total(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(__atomic_load_n(&total_faults, __ATOMIC_ACQUIRE));
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Handle SIGBUS in watched ranges from now on (idempotent)."},
    {"watch", watch, METH_VARARGS,
     "watch(address, nbytes): a SIGBUS in [address, address + nbytes) maps a zero page there "
     "and is counted."},
    {"unwatch", unwatch, METH_VARARGS,
     "unwatch(address) -> faults: stop watching the range at address (once it is unmapped); "
     "the faults it had."},
    {"faults", faults, METH_VARARGS, "faults(address) -> the faults of the range at address."},
    {"total", total, METH_NOARGS, "Faults in every range since the start."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sigbus",
    "Survive SIGBUS in memory a worker shrank under the daemon.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_sigbus(void) { return PyModule_Create(&module); }
