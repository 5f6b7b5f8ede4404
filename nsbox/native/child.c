/* The sandbox child of the native core: the same named steps as nsbox/sandbox/child.py, in the
 * same order, with the same failure contract ({step, errno, message} on the error pipe, exit
 * 127), then the same pid-1 init. child_main reads top to bottom; each step is a small function.
 */
#define _GNU_SOURCE
#include "child.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <termios.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC 4
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif
#ifndef SECCOMP_FILTER_FLAG_NEW_LISTENER
#define SECCOMP_FILTER_FLAG_NEW_LISTENER (1UL << 3)
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x1
#endif

/* What a supervisor sends: docker stop / systemd (TERM), a terminal (INT, QUIT, HUP, WINCH),
 * USR1 and USR2 for reloads and dumps; pid 1 passes them on to the command. */
static const int forwarded_signals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2,
                                        SIGWINCH};

/* --- identity, the launcher, the root -------------------------------------------------- */

static void wait_for_maps(struct child *c)
{
    /* The helper writes uid_map/gid_map, then one byte; end-of-file: the helper is gone. */
    char byte = 0;
    ssize_t n;
    do {
        n = read(c->plan->sync_fd, &byte, 1);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        fail_errno(c);
    if (n != 1 || byte != '1')
        fail(c, 0, "the launch helper went away before the sandbox was set up");
}

static void set_identity(struct child *c)
{
    /* The capabilities of the new user namespace survive: the kernel clears them only when
     * leaving uid 0 of that namespace, which is not mapped in it (capabilities(7)). */
    if (setresgid((gid_t)c->plan->gid, (gid_t)c->plan->gid, (gid_t)c->plan->gid) != 0)
        fail_errno(c);
    if (setresuid((uid_t)c->plan->uid, (uid_t)c->plan->uid, (uid_t)c->plan->uid) != 0)
        fail_errno(c);
    umask(022);
}

static void die_with_launcher(struct child *c)
{
    /* After the uid change, which clears the parent-death signal (prctl(2)). The helper holds
     * the sync pipe open while it lives: a hang-up there means it died before this line. */
    struct pollfd pfd = {c->plan->sync_fd, POLLIN, 0};
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        fail_call(c, "prctl", "PR_SET_PDEATHSIG");
    if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLHUP | POLLERR)))
        fail(c, 0, "the launch helper went away before the sandbox was set up");
}

static void set_hostname(struct child *c)
{
    if (sethostname(c->plan->hostname, strlen(c->plan->hostname)) != 0)
        fail_call(c, "sethostname", c->plan->hostname);
}

/* --- network (nsbox/sandbox/netns.py) ----------------------------------------------------- */

static void loopback_up(struct child *c)
{
    /* IFF_UP on lo (netdevice(7)); the kernel then adds 127.0.0.1/8 and ::1. */
    struct ifreq req;
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        fail_errno(c);
    memset(&req, 0, sizeof(req));
    strcpy(req.ifr_name, "lo");
    if (ioctl(sock, SIOCGIFFLAGS, &req) != 0)
        fail_errno(c);
    req.ifr_flags |= IFF_UP;
    if (ioctl(sock, SIOCSIFFLAGS, &req) != 0)
        fail_errno(c);
    close(sock);
}

