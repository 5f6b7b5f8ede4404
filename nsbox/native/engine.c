/* The launch engine (engine.h has the protocol): one epoll loop, many launches at once.
 *
 * Each launch: its cgroup made and its limits written, two pipes, the clone (clone3 into the
 * cgroup on v2, clone(2) elsewhere) running the native core's child (child.c), the id maps
 * (user_namespaces(7)), the attach to the v1 cgroups, the release; then the pidfd watched
 * (pidfd_open(2)), the deadline and the CPU time checked, a kill on request or when the caller
 * is gone; the reap, the usage, the report, the cgroup removed. Whatever one request holds that
 * is wrong (a malformed message, too many descriptors, EMFILE, a dead caller) fails that launch
 * alone: the engine goes on. It runs as its host's user, root included, so every length from a
 * message is checked (engine_msg.c) and every descriptor is close-on-exec.
 */
#define _GNU_SOURCE
#include "engine.h"

#include "child.h"
#include "plan.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#define CLONE_INTO_CGROUP_ 0x200000000ULL
#define NAMESPACES (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC \
                    | CLONE_NEWUTS | CLONE_NEWCGROUP)

#define MAX_LAUNCHES 1024
#define ERR_KEEP 50000          /* the error pipe's last bytes kept (the report is at most
                                 * REPORT_MAX, child.h, and the status line comes after it) */
#define REPORT_LIMIT 65536      /* the datagram the host reads (nsbox/host/output.py) */
#define CPU_POLL_NS 50000000LL  /* as nsbox/policy/limits.py, RunLimits.poll_interval */
#define REMOVE_FOR_NS 10000000000LL  /* a cgroup still busy after this is left to reclaim */
#define CONTROL_TAG 0xffffffffffffffffULL

struct launch {
    unsigned gen;
    int sock, pidfd, err_fd, mnt_ns;
    int sync_fd;  /* held while the engine lives: its hang-up tells the child (child.c) */
    pid_t pid;
    long long started_ns, deadline_ns, cpu_limit_ns, next_poll_ns, remove_until_ns;
    int timed_out, cpu_exceeded, removing;
    char kill_reason[40];
    int failed;
    char fail_step[32];
    int fail_errno;
    char fail_message[512];
    char err_data[ERR_KEEP];
    size_t err_len;
    struct engine_cgroup cg;
};

static struct launch *launches[MAX_LAUNCHES];
static int control_fd = 3;
static int epoll_fd = -1;
static unsigned next_gen = 1;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void close_fd(int *fd)
{
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

static void send_all(int sock, const char *s, size_t n, int fd)
{
    /* MSG_NOSIGNAL: a caller that is gone costs no SIGPIPE (send(2)). */
    struct iovec iov = {(void *)s, n};
    struct msghdr msg = {0};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
        memset(&control, 0, sizeof(control));
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof(control.buf);
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    }
    if (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0)
        return;  /* the caller is gone; the launch ends all the same */
}

/* {"event": "exit", "setup_error": {step, errno, message}} to a caller whose launch never
 * started. */
static void refuse(int sock, const char *step, int err, const char *message)
{
    static struct json_out o;
    if (sock < 0)
        return;
    json_init(&o, -1);
    json_put_raw(&o, "{\"event\": \"exit\", \"setup_error\": ");
    format_report(&o, step, err, message);
    json_put_raw(&o, "}");
    send_all(sock, o.s, o.n, -1);
}

static void watch(int fd, struct launch *l, int slot, int kind)
{
    struct epoll_event ev = {0};
    ev.events = EPOLLIN;
    ev.data.u64 = ((uint64_t)l->gen << 32) | ((uint64_t)slot << 2) | (uint64_t)kind;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0 && l->failed == 0) {
        l->failed = 1;
        snprintf(l->fail_step, sizeof(l->fail_step), "watch the sandbox");
        l->fail_errno = errno;
        snprintf(l->fail_message, sizeof(l->fail_message), "%s", strerror(errno));
    }
}

static void unwatch(int *fd)
{
    if (*fd >= 0)
        epoll_ctl(epoll_fd, EPOLL_CTL_DEL, *fd, NULL);
    close_fd(fd);
}

