/* A pooled sandbox (nsbox/helper/pool.py): built ahead, it waits on fd 0 for its one command,
 * which the pool sends in the flat form (nsbox/sandbox/native.py, flatten_command), then goes
 * on like any launch. As nsbox/sandbox/child.py, await_command and keep_only. */
#define _GNU_SOURCE
#include "child.h"

#include <errno.h>
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
        fail_about(c, errno, "the command could not be received: ", strerror(errno), "");
    const char *blob = buf;
    size_t len = (size_t)n;
    buf[n] = '\0';
    if (nfds == 4 && strncmp(buf, MEMFD_TAG, strlen(MEMFD_TAG)) == 0) {
        blob = map_memfd_message(buf, fds[--nfds], &len);
        if (blob == NULL)
            fail_about(c, errno, "the command's memfd: ", strerror(errno), "");
    }
    if (n == 0 || nfds != 3)
        fail(c, 0, "the pool closed before this sandbox got a command");
    if (take_streams(fds) != 0)
        fail_errno(c);
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

/* The lowest descriptor the plan holds that is >= ``from``, or -1. */
static int next_kept(const struct plan *plan, int from)
{
    const int fixed[] = {0, 1, 2, plan->sync_fd, plan->err_fd, plan->notify_fd, plan->net_fd};
    int best = -1;
    for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++) {
        if (fixed[i] >= from && (best < 0 || fixed[i] < best))
            best = fixed[i];
    }
    for (int i = 0; i < plan->nmounts; i++) {
        int fd = plan->mounts[i].source_fd;
        if (fd >= from && (best < 0 || fd < best))
            best = fd;
    }
    return best;
}

/* A pooled sandbox lives on while the helper serves other launches: it must not hold their
 * pipes (a held pipe end would keep another caller waiting for end-of-file). Every gap between
 * two kept descriptors is closed in one call, the kept ones taken in order without a sorted
 * copy (no buffer sized by the plan, no allocation): a plan holds a few dozen at most. */
void keep_only(const struct plan *plan)
{
    int next = 0;
    for (int kept = next_kept(plan, 0); kept >= 0; kept = next_kept(plan, next)) {
        if (kept > next)
            sys_close_range((unsigned)next, (unsigned)kept - 1, 0);
        next = kept + 1;
    }
    sys_close_range((unsigned)next, ~0U, 0);
}
