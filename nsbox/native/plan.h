/* The flat plan of one launch, as the native core holds it between parse and exec.
 *
 * Python prepares the plan once, before the clone (nsbox/sandbox/native.py, flatten), as one
 * byte string of tagged items; plan.c turns it into this structure in the parent, and the child
 * reads only this structure: no Python object is touched after the clone, as in CPython's
 * _posixsubprocess. Every string is NUL-terminated and valid UTF-8 (flatten checks it), so the
 * child can put it into a JSON report as it is.
 */
#ifndef NSBOX_NATIVE_PLAN_H
#define NSBOX_NATIVE_PLAN_H

#include <stddef.h>
#include <stdint.h>

/* The layout of the flat plan that plan_parse reads: nsbox/sandbox/native.py, FORMAT, and
 * the extension's FORMAT (module.c) are this number, raised whenever the layout changes. */
#define PLAN_FORMAT 3

/* The ranges of the plan's small numbers: anything outside makes the plan malformed. */
#define MODE_MAX 07777     /* a file mode's permission bits */
#define RESOURCE_MAX 63    /* an rlimit's resource (RLIMIT_NLIMITS is 16) */
#define CAP_LAST_MAX 63    /* /proc/sys/kernel/cap_last_cap (40 in Linux 6.x) */

/* The mount kinds the native core carries out (nsbox/sandbox/mounts.py, HANDLERS). */
enum mount_kind { M_BIND = 1, M_TMPFS, M_FILE, M_SYMLINK, M_DIR, M_DEV, M_PROC };

/* The network modes (nsbox/sandbox/netns.py, setup_network). */
enum net_mode { NET_NONE = 0, NET_LOOPBACK, NET_ALLOW };

struct bytes_item {
    const char *data;
    size_t len;
};

struct mount_op {
    int kind;
    const char *target;
    const char *step;        /* "<op> <target>", the step name reported on failure */
    int source_fd;           /* a detached tree the helper opened, or -1 */
    const char *source;      /* /oldroot + the bind's source, opened here when source_fd < 0 */
    int writable, is_dir;
    long long size;          /* tmpfs size, or /dev/shm's */
    int mode;
    struct bytes_item data;  /* a File's content, a symlink's destination */
    const char **devices;    /* /dev: the names of the device nodes bound from the host */
    int ndevices;
};

struct rlimit_item {
    int resource;
    long long soft, hard;
};

struct plan {
    int stdio[3];
    int sync_fd, err_fd, notify_fd, net_fd;
    int uid, gid, cap_last, trace;
    int pooled;              /* built ahead: waits on fd 0 for its command (nsbox/launch/pool.py) */
    uint64_t ignored_signals;  /* put back to SIG_DFL before the exec: bit N-1 for signal N */
    const char *comm;        /* the process name to show (a spawner's child), or "" */
    const char *hostname;
    int net_mode, proxy_port;
    int nmounts;
    struct mount_op *mounts;
    int nrlimits;
    struct rlimit_item *rlimits;
    const char *cwd;
    char **argv, **envp;
    int exec_direct;         /* argv[0] holds a slash: executed as it is, no PATH search */
    char **candidates;       /* otherwise each PATH directory joined with argv[0] */
    int ncandidates;
    struct bytes_item setid_bpf, seccomp_bpf;
    int seccomp_notify;
    int tty, tty_rows, tty_cols;  /* --tty: a pty of the sandbox's own, at this window size */
    /* what the parsing allocated, freed by plan_free */
    void *allocations[32];
    int nallocations;
};

/* Parse ``blob`` (kept alive by the caller) with ``fds`` (the descriptors the blob refers to
 * by index); returns 0, or -1 with *why set. */
int plan_parse(struct plan *plan, const char *blob, size_t len, const int *fds, size_t nfds,
               const char **why);
void plan_free(struct plan *plan);
/* A pooled sandbox's command (the per-command part of the blob) over ``plan``'s own: 0, or -1
 * when it is malformed. */
int plan_parse_command(struct plan *plan, const char *blob, size_t len);

/* The sandbox child: runs the steps of nsbox/sandbox/child.py; never returns. */
void child_main(const struct plan *plan, const int *close_fds, int nclose)
    __attribute__((noreturn));

#endif