static void kill_launch(struct launch *l, const char *reason)
{
    /* SIGKILL to the pid namespace's init kills every process in it (pid_namespaces(7)); by
     * its pidfd, which names this process and no later one (pidfd_send_signal(2)). */
    if (l->kill_reason[0] != '\0' || l->pidfd < 0)
        return;
    snprintf(l->kill_reason, sizeof(l->kill_reason), "%s", reason);
    syscall(SYS_pidfd_send_signal, l->pidfd, SIGKILL, NULL, 0);
}

static void fail_launch(struct launch *l, const char *step, int err, const char *message)
{
    if (!l->failed) {
        l->failed = 1;
        snprintf(l->fail_step, sizeof(l->fail_step), "%s", step);
        l->fail_errno = err;
        snprintf(l->fail_message, sizeof(l->fail_message), "%s", message);
    }
    kill_launch(l, "setup failed");
}

/* --- the start of a launch ------------------------------------------------------------- */

struct start {
    const struct engine_request *req;
    int sock;
    const int *fds;  /* stdin, stdout, stderr, bind sources */
    int nfds;
};

static int write_text(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = strlen(text);
    ssize_t n = write(fd, text, len);
    int err = errno;
    close(fd);
    errno = n < 0 ? err : (size_t)n == len ? 0 : EIO;
    return n >= 0 && (size_t)n == len ? 0 : -1;
}

/* The id maps of the child ``pid`` (user_namespaces(7): an unprivileged writer denies
 * setgroups first), then its pid into the v1 cgroups' cgroup.procs: before the release, so
 * nothing of the sandbox runs outside its cgroup. 0, or -1 with ``step`` set. */
static int settle_child(const struct engine_request *req, pid_t pid, int born,
                        const char **step)
{
    char path[64], value[32];
    *step = "write id maps";
    if (req->deny_setgroups) {
        snprintf(path, sizeof(path), "/proc/%d/setgroups", (int)pid);
        if (write_text(path, "deny") != 0)
            return -1;
    }
    snprintf(path, sizeof(path), "/proc/%d/uid_map", (int)pid);
    if (write_text(path, req->uid_map) != 0)
        return -1;
    snprintf(path, sizeof(path), "/proc/%d/gid_map", (int)pid);
    if (write_text(path, req->gid_map) != 0)
        return -1;
    *step = "attach to cgroup";
    snprintf(value, sizeof(value), "%d", (int)pid);
    for (int i = 0; i < req->nprocs && !born; i++) {
        if (write_text(req->procs[i], value) != 0)
            return -1;
    }
    return 0;
}

struct clone_args_v2 {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};

/* clone(2) without a new stack, or clone3(2) into the cgroup ``cgroup_fd``: 0 in the child.
 * A raw clone: this process has one thread, and the child calls only what child.h allows. */
static long clone_sandbox(int cgroup_fd)
{
    if (cgroup_fd < 0)
        return syscall(SYS_clone, (unsigned long)(NAMESPACES | SIGCHLD), 0, 0, 0, 0);
    struct clone_args_v2 args;
    memset(&args, 0, sizeof(args));
    args.flags = (uint64_t)NAMESPACES | CLONE_INTO_CGROUP_;
    args.exit_signal = SIGCHLD;
    args.cgroup = (uint64_t)cgroup_fd;
    return syscall(SYS_clone3, &args, sizeof(args));
}

/* Every descriptor of the engine a new child must not hold (other launches' sockets and
 * pipes, the control socket): closed first thing in the child (child_main). */
static int engine_fds(int *out, int max, const int *also, int nalso)
{
    int n = 0;
    out[n++] = control_fd;
    out[n++] = epoll_fd;
    for (int i = 0; i < nalso; i++)
        out[n++] = also[i];
    for (int i = 0; i < MAX_LAUNCHES && n + 5 <= max; i++) {
        struct launch *l = launches[i];
        if (l == NULL)
            continue;
        const int mine[] = {l->sock, l->pidfd, l->err_fd, l->mnt_ns, l->sync_fd};
        for (int k = 0; k < 5; k++) {
            if (mine[k] >= 0)
                out[n++] = mine[k];
        }
    }
    return n;
}

static int free_slot(void)
{
    for (int i = 0; i < MAX_LAUNCHES; i++) {
        if (launches[i] == NULL)
            return i;
    }
    return -1;
}

/* Clone the child of ``s`` with its pipes; the launch is watched from here on. */
/* The spawner of ``sp`` clones the sandbox of ``plan`` (its flat bytes) with the descriptors
 * ``table`` (spawner.c: "pid N" or "error E MESSAGE" back), and exits: the child's pid, or
 * -1 with errno and ``message`` set. */
