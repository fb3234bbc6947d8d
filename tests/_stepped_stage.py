"""Stage runs that stop before each filesystem step, forked from a server that has paid for
torch and coremltools once (seconds a process; the fixture stages' work itself is quicker).

    python tests/_stepped_stage.py              # the server; then, per run, on its stdin:
    {"argv": ["bundle", "m.cmf", "-o", "/abs/out"], "watch": "/abs"}

For each request the server forks a child, which writes `pid N` and runs
`pipeline.cli.main(argv)`; once the child is gone the server writes `exit S` (S its exit
status, negative for a signal). Before each filesystem step of the child (an open, mkdir,
rename, removal or copy) on a path in or under `watch`, an audit hook writes
`step EVENT PATH...` and waits for the line `go`: the test looks at the disk as a kill at that
instant would leave it, then answers, or SIGKILLs the child's process group (the stage and
its workers) there. Steps come in the order the stage takes them, so a step names one instant
of the write however loaded the machine is. The child's own stdout goes to /dev/null.
"""

import json
import os
import sys
import traceback

STEPS = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "os.link", "os.symlink",
         "os.chmod", "os.utime", "shutil.copyfile", "shutil.copytree", "shutil.rmtree"}


def _line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            os._exit(3)  # the test went away
        data += byte
    return data.decode().rstrip("\n")


def _say(fd: int, text: str) -> None:
    os.write(fd, (text + "\n").encode())


def _child(argv: list[str], watch: str) -> int:
    from pipeline.cli import main

    ask, answer = os.dup(1), os.dup(0)
    _say(ask, f"pid {os.getpid()}")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    paused = False

    def hook(event, args):
        nonlocal paused
        if paused or event not in STEPS:
            return
        # A name relative to a directory fd (rmtree's inner steps) is not under `watch` here.
        paths = [os.path.abspath(os.fsdecode(a)) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        if not any(p == watch or p.startswith(watch + os.sep) for p in paths):
            return
        paused = True
        try:
            _say(ask, "step " + "\t".join([event, *paths]))
            if _line(answer) != "go":
                os._exit(4)
        finally:
            paused = False

    sys.addaudithook(hook)
    try:
        return main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve() -> None:
    from pipeline.cli import quiet_third_party

    quiet_third_party()  # before the imports below, as `main` would do it
    import coremltools  # noqa: F401
    import torch  # noqa: F401

    while True:
        request = json.loads(_line(0))
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # a group of its own, so a kill takes the stage's workers with it
            code = 1
            try:
                code = _child(request["argv"], request["watch"])
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        _say(1, f"exit {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    serve()
