/* The spawner of cgroup v1 hosts as a C loop (nsbox/helper/spawner.py has the protocol).
 *
 * A spawner waits in a run cgroup made ahead and clones a sandbox there, so that no launch
 * waits for the RCU grace period of a migration. The Python spawner is a clone of the helper
 * that runs Python: every page it writes (reference counts, frames) is copied from the helper,
 * about 2 ms of CPU per launch. This one is the same clone running only the C below, which
 * writes its own stack and nothing else of the helper's memory.
 *
 * Its whole life: parent-death signal, name, move into the cgroup (its pid into each
 * cgroup.procs the helper opened), only its socket left open, "ready"; then one message: the
 * native core's flat plan with its descriptors (clone, the child runs it in C), or "clone" (the
 * child returns into Python, as a clone of the Python spawner would, and receives its plan
 * there); "pid N" or "error E MESSAGE" back, exit.
 */
#define _GNU_SOURCE
#include "child.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "spawner.h"


static void reply(int sock, const char *word, long long number, const char *message)
{
    struct text t;
    text_init(&t);
    text_put(&t, word);
    text_put(&t, " ");
    text_put_int(&t, number);
    if (message != NULL) {
        text_put(&t, " ");
        text_put(&t, message);
    }
    if (write(sock, t.s, t.n) < 0)
        _exit(0);
}

static void fail_spawner(int sock, const char *message) __attribute__((noreturn));
static void fail_spawner(int sock, const char *message)
{
    int err = errno;
    struct text t;
    text_init(&t);
    text_put(&t, message);
    text_put(&t, ": ");
    text_put(&t, strerror(err));
    reply(sock, "error", err, t.s);
    _exit(0);
}

/* Its own pid into each cgroup.procs (cgroups(7)): the spawner moves itself, off any launch. */
static void enter_cgroup(int sock, const int *procs, int nprocs)
{
    struct text pid;
    text_init(&pid);
    text_put_int(&pid, getpid());
    for (int i = 0; i < nprocs; i++) {
        if (write(procs[i], pid.s, pid.n) < 0)
            fail_spawner(sock, "move into the spare cgroup");
    }
}

static void clone_native(int sock, const char *blob, size_t len, const int *fds, int nfds,
                         unsigned long flags) __attribute__((noreturn));
static void clone_native(int sock, const char *blob, size_t len, const int *fds, int nfds,
                         unsigned long flags)
{
    struct plan plan;
    const char *why;
    if (plan_parse(&plan, blob, len, fds, (size_t)nfds, &why) != 0) {
        reply(sock, "error", EINVAL, why);
        _exit(0);
    }
    long pid = syscall(SYS_clone, flags, 0, 0, 0, 0);
    if (pid == 0)
        child_main(&plan, &sock, 1);
    if (pid < 0)
        fail_spawner(sock, "clone");
    reply(sock, "pid", pid, NULL);
    _exit(0);
}

long spawner_main(int sock, const int *procs, int nprocs, unsigned long flags,
                  const char *spawner_name, const char *sandbox_name)
{
    char buf[MESSAGE_MAX + 1];
    int fds[RECEIVE_MAX_FDS];
    int nfds;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        fail_spawner(sock, "prctl");
    prctl(PR_SET_NAME, spawner_name, 0, 0, 0);  /* ps shows it; tools tell idle spares by it */
    enter_cgroup(sock, procs, nprocs);
    /* Only its own socket (and 0-2): the descriptors of other launches must not be held here,
     * nor reach a sandbox cloned from here. */
    if (sock > 3)
        sys_close_range(3, (unsigned)sock - 1, 0);
    sys_close_range((unsigned)sock + 1, ~0U, 0);
    if (write(sock, "ready", 5) < 0)
        _exit(0);
    ssize_t n = receive_with_fds(sock, buf, MESSAGE_MAX, fds, RECEIVE_MAX_FDS, &nfds);
    if (n < 0 && errno == EMSGSIZE)
        fail_spawner(sock, "receive the plan");
    if (n <= 0)
        _exit(0);  /* the helper gave up on this spare */
    buf[n] = '\0';
    if (n == 5 && memcmp(buf, "clone", 5) == 0) {
        long pid = syscall(SYS_clone, flags, 0, 0, 0, 0);
        if (pid == 0) {
            prctl(PR_SET_NAME, sandbox_name, 0, 0, 0);  /* takes the helper's name back */
            /* Into Python: the child receives its plan (become_sandbox); see spawner.h for
             * why a raw clone may return there. */
            return 0;
        }
        if (pid < 0)
            fail_spawner(sock, "clone");
        reply(sock, "pid", pid, NULL);
        _exit(0);
    }
    const char *blob = buf;
    size_t len = (size_t)n;
    if (nfds > 0 && strncmp(buf, MEMFD_TAG, strlen(MEMFD_TAG)) == 0) {
        blob = map_memfd_message(buf, fds[--nfds], &len);
        if (blob == NULL)
            fail_spawner(sock, "read the plan");
    }
    clone_native(sock, blob, len, fds, nfds, flags);
}