static long spawn_in_spare(struct taken_spare *sp, const char *plan, size_t len,
                           const int *table, int ntable, char *message, size_t size)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * (5 + ENGINE_MAX_SOURCES))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {(void *)plan, len};
    struct msghdr msg = {0};
    char reply[512];
    long pid = -1;
    memset(&control, 0, sizeof(control));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)ntable);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)ntable);
    memcpy(CMSG_DATA(cmsg), table, sizeof(int) * (size_t)ntable);
    snprintf(message, size, "the spawner went away");
    errno = ECHILD;
    struct pollfd pfd = {sp->sock, POLLIN, 0};
    if (sendmsg(sp->sock, &msg, MSG_NOSIGNAL) >= 0 && poll(&pfd, 1, 10000) == 1) {
        ssize_t n = recv(sp->sock, reply, sizeof(reply) - 1, 0);
        reply[n > 0 ? n : 0] = '\0';
        char *end = NULL;
        if (strncmp(reply, "pid ", 4) == 0) {
            pid = strtol(reply + 4, &end, 10);
            if (end == reply + 4 || *end != '\0' || pid <= 0)
                pid = -1;
        } else if (strncmp(reply, "error ", 6) == 0) {
            long err = strtol(reply + 6, &end, 10);
            errno = err > 0 && err < 4096 ? (int)err : EIO;
            snprintf(message, size, "%s", *end == ' ' ? end + 1 : reply);
        }
    }
    int err = errno;
    if (pid < 0)
        kill(sp->pid, SIGKILL);
    waitpid(sp->pid, NULL, 0);  /* it exits once it has cloned */
    close(sp->sock);
    sp->sock = -1;
    errno = err;
    return pid;
}

static void start_child(struct launch *l, int slot, const struct start *s, struct plan *plan,
                        int sync_w, int cgroup_fd, struct taken_spare *sp, const int *table,
                        int ntable)
{
    static int close_list[5 * MAX_LAUNCHES + 8];
    const int own[] = {sync_w, l->err_fd, s->sock};
    int nclose = engine_fds(close_list, (int)(sizeof(close_list) / sizeof(close_list[0])),
                            own, 3);
    char message[512];
    l->started_ns = now_ns();
    long pid;
    if (sp != NULL) {
        pid = spawn_in_spare(sp, s->req->plan, s->req->plan_len, table, ntable, message,
                             sizeof(message));
    } else {
        pid = clone_sandbox(cgroup_fd);
        if (pid == 0)
            child_main(plan, close_list, nclose);
        snprintf(message, sizeof(message), "%s", strerror(errno));
    }
    if (pid < 0) {
        refuse(s->sock, "create namespaces", errno, message);
        return;
    }
    l->pid = (pid_t)pid;
    l->sock = s->sock;
    launches[slot] = l;
    l->pidfd = (int)syscall(SYS_pidfd_open, l->pid, 0);
    if (l->pidfd >= 0)
        watch(l->pidfd, l, slot, 0);
    if (l->pidfd < 0 || l->failed) {
        /* Not watched, so never reaped by the loop: ended here (not reaped yet, the pid is
         * still this child's). */
        int err = errno;
        kill(l->pid, SIGKILL);
        waitpid(l->pid, NULL, 0);
        close_fd(&l->pidfd);
        launches[slot] = NULL;
        refuse(s->sock, "watch the sandbox", err, strerror(err));
        return;
    }
    /* pidfds are close-on-exec (pidfd_open(2)). The mount namespace held until the report
     * is out: its teardown then does not delay the reap (nsbox/helper/loop.py). */
    char ns[64];
    snprintf(ns, sizeof(ns), "/proc/%d/ns/mnt", (int)l->pid);
    l->mnt_ns = open(ns, O_RDONLY | O_CLOEXEC);
    watch(l->err_fd, l, slot, 1);
    watch(l->sock, l, slot, 2);
    const char *step = NULL;
    if (!l->failed && settle_child(s->req, l->pid, sp != NULL, &step) != 0) {
        fail_launch(l, step, errno, strerror(errno));
    }
    /* The spawner has left the run's cgroup: what it was charged is not the run's. */
    for (int i = 0; sp != NULL && i < s->req->nresets && !l->failed; i++) {
        if (write_text(s->req->resets[i].path, s->req->resets[i].value) != 0)
            fail_launch(l, "attach to cgroup", errno, strerror(errno));
    }
    if (!l->failed) {
        if (write(sync_w, "1", 1) != 1)
            fail_launch(l, "release", errno, strerror(errno));
    }
    if (!l->failed) {
        if (s->req->wall_us >= 0)
            l->deadline_ns = l->started_ns + s->req->wall_us * 1000LL;
        char msg[64];
        int n = snprintf(msg, sizeof(msg), "{\"event\": \"pid\", \"pid\": %d}", (int)l->pid);
        send_all(l->sock, msg, (size_t)n, l->pidfd);
    }
}

