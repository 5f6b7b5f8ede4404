/* The sandbox child's mounts, step for step as nsbox/sandbox/mounts.py makes them: the staging
 * root, mount targets reached by descriptor, one handler per kind of mount operation.
 *
 * A target may lie below a bind whose host directory another sandbox swaps for a symlink at
 * this very moment. So every target is reached from a descriptor of the new root, one directory
 * at a time, with no symlink followed at any component (openat2(2) RESOLVE_NO_SYMLINKS |
 * RESOLVE_BENEATH, or a walk with O_NOFOLLOW), and mounts go onto the descriptor itself
 * (move_mount(2), MOVE_MOUNT_T_EMPTY_PATH): a concurrent rename can only fail the launch.
 */
#define _GNU_SOURCE
#include "child.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define DIR_FLAGS (O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
#define NODE_FLAGS (O_PATH | O_NOFOLLOW | O_CLOEXEC)

void mount_or_fail(struct child *c, const char *source, const char *target, const char *fstype,
                   unsigned long flags, const char *data)
{
    if (mount(source, target, fstype, flags, data) != 0)
        fail_call(c, "mount", target);
}

void mount_tmpfs(struct child *c, const char *target, long long size, int mode,
                 unsigned long flags)
{
    struct text options;
    text_init(&options);
    text_put(&options, "size=");
    text_put_int(&options, size);
    text_put(&options, ",mode=");
    text_put_octal(&options, mode);
    mount_or_fail(c, "tmpfs", target, "tmpfs", flags, options.s);
}

void setattr_or_fail(struct child *c, const char *path, unsigned long long attrs, int recursive)
{
    if (sys_mount_setattr(AT_FDCWD, path, recursive ? AT_RECURSIVE : 0, attrs) != 0)
        fail_call(c, "mount_setattr", path);
}

void mkdir_or_fail(struct child *c, const char *path, mode_t mode)
{
    if (mkdir(path, mode) != 0)
        fail_errno(c);
}

void symlink_or_fail(struct child *c, const char *to, const char *path)
{
    if (symlink(to, path) != 0)
        fail_errno(c);
}

int stage(struct child *c)
{
    mount_tmpfs(c, STAGING, 1024 * 1024, 0755, MS_NOSUID | MS_NODEV);
    mkdir_or_fail(c, STAGING OLDROOT, 0777);
    mkdir_or_fail(c, STAGING NEWROOT, 0777);
    mkdir_or_fail(c, STAGING BUILD, 0777);
    mkdir_or_fail(c, STAGING EMPTY, 0555);
    if (syscall(SYS_pivot_root, STAGING, STAGING OLDROOT) != 0)
        fail_call(c, "pivot_root", STAGING);
    if (chdir("/") != 0)
        fail_errno(c);
    mount_tmpfs(c, NEWROOT, 4 * 1024 * 1024, 0755, MS_NOSUID | MS_NODEV);
    int fd = open(NEWROOT, DIR_FLAGS);
    if (fd < 0)
        fail_errno(c);
    return fd;
}

void enter_root(struct child *c)
{
    /* pivot_root(".", ".") stacks the staging root on the new one; detaching it leaves only
     * the new root (pivot_root(2), NOTES). */
    if (chdir(NEWROOT) != 0)
        fail_errno(c);
    if (syscall(SYS_pivot_root, ".", ".") != 0)
        fail_call(c, "pivot_root", ".");
    if (umount2(".", MNT_DETACH) != 0)
        fail_call(c, "umount2", ".");
    if (chdir("/") != 0)
        fail_errno(c);
}

/* --- mount targets, reached by descriptor ------------------------------------------------ */

/* A copy of a plan path that can be cut into components. */
struct path_buf {
    char s[PATH_MAX + 1];
};

