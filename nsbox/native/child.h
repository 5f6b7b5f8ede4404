/* What the steps of the sandbox child share: the plan, the step being run, the failure report.
 *
 * After the clone only system calls and this process's own memory are used, with two
 * exceptions that are safe only because every process that clones (the launch helper, a
 * spawner, a pooled sandbox) has a single thread, so that no lock of glibc can be held by
 * another thread at the moment of the clone: a pooled sandbox parses its command after its
 * clone (plan_parse_command, which calls calloc and free), and the messages of failures call
 * strerror (which may load the locale's messages). No stdio. The clone is a raw system call,
 * which leaves glibc's cached thread id stale: raise, abort and the pthread functions must
 * never be called after it. (tests/test_docs.py holds this list to the C files.)
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

/* A text being composed (an error message, a mount option string); cut when full, never
 * inside a UTF-8 character. */
struct text {
    char s[TEXT_MAX];
    size_t n;
};

/* The bytes of a step name or a message that a report carries (nsbox/sandbox/child.py,
 * REPORT_TEXT_MAX): a longer one is cut on a character boundary and ends in "...". Escaped, a
 * byte takes at most 6 bytes (\u00XX), so REPORT_MAX holds the largest report whole and its
 * closing text is never cut. */
#define REPORT_TEXT_MAX 4096
#define REPORT_MAX (2 * 6 * (REPORT_TEXT_MAX + 3) + 128)

/* JSON being written: into ``s``, and out to ``fd`` whenever it is full (a long trace), or,
 * with ``fd`` -1, held whole (a report: REPORT_MAX holds the largest). */
struct json_out {
    int fd;
    size_t n;
    char s[REPORT_MAX];
};

void json_init(struct json_out *o, int fd);
/* Text as it is (the caller's own JSON punctuation). */
void json_put_raw(struct json_out *o, const char *s);
void json_put_int(struct json_out *o, long long value);
/* A JSON string: quoted, cut to REPORT_TEXT_MAX bytes, escaped (RFC 8259, section 7); a byte
 * that is not part of a UTF-8 character is written as U+FFFD. */
void json_put_string(struct json_out *o, const char *s);
/* Write out what ``o`` holds (with fd >= 0). */
void json_flush(struct json_out *o);
/* {"step": STEP, "errno": ERR, "message": MESSAGE} in ``o``. */
void format_report(struct json_out *o, const char *step, int err, const char *message);
/* {"trace": [[NAME, NS], ...]} and a newline. */
void format_trace(struct json_out *o, const char *const *names, const long long *ns, int n);

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
/* "<call>: <strerror>", as the ctypes bindings of nsbox/_sys/libc.py name a failed call. */
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
/* Make fds[0..2] the standard streams 0, 1 and 2, open across exec, and close them (unless one
 * of them is a standard stream itself): 0, or -1 with errno. */
int take_streams(const int fds[3]);
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

/* Messages from the helper (nsbox/_sys/wire.py): a datagram of at most MESSAGE_MAX bytes, or
 * {"memfd": SIZE} with the message in a memfd passed last among its descriptors. */
#define MESSAGE_MAX (64 * 1024)  /* nsbox/_sys/wire.py, INLINE_MAX */
#define MEMFD_MESSAGE_MAX (256 * 1024 * 1024)  /* nsbox/_sys/wire.py, MAX_MESSAGE */
#define MEMFD_TAG "{\"memfd\": "
#define RECEIVE_MAX_FDS 254      /* SCM_MAX_FD (253), and the memfd of a large message */
/* One datagram and at most ``max_fds`` descriptors (close-on-exec): its length, or -1 with
 * errno: EMSGSIZE when the datagram or its descriptors did not fit, EMFILE when the kernel
 * could not install them here; none is kept either way. */
ssize_t receive_with_fds(int sock, char *buf, size_t size, int *fds, int max_fds, int *nfds);
/* The message that ``tag`` announces, mapped from the memfd ``fd`` (then closed): NULL with
 * errno EBADMSG (a tag that is not {"memfd": SIZE}, a memfd shorter than SIZE) or EMSGSIZE
 * (SIZE over MEMFD_MESSAGE_MAX). */
const char *map_memfd_message(const char *tag, int fd, size_t *len);

#endif
