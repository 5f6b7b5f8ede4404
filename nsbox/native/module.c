/* nsbox._native: the launch core in C.
 *
 * Like CPython's _posixsubprocess for subprocess: Python prepares everything once, before the
 * clone (nsbox/sandbox/native.py); here the flat plan is parsed into C memory, the sandbox is
 * cloned, and the child runs the steps of nsbox/sandbox/child.py in C up to the exec. No Python
 * bytecode runs in the child, and it touches no Python object.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "plan.h"
#include "spawner.h"

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#define CLONE_INTO_CGROUP_ 0x200000000ULL

/* The version of the flat plan this module reads (nsbox/sandbox/native.py, FORMAT). */
#define FORMAT PLAN_FORMAT

/* struct clone_args, CLONE_ARGS_SIZE_VER2 (clone3(2)). */
struct clone_args_v2 {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};

/* clone(2) without a new stack, or clone3(2) into the cgroup ``cgroup_fd``: 0 in the child. */
static long clone_sandbox(unsigned long long flags, int cgroup_fd)
{
    if (cgroup_fd < 0)
        return syscall(SYS_clone, (unsigned long)flags, 0, 0, 0, 0);
    struct clone_args_v2 args;
    memset(&args, 0, sizeof(args));
    args.flags = (flags & ~0xffULL) | CLONE_INTO_CGROUP_;
    args.exit_signal = flags & 0xff;
    args.cgroup = (uint64_t)cgroup_fd;
    return syscall(SYS_clone3, &args, sizeof(args));
}

/* A C array of the ints in ``seq`` (malloc'd; NULL with an exception set). */
static int *int_array(PyObject *seq, Py_ssize_t *n)
{
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of descriptors");
    if (fast == NULL)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    int *out = PyMem_Malloc(sizeof(int) * (size_t)(*n + 1));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        long value = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (value == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
        if (value < -1 || value > INT_MAX) {  /* a descriptor, or -1 for none */
            PyMem_Free(out);
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "%ld is not a file descriptor", value);
            return NULL;
        }
        out[i] = (int)value;
    }
    Py_DECREF(fast);
    return out;
}

PyDoc_STRVAR(spawn_doc,
"spawn(plan, fds, close_fds, flags, cgroup_fd) -> pid\n\n"
"Clone a sandbox child with clone ``flags`` (namespaces and the exit signal), into the cgroup\n"
"v2 directory ``cgroup_fd`` when it is not -1, and run the flat ``plan`` (bytes) in it up to\n"
"the exec. ``fds``: the descriptors the plan refers to by index; ``close_fds``: closed first\n"
"in the child. Returns the child's pid; raises OSError when the clone fails.");

static PyObject *spawn(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer blob;
    PyObject *fds_obj, *close_obj;
    unsigned long long flags;
    int cgroup_fd;
    if (!PyArg_ParseTuple(args, "y*OOKi:spawn", &blob, &fds_obj, &close_obj, &flags,
                          &cgroup_fd))
        return NULL;
    Py_ssize_t nfds = 0, nclose = 0;
    int *fds = int_array(fds_obj, &nfds);
    int *close_fds = fds == NULL ? NULL : int_array(close_obj, &nclose);
    struct plan plan;
    const char *why = NULL;
    PyObject *result = NULL;
    if (close_fds == NULL)
        goto done;
    if (plan_parse(&plan, blob.buf, (size_t)blob.len, fds, (size_t)nfds, &why) != 0) {
        PyErr_SetString(PyExc_ValueError, why);
        goto done;
    }
    long pid = clone_sandbox(flags, cgroup_fd);
    if (pid == 0)
        child_main(&plan, close_fds, (int)nclose);
    int err = errno;
    plan_free(&plan);
    if (pid < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromLong(pid);
done:
    PyMem_Free(fds);
    PyMem_Free(close_fds);
    PyBuffer_Release(&blob);
    return result;
}

PyDoc_STRVAR(start_spawner_doc,
"start_spawner(sock, procs, flags, spawner_name, sandbox_name) -> pid\n\n"
"Clone a spawner (nsbox/native/spawner.c) that moves itself into a cgroup by writing its pid\n"
"to each descriptor of ``procs`` (cgroup.procs files), says ready on ``sock`` and clones one\n"
"sandbox with clone ``flags``. Returns its pid here; returns 0 in a sandbox child the spawner\n"
"cloned for the Python child (the word \"clone\"), which goes on in Python.");

static PyObject *start_spawner(PyObject *self, PyObject *args)
{
    (void)self;
    int sock;
    PyObject *procs_obj;
    unsigned long flags;
    const char *spawner_name, *sandbox_name;
    if (!PyArg_ParseTuple(args, "iOkss:start_spawner", &sock, &procs_obj, &flags,
                          &spawner_name, &sandbox_name))
        return NULL;
    Py_ssize_t nprocs = 0;
    int *procs = int_array(procs_obj, &nprocs);
    if (procs == NULL)
        return NULL;
    long pid = syscall(SYS_clone, (unsigned long)SIGCHLD, 0, 0, 0, 0);
    if (pid == 0)
        pid = spawner_main(sock, procs, (int)nprocs, flags, spawner_name, sandbox_name);
    int err = errno;
    PyMem_Free(procs);
    if (pid < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(pid);
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, spawn_doc},
    {"start_spawner", start_spawner, METH_VARARGS, start_spawner_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module)
{
    return PyModule_AddIntConstant(module, "FORMAT", FORMAT);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "nsbox._native",
    "The native launch core: clone and the sandbox child's steps in C.", 0, methods, slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModuleDef_Init(&module_def);
}
