/* Calls syscalls by number inside the sandbox and prints what the kernel answered.
 *
 *   seccomp_probe NAME:NR[:ARG...] ...   one line per call: "NAME RESULT ERRNO"
 *   seccomp_probe int80                  getpid through the 32-bit int 0x80 entry
 *   seccomp_probe x32                    getpid with __X32_SYSCALL_BIT set
 *   seccomp_probe tiocsti                push "X" into the terminal on stdin with TIOCSTI,
 *                                        plain and with the upper 32 bits of the request set
 *   seccomp_probe ptrace-child           PTRACE_ATTACH to a child of its own, then detach
 *   seccomp_probe vm-read PID            process_vm_readv of 8 bytes from PID
 *
 * Numbers are parsed with strtoull(base 0), so 0x5412 and 0xffffffff00005412 work.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static int call(char *spec) {
    unsigned long long a[7] = {0};
    char *name = strtok(spec, ":");
    int n = 0;
    for (char *tok; n < 7 && (tok = strtok(NULL, ":")) != NULL; n++)
        a[n] = strtoull(tok, NULL, 0);
    if (name == NULL || n == 0) {
        fprintf(stderr, "bad spec\n");
        return 2;
    }
    errno = 0;
    long r = syscall((long)a[0], a[1], a[2], a[3], a[4], a[5], a[6]);
    int e = r < 0 ? errno : 0;
    if (r == 0 && (strcmp(name, "clone") == 0 || strncmp(name, "clone_", 6) == 0)) {
        _exit(0); /* a clone the filter let through: the copy must not go on probing */
    }
    printf("%s %ld %d\n", name, r, e);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "int80") == 0) {
#if defined(__x86_64__)
        long r;
        __asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "memory"); /* i386 getpid */
        printf("int80 %ld\n", r);
        return 0;
#else
        return 3;
#endif
    }
    if (argc == 2 && strcmp(argv[1], "x32") == 0) {
        long r = syscall(0x40000000L | SYS_getpid);
        printf("x32 %ld %d\n", r, r < 0 ? errno : 0);
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "tiocsti") == 0) {
        char c = 'X';
        unsigned long requests[] = {TIOCSTI, 0x100000000UL | TIOCSTI,
                                    0xffffffff00000000UL | TIOCSTI};
        for (int i = 0; i < 3; i++) {
            errno = 0;
            long r = syscall(SYS_ioctl, 0, requests[i], &c);
            printf("tiocsti_%d %ld %d\n", i, r, r < 0 ? errno : 0);
        }
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "ptrace-child") == 0) {
        pid_t child = fork();
        if (child == 0) {
            pause();
            _exit(0);
        }
        long r = ptrace(PTRACE_ATTACH, child, 0, 0);
        int e = r < 0 ? errno : 0;
        int status = 0;
        if (r == 0) {
            waitpid(child, &status, 0);
            ptrace(PTRACE_DETACH, child, 0, 0);
        }
        printf("ptrace_attach %ld %d\n", r, e);
        printf("ptrace_stopped %d 0\n", r == 0 && WIFSTOPPED(status));
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "vm-read") == 0) {
        char here[8], *there = here;
        struct iovec local = {here, sizeof here}, remote = {there, sizeof here};
        errno = 0;
        long r = syscall(SYS_process_vm_readv, atoi(argv[2]), &local, 1, &remote, 1, 0);
        printf("process_vm_readv %ld %d\n", r, r < 0 ? errno : 0);
        return 0;
    }
    for (int i = 1; i < argc; i++)
        if (call(argv[i]) != 0)
            return 2;
    return 0;
}