static void check_components(struct child *c, const char *path)
{
    /* The plan normalizes targets (plan.check_target); this is the child's own guard. */
    size_t len = strlen(path);
    if (len > PATH_MAX)
        fail_about(c, ENAMETOOLONG, "mount target ", path, " is longer than PATH_MAX (4096 bytes)");
    int bad = path[0] != '/' || len == 1 || path[len - 1] == '/';
    for (const char *p = path; !bad && *p; p++) {
        if (*p != '/')
            continue;
        const char *name = p + 1;
        size_t n = strcspn(name, "/");
        bad = n == 0 || (n == 1 && name[0] == '.') || (n == 2 && name[0] == '.' && name[1] == '.');
    }
    if (bad)
        fail_about(c, EINVAL, "mount target ", path, " is not a normalized absolute path");
}

static void not_a_directory(struct child *c, int fd, const char *name, const char *shown)
{
    struct stat st;
    struct text t;
    const char *what = "a symlink or not a directory (it changed meanwhile)";
    if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISLNK(st.st_mode))
            what = "a symlink";
        else if (!S_ISDIR(st.st_mode))
            what = "not a directory";
    }
    text_init(&t);
    text_put(&t, name);
    text_put(&t, " in mount target ");
    text_put(&t, shown);
    text_put(&t, " is ");
    text_put(&t, what);
    text_put(&t, ": nsbox follows no symlink in a mount target and makes no directory in place "
                 "of a file");
    fail(c, ENOTDIR, t.s);
}

/* The directory ``name`` below ``fd``; -1 with errno ENOENT when it is missing. */
static int open_component(struct child *c, int fd, const char *name, const char *shown)
{
    int next = openat(fd, name, DIR_FLAGS);
    if (next >= 0 || errno == ENOENT)
        return next;
    if (errno == ENOTDIR || errno == ELOOP)
        not_a_directory(c, fd, name, shown);
    fail_errno(c);
}

static int walk_step(struct child *c, int fd, const char *name, mode_t mode, const char *shown)
{
    int next = open_component(c, fd, name, shown);
    if (next >= 0)
        return next;
    if (mkdirat(fd, name, mode) != 0 && errno != EEXIST)  /* EEXIST: made meanwhile */
        fail_errno(c);
    next = open_component(c, fd, name, shown);
    if (next < 0)
        fail_errno(c);
    return next;
}

/* An O_PATH descriptor of directory ``path`` of the new root, made (with its parents) where
 * missing, no symlink followed on the way; errors name ``shown``. */
static int open_dir(struct child *c, int root, const char *path, mode_t mode, const char *shown)
{
    struct path_buf buf;
    check_components(c, path);
    if (strchr(path + 1, '/') != NULL) {
        /* A deep directory that is there: one call for the whole path. */
        int fd = sys_openat2(root, path + 1, DIR_FLAGS, RESOLVE_NO_SYMLINKS_ | RESOLVE_BENEATH_);
        if (fd >= 0)
            return fd;
    }
    strcpy(buf.s, path + 1);
    int fd = root;
    for (char *name = buf.s; name != NULL;) {
        char *slash = strchr(name, '/');
        if (slash != NULL)
            *slash = '\0';
        int next = walk_step(c, fd, name, slash == NULL ? mode : 0777, shown);
        if (fd != root)
            close(fd);
        fd = next;
        name = slash == NULL ? NULL : slash + 1;
    }
    return fd;
}

/* The directory holding ``path`` (``root`` itself at the top), and its last component. */
static int open_parent(struct child *c, int root, const char *path, struct path_buf *parent,
                       const char **name)
{
    check_components(c, path);
    const char *slash = strrchr(path, '/');
    *name = slash + 1;
    if (slash == path)
        return root;
    memcpy(parent->s, path, (size_t)(slash - path));
    parent->s[slash - path] = '\0';
    return open_dir(c, root, parent->s, 0777, path);
}

static void release(int fd, int root)
{
    if (fd != root)
        close(fd);
}

static void refuse_file_target(struct child *c, const char *path, int is_dir)
{
    fail_about(c, is_dir ? EISDIR : ELOOP, "mount target ", path,
               is_dir ? " is a directory where a file is bound"
                      : " is a symlink where a file is bound");
}