/* The run's cgroup: a spare's (its directories exist, its spawner waits in them) with the
 * limits written, or new directories. 0, or -1 refused. */
static int make_cgroup(struct launch *l, const struct start *s, int spared)
{
    char what[ENGINE_PATH_MAX + 128];
    struct engine_request limits = *s->req;
    if (spared)
        limits.ndirs = 0;  /* made already */
    if (cgroup_keep(&l->cg, s->req) != 0) {
        refuse(s->sock, "engine", ENOMEM, strerror(ENOMEM));
        return -1;
    }
    if (cgroup_create(&limits, what, sizeof(what)) != 0) {
        int err = errno;
        char message[sizeof(what) + 64];
        snprintf(message, sizeof(message), "%s: %s", what, strerror(err));
        refuse(s->sock, "create cgroup", err, message);
        if (spared)
            cgroup_remove(&l->cg);  /* its spawner is gone: empty */
        return -1;
    }
    return 0;
}

static void run_request(struct launch *l, int slot, const struct start *s,
                        struct taken_spare *sp)
{
    const struct engine_request *req = s->req;
    int sync[2] = {-1, -1}, errp[2] = {-1, -1}, cgroup_fd = -1;
    if (pipe2(sync, O_CLOEXEC) != 0 || pipe2(errp, O_CLOEXEC) != 0) {
        refuse(s->sock, "create pipes", errno, strerror(errno));
        goto undo;
    }
    if (req->clone_dir[0] != '\0') {
        cgroup_fd = open(req->clone_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (cgroup_fd < 0) {
            refuse(s->sock, "create cgroup", errno, strerror(errno));
            goto undo;
        }
    }
    int table[5 + ENGINE_MAX_SOURCES];
    for (int i = 0; i < 3; i++)
        table[i] = s->fds[i];
    table[3] = sync[0];
    table[4] = errp[1];
    for (int i = 0; i < req->nsources; i++)
        table[5 + i] = s->fds[3 + i];
    struct plan plan;
    const char *why = NULL;
    if (plan_parse(&plan, req->plan, req->plan_len, table, (size_t)(5 + req->nsources),
                   &why) != 0) {
        refuse(s->sock, "engine", 0, why);
        goto undo;
    }
    l->err_fd = errp[0];
    errp[0] = -1;
    l->sync_fd = sync[1];
    sync[1] = -1;
    start_child(l, slot, s, &plan, l->sync_fd, cgroup_fd, sp, table, 5 + req->nsources);
    sp = NULL;  /* its spawner is reaped */
    plan_free(&plan);
    if (launches[slot] == l)
        goto done;  /* started (or failed after the clone: reported at the reap) */
undo:
    close_fd(&l->err_fd);
    close_fd(&l->sync_fd);
    if (sp != NULL) {
        kill(sp->pid, SIGKILL);
        waitpid(sp->pid, NULL, 0);
        close(sp->sock);
    }
    cgroup_kill_all(&l->cg);
    cgroup_remove(&l->cg);
    cgroup_free(&l->cg);
    free(l);
done:
    close_fd(&sync[0]);
    close_fd(&sync[1]);
    close_fd(&errp[0]);
    close_fd(&errp[1]);
    close_fd(&cgroup_fd);
}

static void start_launch(const struct start *s)
{
    const struct engine_request *req = s->req;
    int slot = free_slot();
    if (slot < 0) {
        refuse(s->sock, "engine", EAGAIN, "the launch engine runs its most launches at once");
        return;
    }
    if (s->nfds != 3 + req->nsources) {
        refuse(s->sock, "engine", 0, "the launch request's descriptors do not match its plan");
        return;
    }
    struct launch *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        refuse(s->sock, "engine", ENOMEM, strerror(ENOMEM));
        return;
    }
    l->gen = next_gen++;
    l->sock = l->pidfd = l->err_fd = l->mnt_ns = l->sync_fd = -1;
    l->cpu_limit_ns = req->cpu_ns;
    /* On v1, a spare's cgroups and spawner when one is ready: the child is born there. */
    static struct engine_request moved;
    struct taken_spare spare;
    struct start use = *s;
    int spared = spare_take(req, &spare) == 0;
    if (spared && spare_paths(req, spare.name, &moved) != 0) {
        spare_abandon(&spare);
        spared = 0;
    }
    if (spared)
        use.req = &moved;
    if (make_cgroup(l, &use, spared) != 0) {
        if (spared)
            spare_abandon(&spare);
        cgroup_free(&l->cg);
        free(l);
        return;
    }
    run_request(l, slot, &use, spared ? &spare : NULL);
    spares_refill(req);  /* the next launch's, while this one runs */
}