/* Pass ``fd`` over the unix socket ``channel`` with ``tag`` (unix(7), SCM_RIGHTS). */
static int send_fd(int channel, const char *tag, size_t tag_len, int fd)
{
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {(void *)tag, tag_len};
    struct msghdr msg = {0};
    memset(&control, 0, sizeof(control));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.buf;
    msg.msg_controllen = sizeof(control.buf);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    return sendmsg(channel, &msg, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

static void proxy_listener_failed(struct child *c)
{
    struct text t;
    int err = errno;
    text_init(&t);
    text_put(&t, "proxy listener on 127.0.0.1:");
    text_put_int(&t, c->plan->proxy_port);
    text_put(&t, ": ");
    text_put(&t, strerror(err));
    fail(c, err, t.s);
}

static void send_proxy_listener(struct child *c)
{
    /* The listener goes to the host's proxy; no process inside keeps it. */
    struct sockaddr_in addr = {0};
    static const char tag[] = "nsbox-proxy-listener";
    if (c->plan->net_fd < 0)
        fail(c, 0, "allow mode without a channel for the proxy listener");
    int sock = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        fail_errno(c);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)c->plan->proxy_port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(sock, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(sock, 128) != 0)
        proxy_listener_failed(c);
    if (send_fd(c->plan->net_fd, tag, sizeof(tag) - 1, sock) != 0)
        fail_errno(c);
    close(sock);
    close(c->plan->net_fd);
}

static void setup_network(struct child *c)
{
    if (c->plan->net_mode == NET_NONE)
        return;
    loopback_up(c);
    if (c->plan->net_mode == NET_ALLOW)
        send_proxy_listener(c);
}

/* --- the per-command steps -------------------------------------------------------------- */

static void set_rlimits(struct child *c)
{
    /* No core dumps: a dump would write the sandbox's memory where the host decides. The
     * errors read as Python's resource.setrlimit reports them (a ValueError, no errno). */
    struct rlimit none = {0, 0};
    if (setrlimit(RLIMIT_CORE, &none) != 0)
        fail_errno(c);
    for (int i = 0; i < c->plan->nrlimits; i++) {
        const struct rlimit_item *item = &c->plan->rlimits[i];
        struct rlimit lim = {item->soft < 0 ? RLIM_INFINITY : (rlim_t)item->soft,
                             item->hard < 0 ? RLIM_INFINITY : (rlim_t)item->hard};
        if (setrlimit(item->resource, &lim) == 0)
            continue;
        if (errno == EINVAL)
            fail(c, 0, "ValueError: current limit exceeds maximum limit");
        if (errno == EPERM)
            fail(c, 0, "ValueError: not allowed to raise maximum limit");
        fail_errno(c);
    }
}

void drop_capabilities(struct child *c)
{
    /* The bounding set first: dropping from it needs CAP_SETPCAP, which capset removes. */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof(data));
    for (int cap = 0; cap <= c->plan->cap_last; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0)
            fail_call(c, "prctl", "PR_CAPBSET_DROP");
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0)
        fail_call(c, "prctl", "PR_CAP_AMBIENT");
    if (syscall(SYS_capset, &header, data) != 0)
        fail_call(c, "capset", "0");
}

static int load_filter(struct child *c, const struct bytes_item *bpf, unsigned long flags)
{
    struct sock_fprog prog = {(unsigned short)(bpf->len / 8), (struct sock_filter *)bpf->data};
    if (bpf->len == 0 || bpf->len % 8 != 0 || bpf->len / 8 > 0xffff)
        fail(c, EINVAL, "seccomp: the BPF program is not whole instructions");
    int result = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, flags, &prog);
    if (result < 0)
        fail_call(c, "seccomp", "SECCOMP_SET_MODE_FILTER");
    return result;
}

static void apply_seccomp(struct child *c)
{
    /* The set-id filter goes into every sandbox, before the policy's (nsbox/host/seccomp.py). */
    if (c->plan->setid_bpf.len == 0)
        fail(c, EINVAL, "the plan has no set-id filter (plan.build makes one)");
    load_filter(c, &c->plan->setid_bpf, 0);
    if (c->plan->seccomp_bpf.len == 0)
        return;
    if (!c->plan->seccomp_notify) {
        load_filter(c, &c->plan->seccomp_bpf, 0);
        return;
    }
    /* Learning mode: the listener goes to the helper and never reaches the sandbox, which
     * could otherwise answer its own notifications (seccomp_unotify(2)). */
    int listener = load_filter(c, &c->plan->seccomp_bpf, SECCOMP_FILTER_FLAG_NEW_LISTENER);
    if (send_fd(c->plan->notify_fd, "l", 1, listener) != 0)
        fail_errno(c);
    close(listener);
}

/* --- the sandbox's own terminal (--tty; nsbox/sandbox/terminal.py says why it is made here) */

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif

/* A pty pair of the sandbox's devpts: the master goes to the host over fd 0 (a unix socket
 * the host handed in as stdin), the slave becomes fds 0, 1 and 2 at the plan's window size. */