/* The place a mount goes: a directory, or a file (made if missing) for a file bind. */
static int open_mountpoint(struct child *c, int root, const char *path, int is_dir)
{
    struct path_buf buf;
    struct stat st;
    const char *name;
    if (is_dir)
        return open_dir(c, root, path, 0777, path);
    int parent = open_parent(c, root, path, &buf, &name);
    int fd = openat(parent, name, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno == EEXIST) {
        fd = openat(parent, name, NODE_FLAGS);
        if (fd >= 0 && fstat(fd, &st) != 0)
            fail_errno(c);
        if (fd >= 0 && (S_ISLNK(st.st_mode) || S_ISDIR(st.st_mode)))
            refuse_file_target(c, path, S_ISDIR(st.st_mode));
    }
    if (fd < 0)
        fail_errno(c);
    release(parent, root);
    return fd;
}

static void refuse_existing(struct child *c, const char *path)
{
    fail_about(c, EEXIST, "", path, " exists and is not a plain file of its own (a directory, "
               "a device, a FIFO, a socket or a hard link): not written");
}

static int open_existing_file(struct child *c, int parent, const char *name, const char *path)
{
    struct stat st;
    /* O_NONBLOCK: a FIFO put here must not hang the launch; it is refused below. */
    int fd = openat(parent, name, O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0 && (errno == ENXIO || errno == EISDIR))
        refuse_existing(c, path);
    if (fd < 0 || fstat(fd, &st) != 0)
        fail_errno(c);
    /* A second name of the file (a hard link) could lead the write out of the tree. */
    if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
        refuse_existing(c, path);
    if (ftruncate(fd, 0) != 0)
        fail_errno(c);
    return fd;
}

static void write_file(struct child *c, int root, const struct mount_op *op)
{
    struct path_buf buf;
    const char *name;
    int parent = open_parent(c, root, op->target, &buf, &name);
    int fd = openat(parent, name, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC,
                    op->mode);
    if (fd < 0 && errno == EEXIST)
        fd = open_existing_file(c, parent, name, op->target);
    if (fd < 0)
        fail_errno(c);
    release(parent, root);
    for (size_t done = 0; done < op->data.len;) {
        ssize_t n = write(fd, op->data.data + done, op->data.len - done);
        if (n < 0)
            fail_errno(c);
        done += (size_t)n;
    }
    if (fchmod(fd, (mode_t)op->mode) != 0)
        fail_errno(c);
    close(fd);
}

/* --- the handlers ------------------------------------------------------------------------ */

/* Move the mount built at ``path`` (with what is below it) onto the descriptor ``target``. */
void move_into_place(struct child *c, const char *path, int target)
{
    if (sys_move_mount(AT_FDCWD, path, target, "", MOVE_MOUNT_T_EMPTY_PATH) != 0)
        fail_call(c, "move_mount", path);
    close(target);
}

static void symlink_refused(struct child *c, const char *path)
{
    fail_about(c, ELOOP, "", path, ": a component became a symlink since the path was "
               "resolved; it is refused, not followed");
}

/* The bind's source as the policy names it (the plan's is below /oldroot). */
static const char *shown_source(const struct mount_op *op)
{
    size_t n = strlen(OLDROOT);
    return strncmp(op->source, OLDROOT, n) == 0 && op->source[n] == '/' ? op->source + n
                                                                        : op->source;
}

