/* A pooled sandbox (nsbox/helper/pool.py): built ahead, it waits on fd 0 for its one command,
 * which the pool sends in the flat form (nsbox/sandbox/native.py, flatten_command), then goes
 * on like any launch. As nsbox/sandbox/child.py, await_command and keep_only. */
#define _GNU_SOURCE
#include "child.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

/* --- a pooled sandbox: built ahead, then one command (nsbox/helper/pool.py) ---------------- */

void await_command(struct child *c, struct plan *command)
{
    /* Nothing that follows needs a capability: they go now, off the command's path. */
    char buf[MESSAGE_MAX + 1];
    int fds[4], nfds;
    set_step(c, "drop capabilities");
    drop_capabilities(c);
    c->capabilities_dropped = 1;
    set_step(c, "no_new_privs");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail_call(c, "prctl", "PR_SET_NO_NEW_PRIVS");
    set_step(c, "wait for command");
    if (send(0, "ready", 5, MSG_NOSIGNAL) < 0)
        fail_errno(c);
    ssize_t n = receive_with_fds(0, buf, MESSAGE_MAX, fds, 4, &nfds);
    if (n < 0)
        fail_errno(c);
    const char *blob = buf;
    size_t len = (size_t)n;
    buf[n] = '\0';
    if (nfds == 4 && strncmp(buf, MEMFD_TAG, strlen(MEMFD_TAG)) == 0) {
        blob = map_memfd_message(buf, fds[--nfds], &len);
        if (blob == NULL)
            fail_errno(c);
    }
    if (n == 0 || nfds != 3)
        fail(c, 0, "the pool closed before this sandbox got a command");
    for (int i = 0; i < 3; i++) {
        if (dup2(fds[i], i) < 0)
            fail_errno(c);
        close(fds[i]);
    }
    *command = *c->plan;
    if (len == 0 || blob[0] != 'i' || plan_parse_command(command, blob, len) != 0)
        fail(c, EINVAL, "this pooled sandbox runs the native core, which cannot carry this "
                        "command (a name that is not UTF-8, or a NUL byte): run it with "
                        "NSBOX_NATIVE=0 set for the pool's process");
    c->plan = command;
    if (command->trace) {
        c->trace_n = 0;  /* the command's trace starts when it arrives */
        set_step(c, "command received");
    }
}

static int compare_ints(const void *a, const void *b)
{
    return *(const int *)a - *(const int *)b;
}

/* A pooled sandbox lives on while the helper serves other launches: it must not hold their
 * pipes (a held pipe end would keep another caller waiting for end-of-file). */
void keep_only(const struct plan *plan)
{
    int keep[plan->nmounts + 8];
    int n = 0;
    keep[n++] = 0, keep[n++] = 1, keep[n++] = 2;
    keep[n++] = plan->sync_fd, keep[n++] = plan->err_fd;
    keep[n++] = plan->notify_fd, keep[n++] = plan->net_fd;
    for (int i = 0; i < plan->nmounts; i++)
        keep[n++] = plan->mounts[i].source_fd;
    qsort(keep, (size_t)n, sizeof(int), compare_ints);
    int next = 0;
    for (int i = 0; i < n; i++) {
        if (keep[i] < next)
            continue;  /* -1, or a descriptor listed twice */
        if (keep[i] > next)
            sys_close_range((unsigned)next, (unsigned)keep[i] - 1, 0);
        next = keep[i] + 1;
    }
    sys_close_range((unsigned)next, ~0U, 0);
}
