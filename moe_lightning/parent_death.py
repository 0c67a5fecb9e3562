"""Exec wrapper: arm the parent-death signal in the child, then become the real command.

Run by path with `python -S -I` (stdlib only, no site): `children.with_parent_death` puts it in front
of a service's argv. Arming it here rather than in a `preexec_fn` keeps Python code out of the
moment between fork and exec: a preexec_fn forces a plain fork() of a process whose gRPC threads
are live, and gRPC's fork handlers then aborted the child before it could exec (CI: a TP rank
"exited with code -6 during start-up"). Without a preexec_fn, subprocess uses vfork, which runs no
fork handlers. PR_SET_PDEATHSIG survives exec; it follows the thread that forked us.

argv: parent-pid signal command [args...]
"""

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main() -> None:
    parent, sig, command = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"parent_death: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}\n")
        os._exit(1)
    if os.getppid() != parent:  # the parent died before the signal was armed: it will never come
        os._exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
