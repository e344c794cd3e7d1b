"""What a worker sees, written to $PROBE_OUT/<rank>.json, to compare a worker forked from the
zygote (--preload) with a fresh interpreter's (test_preload_parity.py). Warning filters are
read after `import torch`: a forked worker has torch imported already, and with it the filters
torch and numpy add at import."""

import json
import multiprocessing as mp
import os
import pickle
import resource
import signal
import stat
import sys
import warnings

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGCHLD", "SIGUSR1", "SIGALRM")
LIMITS = [n for n in dir(resource) if n.startswith("RLIMIT_")]


class Thing:
    pass


def square(x):
    return x * x


def fd_kind(fd):
    try:
        st = os.fstat(fd)
    except OSError as e:
        return f"error {e.errno}"
    kinds = {stat.S_ISFIFO: "fifo", stat.S_ISCHR: "chr", stat.S_ISREG: "reg", stat.S_ISSOCK: "sock"}
    kind = next((name for test, name in kinds.items() if test(st.st_mode)), "other")
    return f"{kind} blocking={os.get_blocking(fd)}"


def proc_list(name):
    with open(f"/proc/self/{name}", "rb") as f:
        return [item.decode() for item in f.read().split(b"\0") if item]


if __name__ == "__main__":
    out = {
        "name": __name__,
        "argv": sys.argv,
        "path": sys.path,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "signals": {n: repr(signal.getsignal(getattr(signal, n))) for n in SIGNALS},
        "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in LIMITS},
        "own_pgrp": os.getpgid(0) == os.getpid(),
        "fds": {i: fd_kind(i) for i in (0, 1, 2)},
        "umask": os.umask(0o22),
        "pickled_main": pickle.loads(pickle.dumps(Thing())).__class__.__module__,
        "main_file": getattr(sys.modules["__main__"], "__file__", None),
        "spec": repr(getattr(sys.modules["__main__"], "__spec__", None)),
        "flags": repr(sys.flags),
        "stdout_line_buffering": sys.stdout.line_buffering,
        "excepthook": getattr(sys.excepthook, "__qualname__", repr(sys.excepthook)),
        "threads": __import__("threading").active_count(),
        # What ps, pgrep -f and other tools read from outside the process.
        "proc_cmdline": proc_list("cmdline"),
        "proc_environ": sorted(proc_list("environ")),
    }
    with mp.get_context("spawn").Pool(1) as p:
        out["spawn"] = p.map(square, [3])
    with mp.get_context("fork").Pool(1) as p:
        out["fork"] = p.map(square, [4])
    import torch
    from torch.utils.data import DataLoader

    out["torch_threads"] = torch.get_num_threads()
    out["warnings"] = [repr(f) for f in warnings.filters]
    out["loader"] = [int(b.sum()) for b in DataLoader(list(range(8)), batch_size=4, num_workers=2)]
    path = os.path.join(os.environ["PROBE_OUT"], f"{os.environ['RANK']}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