/* Without openat2: one component at a time, none a symlink. Errors name ``shown``. */
static int walk_source(struct child *c, const char *path, const char *shown)
{
    struct stat st;
    char name[NAME_MAX + 1];
    if (strlen(path) > PATH_MAX)
        fail_about(c, ENAMETOOLONG, "bind source ", shown, " is longer than PATH_MAX (4096 bytes)");
    int fd = open("/", O_PATH | O_CLOEXEC);
    if (fd < 0)
        fail_call(c, "open", "/");
    for (const char *p = path; *p != '\0';) {
        size_t n = strcspn(p, "/");
        if (n == 0) {
            p++;
            continue;
        }
        if (n > NAME_MAX) {
            errno = ENAMETOOLONG;
            fail_call(c, "openat", shown);
        }
        memcpy(name, p, n);
        name[n] = '\0';
        p += n;
        int next = openat(fd, name, NODE_FLAGS | O_DIRECTORY);
        if (next < 0 && errno == ENOTDIR)
            next = openat(fd, name, NODE_FLAGS);
        if (next < 0)
            fail_call(c, "openat", shown);
        if (fstat(next, &st) != 0)
            fail_call(c, "fstat", shown);
        close(fd);
        fd = next;
        if (S_ISLNK(st.st_mode))
            symlink_refused(c, shown);
    }
    return fd;
}

/* A bind source by path (unprivileged: with the caller's own permissions). The plan resolved
 * it; a symlink put in its path since then is refused, not followed. */
static int open_source(struct child *c, const char *path, const char *shown)
{
    int fd = sys_openat2(AT_FDCWD, path, O_PATH | O_CLOEXEC | O_DIRECTORY, RESOLVE_NO_SYMLINKS_);
    if (fd < 0 && errno == ENOTDIR)  /* a file, opened without O_DIRECTORY */
        fd = sys_openat2(AT_FDCWD, path, O_PATH | O_CLOEXEC, RESOLVE_NO_SYMLINKS_);
    if (fd < 0 && (errno == ENOSYS || errno == EPERM))  /* no openat2 here (Linux < 5.6) */
        fd = walk_source(c, path, shown);
    if (fd < 0 && errno == ELOOP)
        symlink_refused(c, shown);
    if (fd < 0)
        fail_call(c, "openat2", shown);
    int tree = sys_open_tree(fd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE
                                     | AT_EMPTY_PATH);
    if (tree < 0)
        fail_call(c, "open_tree", shown);
    close(fd);
    return tree;
}

static void bind(struct child *c, int root, const struct mount_op *op)
{
    int target = open_mountpoint(c, root, op->target, op->is_dir);
    int tree = op->source_fd >= 0 ? op->source_fd : open_source(c, op->source, shown_source(op));
    unsigned long long attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    if (!op->writable)
        attrs |= MOUNT_ATTR_RDONLY;
    if (sys_mount_setattr(tree, "", AT_EMPTY_PATH | AT_RECURSIVE, attrs) != 0)
        fail_call(c, "mount_setattr", shown_source(op));
    if (sys_move_mount(tree, "", target, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)
        != 0)
        fail_call(c, "move_mount", op->target);
    close(tree);
    close(target);
}

static void make_symlink(struct child *c, int root, const struct mount_op *op)
{
    struct path_buf buf;
    const char *name;
    int parent = open_parent(c, root, op->target, &buf, &name);
    if (symlinkat(op->data.data, parent, name) != 0)
        fail_errno(c);
    release(parent, root);
}

void apply_mount(struct child *c, const struct mount_op *op)
{
    int root = c->root_fd;
    switch (op->kind) {
    case M_BIND:
        bind(c, root, op);
        break;
    case M_TMPFS: {
        int target = open_dir(c, root, op->target, 0777, op->target);
        mount_tmpfs(c, BUILD, op->size, op->mode, MS_NOSUID | MS_NODEV);
        move_into_place(c, BUILD, target);
        break;
    }
    case M_FILE:
        write_file(c, root, op);
        break;
    case M_SYMLINK:
        make_symlink(c, root, op);
        break;
    case M_DIR:
        close(open_dir(c, root, op->target, (mode_t)op->mode, op->target));
        break;
    case M_DEV:
        mount_dev(c, op, open_dir(c, root, op->target, 0777, op->target));
        break;
    case M_PROC:
        mount_proc(c, open_dir(c, root, op->target, 0777, op->target));
        break;
    default:
        fail(c, EINVAL, "unknown mount operation");
    }
}
