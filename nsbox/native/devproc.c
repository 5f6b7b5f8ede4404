/* The kernel's filesystems of the sandbox: its own /dev (a tmpfs with the host's device nodes
 * bound one by one, a new devpts, shm) and /proc (with the kernel's knobs read-only and the
 * host-wide files covered), built at /build and moved onto their target's descriptor, as
 * nsbox/sandbox/mounts.py does (mount_dev, mount_proc). */
#define _GNU_SOURCE
#include "child.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

/* The ptys of one sandbox, its --tty terminal among them (PTY_MAX in nsbox/sandbox/mounts.py). */
#define PTY_MAX "64"

static void mount_devpts(struct child *c)
{
    /* newinstance: a private set of ptys; no gid=tty, which is not mapped here. max: the
     * kernel's own limit counts the ptys of every instance together (kernel.pty.max, less
     * kernel.pty.reserve for the host's initial devpts; Documentation/filesystems/devpts.rst),
     * so without one, a sandbox opening /dev/ptmx in a loop took every pty the other sandboxes
     * could have had, and their --tty failed with ENOSPC. */
    mkdir_or_fail(c, BUILD "/pts", 0777);
    mount_or_fail(c, "devpts", BUILD "/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                  "newinstance,ptmxmode=0666,mode=0620,max=" PTY_MAX);
    symlink_or_fail(c, "pts/ptmx", BUILD "/ptmx");
}

static void bind_device(struct child *c, const char *name)
{
    struct text node, source;
    text_init(&node);
    text_put(&node, BUILD "/");
    text_put(&node, name);
    text_init(&source);
    text_put(&source, OLDROOT "/dev/");
    text_put(&source, name);
    int fd = open(node.s, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0)
        fail_errno(c);
    close(fd);
    mount_or_fail(c, source.s, node.s, NULL, MS_BIND, NULL);
    setattr_or_fail(c, node.s, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, 0);
}

void mount_dev(struct child *c, const struct mount_op *op, int target)
{
    mount_or_fail(c, "tmpfs", BUILD, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755");
    for (int i = 0; i < op->ndevices; i++)
        bind_device(c, op->devices[i]);
    symlink_or_fail(c, "/proc/self/fd", BUILD "/fd");
    symlink_or_fail(c, "/proc/self/fd/0", BUILD "/stdin");
    symlink_or_fail(c, "/proc/self/fd/1", BUILD "/stdout");
    symlink_or_fail(c, "/proc/self/fd/2", BUILD "/stderr");
    mkdir_or_fail(c, BUILD "/shm", 0777);
    mount_tmpfs(c, BUILD "/shm", op->size, 01777, MS_NOSUID | MS_NODEV);
    mount_devpts(c);
    setattr_or_fail(c, BUILD, MOUNT_ATTR_RDONLY, 0);
    move_into_place(c, BUILD, target);
}

/* Parts of /proc that show the whole host (see PROC_MASKED in nsbox/sandbox/mounts.py). */
static const char *const proc_masked[] = {"cmdline", "partitions", "diskstats", "swaps"};
static const char *const proc_read_only[] = {"sys", "sysrq-trigger", "irq", "bus"};

static void mask_host_files(struct child *c)
{
    for (size_t i = 0; i < sizeof(proc_masked) / sizeof(proc_masked[0]); i++) {
        struct text path;
        text_init(&path);
        text_put(&path, BUILD "/");
        text_put(&path, proc_masked[i]);
        if (mount(OLDROOT "/dev/null", path.s, NULL, MS_BIND, NULL) != 0 && errno != ENOENT)
            fail_call(c, "mount", path.s);
    }
    if (mount(EMPTY, BUILD "/fs", NULL, MS_BIND, NULL) != 0) {
        if (errno != ENOENT)
            fail_call(c, "mount", BUILD "/fs");
        return;
    }
    setattr_or_fail(c, BUILD "/fs", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
                    | MOUNT_ATTR_NOEXEC, 0);
}

/* The limits of the sandbox's user namespace on what the kernel counts per user of each user
 * namespace and again for the owner of every namespace above it, the user who launched the
 * sandbox (USER_NAMESPACE_LIMITS in nsbox/sandbox/mounts.py, which says why). */
static const char *const user_limits[][2] = {
    {"max_inotify_instances", "32"}, {"max_inotify_watches", "8192"},
    {"max_fanotify_groups", "32"}, {"max_fanotify_marks", "8192"},
};

/* Written through the new proc at BUILD, while this process holds CAP_SYS_RESOURCE in its user
 * namespace and before /proc/sys is read-only (limit_user_namespace in nsbox/sandbox/mounts.py).
 * A limit this kernel does not have is skipped. */
static void limit_user_namespace(struct child *c)
{
    for (size_t i = 0; i < sizeof(user_limits) / sizeof(user_limits[0]); i++) {
        struct text path, shown;
        text_init(&path);
        text_put(&path, BUILD "/sys/user/");
        text_put(&path, user_limits[i][0]);
        text_init(&shown);
        text_put(&shown, "/proc/sys/user/");
        text_put(&shown, user_limits[i][0]);
        int fd = open(path.s, O_WRONLY | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT)
            continue;
        if (fd < 0)
            fail_call(c, "write", shown.s);
        size_t len = strlen(user_limits[i][1]);
        ssize_t n = write(fd, user_limits[i][1], len);
        int err = n < 0 ? errno : EIO;
        close(fd);
        if (n != (ssize_t)len) {
            errno = err;
            fail_call(c, "write", shown.s);
        }
    }
}

void mount_proc(struct child *c, int target)
{
    /* Before pivot_root: once the host's /proc is detached, the kernel refuses a new proc
     * mount in a user namespace (mount_too_revealing in fs/namespace.c). */
    mount_or_fail(c, "proc", BUILD, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    limit_user_namespace(c);
    for (size_t i = 0; i < sizeof(proc_read_only) / sizeof(proc_read_only[0]); i++) {
        struct text path;
        text_init(&path);
        text_put(&path, BUILD "/");
        text_put(&path, proc_read_only[i]);
        if (mount(path.s, path.s, NULL, MS_BIND | MS_REC, NULL) != 0) {
            if (errno == ENOENT)
                continue;
            fail_call(c, "mount", path.s);
        }
        setattr_or_fail(c, path.s, MOUNT_ATTR_RDONLY, 1);
    }
    mask_host_files(c);
    move_into_place(c, BUILD, target);
}
