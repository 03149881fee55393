"""A warm parent for the CLI tests: imports what every ``python -m lit_amp_det`` run imports once, then forks
one child per command.

A fresh ``python -m lit_amp_det`` spends most of a smoke run importing torch, torchvision, Lightning (and
through it torchmetrics, scipy) and Hydra; the CLI tests start dozens. A forked child is still its own
process, with its own pid, signals, exit code, working directory, environment and output files, and it runs
``lit_amp_det.__main__`` exactly as ``python -m`` does; it only skips the imports. :func:`conftest.run_cli`
uses it for the commands that do not change a variable read at import time (under DDP: rank 0, which starts
the other ranks afresh from its command line), and a fresh process for the rest.

Protocol (one JSON object per line): the test sends ``{"argv", "cwd", "env", "stdout", "stderr"}`` on stdin;
this process answers ``{"pid": ...}`` at once and ``{"returncode": ...}`` (negative: killed by that signal)
when the child ends. It answers ``{"ready": true}`` once warm.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import traceback


def _warm() -> None:
    """The imports a CLI run makes before it does anything; nothing here starts a thread or runs an op."""
    import hydra  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401
    import torchvision  # noqa: F401

    import lit_amp_det.app.tasks  # noqa: F401
    import lit_amp_det.cli  # noqa: F401


def _child(request: dict, base_path: list[str]) -> None:
    """Becomes the command: its files, folder, environment and ``sys.path``; never returns."""
    code = 1
    try:
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *base_path]  # as ``python -m`` builds it
        sys.argv = ["-m", *request["argv"]]
        runpy.run_module("lit_amp_det", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # Python's own exit for an uncaught Ctrl-C: killed by SIGINT
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 -- reported as the interpreter would, exit code 1
        traceback.print_exc()
        code = 1
    _finish()
    os._exit(code)


def _finish() -> None:
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream has nothing to flush
                stream.flush()


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed while warming goes to stderr, not into the protocol
    base_path = sys.path[1:]  # without this file's folder
    _warm()
    channel.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            _child(request, base_path)
        channel.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        channel.write(json.dumps({"returncode": returncode}) + "\n")


if __name__ == "__main__":
    main()