/* --- the control socket ------------------------------------------------------------------ */

static void end_everything(void) __attribute__((noreturn));

static void on_control(void)
{
    static char buf[MESSAGE_MAX + 1];
    int fds[RECEIVE_MAX_FDS];
    int nfds = 0;
    ssize_t n = receive_with_fds(control_fd, buf, MESSAGE_MAX, fds, RECEIVE_MAX_FDS, &nfds);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n < 0 && errno != EMSGSIZE && errno != EMFILE && errno != ENFILE && errno != ENOMEM)
        end_everything();  /* the host is gone (ECONNRESET) */
    if (n < 0)
        return;  /* this request is lost; its launch socket closed: its caller sees EOF */
    if (n == 0 && nfds == 0)
        end_everything();
    buf[n] = '\0';
    const char *msg = buf;
    size_t len = (size_t)n;
    void *map = NULL;
    int sock = nfds > 0 ? fds[0] : -1;
    if (nfds > 1 && strncmp(buf, MEMFD_TAG, strlen(MEMFD_TAG)) == 0) {
        int memfd = fds[--nfds];
        msg = map_memfd_message(buf, memfd, &len);
        if (msg == NULL) {
            refuse(sock, "engine", errno, "the launch request did not arrive whole");
            close(memfd);
            goto done;
        }
        map = (void *)msg;
    }
    struct engine_request req;
    const char *why = NULL;
    if (sock < 0) {
        /* Nobody to answer: dropped. */
    } else if (engine_parse(&req, msg, len, &why) != 0) {
        refuse(sock, "engine", 0, why);
    } else {
        struct start s = {&req, sock, fds + 1, nfds - 1};
        start_launch(&s);
        for (int i = 0; i < MAX_LAUNCHES; i++) {
            if (launches[i] != NULL && launches[i]->sock == sock)
                sock = -1;  /* the launch's own now */
        }
    }
done:
    if (map != NULL)
        munmap(map, len);
    if (sock >= 0)
        close(sock);
    for (int i = 1; i < nfds; i++)
        close(fds[i]);
}

/* --- supervision ------------------------------------------------------------------------- */

static void read_errors(struct launch *l, int to_end)
{
    char chunk[4096];
    while (l->err_fd >= 0) {
        ssize_t n = read(l->err_fd, chunk, sizeof(chunk));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            if (n < 0 && errno == EAGAIN)
                return;
            unwatch(&l->err_fd);
            return;
        }
        /* Only the last ERR_KEEP bytes are reported: the status and the error come last. */
        if (l->err_len + (size_t)n > sizeof(l->err_data)) {
            size_t drop = l->err_len + (size_t)n - sizeof(l->err_data);
            if (drop > l->err_len)
                drop = l->err_len;
            memmove(l->err_data, l->err_data + drop, l->err_len - drop);
            l->err_len -= drop;
        }
        size_t take = (size_t)n > sizeof(l->err_data) ? sizeof(l->err_data) : (size_t)n;
        memcpy(l->err_data + l->err_len, chunk + (size_t)n - take, take);
        l->err_len += take;
        if (!to_end)
            return;
    }
}

