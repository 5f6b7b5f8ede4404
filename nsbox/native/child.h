/* What the steps of the sandbox child share: the plan, the step being run, the failure report.
 *
 * Only system calls and this process's own memory are used after the clone: no Python, no
 * malloc, no stdio (the helper that was cloned is single-threaded, so no lock is held, but
 * nothing here needs one either).
 */
#ifndef NSBOX_NATIVE_CHILD_H
#define NSBOX_NATIVE_CHILD_H

#include "plan.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/types.h>

#define TRACE_MAX 256
#define TEXT_MAX 8192

struct child {
    const struct plan *plan;
    const char *step;
    int root_fd;
    int capabilities_dropped;  /* a pooled sandbox drops them before it waits */
    int trace_n;
    const char *trace_names[TRACE_MAX];
    long long trace_ns[TRACE_MAX];
};

/* A text being composed (an error message, a mount option string); truncated when full. */
struct text {
    char s[TEXT_MAX];
    size_t n;
};

void text_init(struct text *t);
void text_put(struct text *t, const char *s);
void text_put_int(struct text *t, long long value);
void text_put_octal(struct text *t, long long value);

/* The step about to run: its name is what a failure reports (and, with NSBOX_TRACE, when). */
void set_step(struct child *c, const char *name);

/* With NSBOX_TRACE: the steps and their times, one line on the error pipe before the exec. */
void send_trace(struct child *c);

/* Report {step, errno, message} on the error pipe and exit 127 (nsbox/sandbox/child.py, fail). */
void fail(struct child *c, int err, const char *message) __attribute__((noreturn));
/* The same with errno and strerror(errno), as an OSError from the os module reads. */
void fail_errno(struct child *c) __attribute__((noreturn));
/* "<call>: <strerror>", as the ctypes bindings of nsbox/_libc.py name a failed call. */
void fail_call(struct child *c, const char *call, const char *arg) __attribute__((noreturn));
/* Fail with the message ``before`` ``what`` ``after``: a path or a name between two texts. */
void fail_about(struct child *c, int err, const char *before, const char *what, const char *after)
    __attribute__((noreturn));

/* The mounts (mounts.c) and the kernel's filesystems (devproc.c). */
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x4
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x40
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x1
#define MOUNT_ATTR_NOSUID 0x2
#define MOUNT_ATTR_NODEV 0x4
#define MOUNT_ATTR_NOEXEC 0x8
#endif
#define RESOLVE_NO_SYMLINKS_ 0x04
#define RESOLVE_BENEATH_ 0x08

/* The staging tmpfs over /tmp becomes the root until the final pivot; the host's root stays
 * under /oldroot, the sandbox's root is built under /newroot, new mounts are made at /build
 * (reachable by this process alone) and moved onto their target's descriptor. */
#define STAGING "/tmp"
#define OLDROOT "/oldroot"
#define NEWROOT "/newroot"
#define BUILD "/build"
#define EMPTY "/empty"

int stage(struct child *c);
void apply_mount(struct child *c, const struct mount_op *op);
void enter_root(struct child *c);
void mount_or_fail(struct child *c, const char *source, const char *target, const char *fstype,
                   unsigned long flags, const char *data);
void mount_tmpfs(struct child *c, const char *target, long long size, int mode,
                 unsigned long flags);
void setattr_or_fail(struct child *c, const char *path, unsigned long long attrs, int recursive);
void mkdir_or_fail(struct child *c, const char *path, mode_t mode);
void symlink_or_fail(struct child *c, const char *to, const char *path);
void move_into_place(struct child *c, const char *path, int target);
void mount_dev(struct child *c, const struct mount_op *op, int target);
void mount_proc(struct child *c, int target);

/* The capabilities (child.c), and a pooled sandbox's wait for its command (pooled.c). */
void drop_capabilities(struct child *c);
void await_command(struct child *c, struct plan *command);
void keep_only(const struct plan *plan);

/* Raw system calls without a glibc wrapper on every libc this builds with. */
int sys_mount_setattr(int dirfd, const char *path, unsigned flags, unsigned long long attr_set);
int sys_move_mount(int from_dirfd, const char *from_path, int to_dirfd, const char *to_path,
                   unsigned flags);
int sys_open_tree(int dirfd, const char *path, unsigned flags);
int sys_openat2(int dirfd, const char *path, unsigned long long flags,
                unsigned long long resolve);
int sys_close_range(unsigned first, unsigned last, unsigned flags);

/* Messages from the helper (nsbox/_wire.py): a datagram of at most MESSAGE_MAX bytes, or
 * {"memfd": SIZE} with the message in a memfd passed last among its descriptors. */
#define MESSAGE_MAX (64 * 1024)  /* nsbox/_wire.py, INLINE_MAX */
#define MEMFD_TAG "{\"memfd\": "
#define RECEIVE_MAX_FDS 254      /* SCM_MAX_FD (253), and the memfd of a large message */
ssize_t receive_with_fds(int sock, char *buf, size_t size, int *fds, int max_fds, int *nfds);
const char *map_memfd_message(const char *tag, int fd, size_t *len);

#endif