static void open_terminal(struct child *c)
{
    static const char tag[] = "nsbox-tty";
    int unlock = 0;
    struct winsize size = {(unsigned short)c->plan->tty_rows, (unsigned short)c->plan->tty_cols,
                           0, 0};
    int master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0)
        fail_errno(c);
    if (ioctl(master, TIOCSPTLCK, &unlock) != 0)
        fail_errno(c);
    /* TIOCGPTPEER rather than open("/dev/pts/N"): no name to resolve (ioctl_tty(2)). */
    int slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (slave < 0)
        fail_errno(c);
    if (ioctl(slave, TIOCSWINSZ, &size) != 0)
        fail_errno(c);
    if (send_fd(0, tag, sizeof(tag) - 1, master) != 0)
        fail_errno(c);
    close(master);
    for (int fd = 0; fd < 3; fd++) {
        if (dup2(slave, fd) < 0)
            fail_errno(c);
    }
    close(slave);
}

static void execute(struct child *c) __attribute__((noreturn));
static void execute(struct child *c)
{
    const struct plan *plan = c->plan;
    int denied = 0;
    if (plan->exec_direct) {
        execve(plan->argv[0], plan->argv, plan->envp);
        fail_errno(c);
    }
    for (int i = 0; i < plan->ncandidates; i++) {
        execve(plan->candidates[i], plan->argv, plan->envp);
        if (errno == EACCES)
            denied = 1;
        else if (errno != ENOENT && errno != ENOTDIR)
            fail_errno(c);
    }
    if (denied)
        fail(c, EACCES, strerror(EACCES));
    fail_about(c, ENOENT, "command not found inside the sandbox: ", plan->argv[0], "");
}

/* --- the init: pid 1 of every run ------------------------------------------------------ */
/* A command that is itself pid 1 neither reaps orphans nor gets the signals it has no handler
 * for (pid_namespaces(7)); so pid 1 forks once more and stays as the sandbox's init. */

static void init_signals(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGCHLD);
    for (size_t i = 0; i < sizeof(forwarded_signals) / sizeof(forwarded_signals[0]); i++)
        sigaddset(set, forwarded_signals[i]);
}

/* Reap every child until the command ends; pass the forwarded signals on to it. */
static int wait_for_command(pid_t command)
{
    sigset_t set;
    init_signals(&set);
    for (;;) {
        int signo = sigwaitinfo(&set, NULL);
        if (signo < 0)
            continue;  /* EINTR */
        if (signo != SIGCHLD) {
            kill(command, signo);  /* ESRCH: it has just ended, its SIGCHLD is queued */
            continue;
        }
        for (;;) {  /* SIGCHLD does not queue: one may stand for many exits */
            int status;
            pid_t pid = waitpid(-1, &status, WNOHANG);
            if (pid <= 0)
                break;
            if (pid == command)
                return status;
        }
    }
}

/* The places a sandbox writes to that are full when the command ends: less than 1 MiB (or no
 * inode) free, statvfs(3). As sandbox/child.py's full_places: the host names them in one line,
 * for a failure that may come from there. */
static void put_full_places(struct text *t)
{
    static const char *const places[] = {"/tmp", "/workspace", "/dev/shm"};
    int found = 0;
    for (size_t i = 0; i < sizeof places / sizeof places[0]; i++) {
        struct statvfs st;
        if (statvfs(places[i], &st) != 0 || st.f_blocks == 0)
            continue;
        if ((unsigned long long)st.f_bavail * st.f_frsize >= (1ULL << 20)
            && !(st.f_files != 0 && st.f_favail == 0))
            continue;
        text_put(t, found++ ? ", \"" : ", \"full\": [\"");
        text_put(t, places[i]);
        text_put(t, "\"");
    }
    if (found)
        text_put(t, "]");
}