static void on_request(struct launch *l)
{
    char buf[512];
    ssize_t n = recv(l->sock, buf, sizeof(buf) - 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        epoll_ctl(epoll_fd, EPOLL_CTL_DEL, l->sock, NULL);
        kill_launch(l, "caller gone");
        return;
    }
    buf[n] = '\0';
    /* The host's own message: {"cmd": "kill", "reason": R} (nsbox/host/output.py). */
    const char *cmd = strstr(buf, "\"cmd\": \"kill\"");
    const char *reason = strstr(buf, "\"reason\": \"");
    if (buf[0] != '{' || cmd == NULL) {
        fail_launch(l, "request", 0,
                    "the launch engine got a malformed message from the host");
        return;
    }
    char word[32] = "killed";
    if (reason != NULL) {
        reason += strlen("\"reason\": \"");
        size_t i = 0;
        for (; i < sizeof(word) - 1 && ((reason[i] >= 'a' && reason[i] <= 'z')
                                        || reason[i] == ' '); i++)
            word[i] = reason[i];
        word[i] = '\0';
    }
    kill_launch(l, word);
}

/* The length of the UTF-8 character at ``p`` (at most ``n`` bytes), 0 when it is not one
 * (RFC 3629, section 4: no overlong forms, no surrogates, nothing past U+10FFFF). */
static size_t utf8_char(const unsigned char *p, size_t n)
{
    size_t len = p[0] >= 0xF0 ? 4 : p[0] >= 0xE0 ? 3 : p[0] >= 0xC2 ? 2 : 0;
    if (p[0] > 0xF4 || len == 0 || len > n)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    }
    if ((p[0] == 0xE0 && p[1] < 0xA0) || (p[0] == 0xED && p[1] > 0x9F)
        || (p[0] == 0xF0 && p[1] < 0x90) || (p[0] == 0xF4 && p[1] > 0x8F))
        return 0;
    return len;
}

/* The error pipe's bytes as the contents of a JSON string (RFC 8259, section 7), into
 * ``out`` (``room`` bytes): its length, or 0 when it does not fit. A byte that is not part of
 * a UTF-8 character is written as \u00XX (the host reads it back as that code point). */
static size_t escape_child(char *out, size_t room, const unsigned char *p, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    size_t at = 0;
    for (size_t i = 0; i < n;) {
        char piece[8];
        size_t len = 0, take = 1;
        unsigned char c = p[i];
        if (c == '"' || c == '\\') {
            piece[len++] = '\\';
            piece[len++] = (char)c;
        } else if (c == '\n') {
            piece[len++] = '\\';
            piece[len++] = 'n';
        } else if (c < 0x20 || c == 0x7f || (c >= 0x80 && utf8_char(p + i, n - i) == 0)) {
            memcpy(piece, "\\u00", 4);
            piece[4] = hex[c >> 4];
            piece[5] = hex[c & 15];
            len = 6;
        } else if (c >= 0x80) {
            take = utf8_char(p + i, n - i);
            memcpy(piece, p + i, take);
            len = take;
        } else {
            piece[len++] = (char)c;
        }
        if (at + len > room)
            return 0;
        memcpy(out + at, piece, len);
        at += len;
        i += take;
    }
    return at;
}

static void put_usage(struct json_out *o, const struct launch *l)
{
    json_put_raw(o, ", \"usage\": {");
    for (int i = 0; i < l->cg.nusage; i++) {
        long long value;
        if (i > 0)
            json_put_raw(o, ", ");
        json_put_raw(o, "\"");
        json_put_raw(o, l->cg.usage[i].name);  /* [a-z_], engine_parse checked */
        json_put_raw(o, "\": ");
        if (read_number(l->cg.usage[i].path, l->cg.usage[i].key, &value) == 0)
            json_put_int(o, value);
        else
            json_put_raw(o, "null");
    }
    json_put_raw(o, "}");
}

