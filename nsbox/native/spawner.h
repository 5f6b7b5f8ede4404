/* The spawner loop in C (spawner.c). */
#ifndef NSBOX_NATIVE_SPAWNER_H
#define NSBOX_NATIVE_SPAWNER_H

/* In a fresh clone of the helper: serve one launch as a spawner, then exit. Returns 0 only in
 * a sandbox child for the Python child ("clone"), which goes on in Python.
 *
 * That return leads from a raw clone(2) back into the interpreter (module.c, start_spawner),
 * which _posixsubprocess never does. It is sound only under the helper's own rules: the helper
 * never has a second thread (no lock of glibc or of Python can be held by one at the clone),
 * and the Python that runs in the child calls nothing that trusts glibc's cached thread id,
 * which a raw clone leaves stale (raise, abort, pthread_kill and the other pthread functions
 * on the process's own thread; os.getpid is a system call in every glibc since 2.25). The
 * Python spawner (nsbox/helper/spawner.py) runs Python after its raw clone in the same way. */
long spawner_main(int sock, const int *procs, int nprocs, unsigned long flags,
                  const char *spawner_name, const char *sandbox_name);

#endif