static void serve_as_init(struct child *c, pid_t command) __attribute__((noreturn));
static void serve_as_init(struct child *c, pid_t command)
{
    /* The command's streams close here, so that a reader sees end-of-file when the command
     * and its children close theirs. pid 1 cannot pass a signal death on by dying of it: it
     * writes the command's wait status, then exits with the code a shell would show. */
    struct text t;
    int err_fd = c->plan->err_fd;
    set_step(c, "init");
    if (err_fd > 0 && sys_close_range(0, (unsigned)err_fd - 1, 0) != 0)
        fail_call(c, "close_range", "0");
    if (sys_close_range((unsigned)err_fd + 1, ~0U, 0) != 0)
        fail_call(c, "close_range", "err_fd + 1");
    int status = wait_for_command(command);
    text_init(&t);
    text_put(&t, "\n{\"status\": ");
    text_put_int(&t, status);
    put_full_places(&t);
    text_put(&t, "}\n");
    if (write(err_fd, t.s, t.n) < 0)
        fail_errno(c);
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

/* The command starts with every signal at its default and none blocked, whatever the launcher
 * left ignored: ignored signals stay ignored across fork and exec (signal(7)), and a shell's
 * background job arrives with SIGINT and SIGQUIT ignored, nohup with SIGHUP, Python with
 * SIGPIPE and SIGXFSZ, the helper with SIGINT. Only an ignored signal needs it (exec puts a
 * caught one back to SIG_DFL): those the plan names, which the helper noted when it started
 * (nsbox/sandbox/child.py, ignored_signals). The raw system call, because glibc's sigaction
 * refuses its own internal signals (32 and 33, SIGCANCEL and SIGSETXID), which an older
 * glibc's posix_spawn left ignored. As bubblewrap and crun do. */
static void reset_signals(struct child *c)
{
    struct kernel_sigaction {  /* x86_64 and aarch64 (asm-generic/signal.h) */
        void (*handler)(int);
        unsigned long flags;
        void (*restorer)(void);
        uint64_t mask;
    } dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.handler = SIG_DFL;
    for (int sig = 1; sig < NSIG && sig <= 64; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP || !((c->plan->ignored_signals >> (sig - 1)) & 1))
            continue;
        if (syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof(dfl.mask)) != 0)
            fail_call(c, "rt_sigaction", "SIG_DFL");
    }
    uint64_t none = 0;
    if (syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, sizeof(none)) != 0)
        fail_call(c, "rt_sigprocmask", "SIG_SETMASK");
}

static void start_init(struct child *c)
{
    /* Blocked before the fork, so that none arrives before pid 1 waits for it. Not dumpable:
     * the command (same uid) must never ptrace pid 1, which is outside the seccomp filter
     * (ptrace(2), "Ptrace access mode checking"). CLONE_VFORK: pid 1 sleeps until the child
     * has exec'd, so no page is copied twice (clone(2)); the memory is not shared. */
    sigset_t set;
    init_signals(&set);
    if (sigprocmask(SIG_BLOCK, &set, NULL) != 0)
        fail_errno(c);
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
        fail_call(c, "prctl", "PR_SET_DUMPABLE");
    if (prctl(PR_SET_NAME, "nsbox-init", 0, 0, 0) != 0)
        fail_call(c, "prctl", "PR_SET_NAME");
    long pid = syscall(SYS_clone, SIGCHLD | CLONE_VFORK, 0, 0, 0, 0);
    if (pid < 0)
        fail_call(c, "clone", "CLONE_VFORK");
    if (pid == 0) {
        /* Its own session and process group, as a command a shell starts. */
        if (setsid() < 0)
            fail_errno(c);
        /* --tty: the slave on fd 0 becomes its controlling terminal (ioctl_tty(2)). */
        if (c->plan->tty && ioctl(0, TIOCSCTTY, 0) != 0)
            fail_errno(c);
        reset_signals(c);
        return;
    }
    serve_as_init(c, (pid_t)pid);
}

/* --- the launch ------------------------------------------------------------------------- */