static void report(struct launch *l, int status, const struct rusage *ru, long long wall_ns)
{
    static struct json_out o;
    json_init(&o, -1);
    json_put_raw(&o, "{\"event\": \"exit\", \"engine\": 1, \"init_status\": ");
    json_put_int(&o, status);
    json_put_raw(&o, ", \"wall_ns\": ");
    json_put_int(&o, wall_ns);
    json_put_raw(&o, ", \"utime_us\": ");
    json_put_int(&o, (long long)ru->ru_utime.tv_sec * 1000000LL + ru->ru_utime.tv_usec);
    json_put_raw(&o, ", \"stime_us\": ");
    json_put_int(&o, (long long)ru->ru_stime.tv_sec * 1000000LL + ru->ru_stime.tv_usec);
    json_put_raw(&o, ", \"maxrss_kib\": ");
    json_put_int(&o, ru->ru_maxrss);
    json_put_raw(&o, l->timed_out ? ", \"timed_out\": true" : ", \"timed_out\": false");
    json_put_raw(&o, l->cpu_exceeded ? ", \"cpu_time_exceeded\": true"
                                     : ", \"cpu_time_exceeded\": false");
    json_put_raw(&o, ", \"kill_reason\": ");
    if (l->kill_reason[0] != '\0')
        json_put_string(&o, l->kill_reason);
    else
        json_put_raw(&o, "null");
    json_put_raw(&o, ", \"internal_error\": ");
    if (l->failed)
        format_report(&o, l->fail_step, l->fail_errno, l->fail_message);
    else
        json_put_raw(&o, "null");
    put_usage(&o, l);
    json_put_raw(&o, ", \"child\": \"");
    /* The error pipe's bytes, as many of its last lines as fit in one datagram the host
     * reads whole (REPORT_MAX of a child's report, escaped again, always does). */
    static char child[REPORT_LIMIT];
    const char *from = l->err_data;
    size_t left = l->err_len, n = 0;
    while (left > 0 && (n = escape_child(child, sizeof(child) - o.n - 2,
                                         (const unsigned char *)from, left)) == 0) {
        const char *nl = memchr(from, '\n', left);
        size_t skip = nl == NULL ? left : (size_t)(nl + 1 - from);
        from += skip;
        left -= skip;
    }
    struct iovec parts[3] = {{o.s, o.n}, {child, n}, {(void *)"\"}", 2}};
    struct msghdr msg = {0};
    msg.msg_iov = parts;
    msg.msg_iovlen = 3;
    sendmsg(l->sock, &msg, MSG_NOSIGNAL);  /* a caller that is gone: the launch ends anyway */
}

static void release_slot(int slot)
{
    struct launch *l = launches[slot];
    cgroup_free(&l->cg);
    free(l);
    launches[slot] = NULL;
}

static void reap(int slot)
{
    struct launch *l = launches[slot];
    int status = 0;
    struct rusage ru;
    memset(&ru, 0, sizeof(ru));
    pid_t got;
    do {
        got = wait4(l->pid, &status, 0, &ru);
    } while (got < 0 && errno == EINTR);
    long long wall = now_ns() - l->started_ns;
    if (got < 0)
        fail_launch(l, "reap", errno, strerror(errno));
    unwatch(&l->pidfd);
    read_errors(l, 1);
    /* What outlived the main process (daemons, orphans) is killed first, so that the usage
     * read next is final (nsbox/policy/limits.py, RunLimits.finish). */
    cgroup_kill_all(&l->cg);
    report(l, status, &ru, wall);
    unwatch(&l->err_fd);
    close_fd(&l->mnt_ns);  /* the sandbox's mounts are torn down now */
    close_fd(&l->sync_fd);
    /* The cgroup goes before the launch's socket closes: the host's run ends at that EOF, and
     * its caller may count on the cgroup being gone (a cancelled arun, nsbox/aio.py). One still
     * busy is retried after the close, so the host never waits for it. */
    int busy = cgroup_remove(&l->cg) == 1;
    unwatch(&l->sock);
    if (busy) {
        l->removing = 1;
        l->remove_until_ns = now_ns() + REMOVE_FOR_NS;
        return;
    }
    release_slot(slot);
}

static void check_limits(long long now)
{
    for (int i = 0; i < MAX_LAUNCHES; i++) {
        struct launch *l = launches[i];
        if (l == NULL)
            continue;
        if (l->removing) {
            if (cgroup_remove(&l->cg) != 1 || now >= l->remove_until_ns)
                release_slot(i);  /* one left behind is reclaimed by name (nsbox/cgroups) */
            continue;
        }
        if (l->deadline_ns > 0 && now >= l->deadline_ns) {
            l->timed_out = 1;
            l->deadline_ns = 0;
            kill_launch(l, "timeout");
        }
        if (l->cpu_limit_ns >= 0 && l->cg.cpu_path[0] != '\0' && now >= l->next_poll_ns) {
            long long used;
            l->next_poll_ns = now + CPU_POLL_NS;
            if (!l->cpu_exceeded && read_number(l->cg.cpu_path, l->cg.cpu_key, &used) == 0
                && used >= l->cpu_limit_ns / l->cg.cpu_scale) {
                l->cpu_exceeded = 1;
                cgroup_kill_all(&l->cg);
                kill_launch(l, "cpu time");
            }
        }
    }
}

static int next_timeout_ms(long long now)
{
    long long next = -1;
    for (int i = 0; i < MAX_LAUNCHES; i++) {
        const struct launch *l = launches[i];
        if (l == NULL)
            continue;
        long long at[3] = {l->deadline_ns > 0 ? l->deadline_ns : -1,
                           l->cpu_limit_ns >= 0 && l->cg.cpu_path[0] ? l->next_poll_ns : -1,
                           l->removing ? now + 2000000LL : -1};
        for (int k = 0; k < 3; k++) {
            if (at[k] >= 0 && (next < 0 || at[k] < next))
                next = at[k];
        }
    }
    if (next < 0)
        return -1;
    long long ms = (next - now + 999999) / 1000000;
    /* epoll_wait(2) takes an int of milliseconds: a long deadline in several waits. */
    return ms < 0 ? 0 : ms > 3600000 ? 3600000 : (int)ms;
}

static void end_everything(void)
{
    /* The host is gone: every sandbox is killed, reaped and its cgroup removed. */
    spares_drop_all();
    for (int i = 0; i < MAX_LAUNCHES; i++) {
        struct launch *l = launches[i];
        if (l == NULL)
            continue;
        if (!l->removing) {
            kill_launch(l, "launcher gone");
            waitpid(l->pid, NULL, 0);
            cgroup_kill_all(&l->cg);
        }
        for (int round = 0; round < 1000 && cgroup_remove(&l->cg) == 1; round++) {
            struct timespec pause = {0, 5000000};
            nanosleep(&pause, NULL);
        }
    }
    _exit(0);
}

static void dispatch(uint64_t tag)
{
    if (tag == CONTROL_TAG) {
        on_control();
        return;
    }
    int slot = (int)((tag >> 2) & 0x3fffffff);
    int kind = (int)(tag & 3);
    if (slot >= MAX_LAUNCHES || launches[slot] == NULL
        || launches[slot]->gen != (unsigned)(tag >> 32))
        return;  /* an earlier event of this batch ended that launch */
    struct launch *l = launches[slot];
    if (kind == 0)
        reap(slot);
    else if (kind == 1)
        read_errors(l, 0);
    else if (l->sock >= 0)
        on_request(l);
}

static void settle_process(void)
{
    /* Descriptors the host leaked without close-on-exec end here; the standard streams are
     * /dev/null (each sandbox gets its own with its request). */
    sys_close_range(4, ~0U, 0);
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
        for (int std = 0; std < 3; std++)
            dup2(null, std);  /* dup2 clears close-on-exec on the copy (dup(2)) */
        if (null > 2)
            close(null);
    }
    fcntl(control_fd, F_SETFD, FD_CLOEXEC);
    /* The terminal's ^C is for the host program, which decides when sandboxes end; a caller
     * gone is an EPIPE, not a signal. The child puts both back (the plan's ignored_signals). */
    signal(SIGINT, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    /* No supplementary group of root's may reach a sandbox; EPERM for anyone else, whose
     * groups the sandbox does not get either (setgroups is denied in its user namespace). */
    if (setgroups(0, NULL) != 0 && errno != EPERM) {
        perror("nsbox-engine: setgroups");
        _exit(1);
    }
    prctl(PR_SET_NAME, "nsbox-engine", 0, 0, 0);
}

int main(int argc, char **argv)
{
    if (argc != 2 || strcmp(argv[1], "3") != 0) {
        fprintf(stderr, "nsbox-engine: started by nsbox itself (nsbox/host/engine.py)\n");
        return 2;
    }
    settle_process();
    epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd < 0)
        return 1;
    struct epoll_event ev = {0};
    ev.events = EPOLLIN;
    ev.data.u64 = CONTROL_TAG;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, control_fd, &ev) != 0)
        return 1;
    for (;;) {
        struct epoll_event events[64];
        int n = epoll_wait(epoll_fd, events, 64, next_timeout_ms(now_ns()));
        if (n < 0 && errno != EINTR)
            return 1;
        for (int i = 0; i < n; i++)
            dispatch(events[i].data.u64);
        check_limits(now_ns());
    }
}