int take_streams(const int fds[3])
{
    int from[3];
    /* A stream that is 0, 1 or 2 already, but not its own, would be overwritten by an earlier
     * dup2: moved above 2 first (_posixsubprocess, child_exec, does the same). */
    for (int i = 0; i < 3; i++) {
        from[i] = fds[i];
        if (from[i] >= 0 && from[i] < 3 && from[i] != i) {
            from[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
            if (from[i] < 0)
                return -1;
        }
    }
    for (int i = 0; i < 3; i++) {
        /* dup2 of a descriptor onto itself does nothing: it would stay close-on-exec (they
         * arrive so, MSG_CMSG_CLOEXEC) and the command would start without the stream. */
        if (from[i] == i) {
            int flags = fcntl(i, F_GETFD);
            if (flags < 0 || fcntl(i, F_SETFD, flags & ~FD_CLOEXEC) != 0)
                return -1;
        } else if (dup2(from[i], i) < 0) {
            return -1;
        }
    }
    for (int i = 0; i < 3; i++) {
        int again = (i > 0 && from[i] == from[0]) || (i > 1 && from[i] == from[1]);
        if (from[i] > 2 && !again)
            close(from[i]);
    }
    return 0;
}

/* The helper's ends go, the standard streams come; a failure here is reported under the
 * first step's name ("start"), as the Python child does (nsbox/helper/clone.py). */
static void take_descriptors(struct child *c, const int *close_fds, int nclose)
{
    const struct plan *plan = c->plan;
    for (int i = 0; i < nclose; i++)
        close(close_fds[i]);
    if (take_streams(plan->stdio) != 0)
        fail_errno(c);
    if (plan->pooled)
        keep_only(plan);
    if (plan->comm[0] != '\0')
        prctl(PR_SET_NAME, plan->comm, 0, 0, 0);  /* the helper's name, not the spawner's */
}

static void build_sandbox(struct child *c)
{
    set_step(c, "wait for id maps");
    wait_for_maps(c);
    set_step(c, "cgroup namespace");
    /* Made now, after the helper moved us into the run's cgroup: rooted there
     * (cgroup_namespaces(7)). */
    if (unshare(CLONE_NEWCGROUP) != 0)
        fail_call(c, "unshare", "CLONE_NEWCGROUP");
    set_step(c, "set identity");
    set_identity(c);
    set_step(c, "die with the launcher");
    die_with_launcher(c);
    set_step(c, "make mounts private");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        fail_call(c, "mount", "/");
    set_step(c, "mount tmpfs root");
    c->root_fd = stage(c);
    for (int i = 0; i < c->plan->nmounts; i++) {
        set_step(c, c->plan->mounts[i].step);
        apply_mount(c, &c->plan->mounts[i]);
    }
    close(c->root_fd);
    set_step(c, "pivot_root");
    enter_root(c);
    set_step(c, "remount root read-only");
    if (sys_mount_setattr(AT_FDCWD, "/", 0, MOUNT_ATTR_RDONLY) != 0)
        fail_call(c, "mount_setattr", "/");
    set_step(c, "hostname");
    set_hostname(c);
    set_step(c, "network");
    setup_network(c);
}

static void finish_and_exec(struct child *c) __attribute__((noreturn));
static void finish_and_exec(struct child *c)
{
    set_step(c, "rlimits");
    set_rlimits(c);
    set_step(c, "new session");
    if (setsid() < 0)
        fail_errno(c);
    set_step(c, "working directory");
    if (chdir(c->plan->cwd) != 0)
        fail_errno(c);
    if (c->plan->tty) {
        set_step(c, "terminal");
        open_terminal(c);
    }
    set_step(c, "close file descriptors");
    /* Everything but 0, 1, 2 closes at exec; the error pipe stays usable until then. */
    if (sys_close_range(3, ~0U, CLOSE_RANGE_CLOEXEC) != 0)
        fail_call(c, "close_range", "3");
    set_step(c, "drop capabilities");
    if (!c->capabilities_dropped)
        drop_capabilities(c);
    set_step(c, "no_new_privs");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail_call(c, "prctl", "PR_SET_NO_NEW_PRIVS");
    set_step(c, "start init");
    start_init(c);  /* from here on, the command's process; pid 1 stays behind as its init */
    set_step(c, "seccomp");
    apply_seccomp(c);
    set_step(c, "exec");
    if (c->plan->trace)
        send_trace(c);
    execute(c);
}

void child_main(const struct plan *plan, const int *close_fds, int nclose)
{
    struct child c;
    memset(&c, 0, sizeof(c));
    c.plan = plan;
    c.step = "start";
    c.root_fd = -1;
    struct plan command;
    take_descriptors(&c, close_fds, nclose);
    build_sandbox(&c);
    if (plan->pooled)
        await_command(&c, &command);  /* c.plan is the command's from here on */
    finish_and_exec(&c);
}
