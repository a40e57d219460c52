"""How a benchmark job ended: ok, OOM, or an error, as the launchers record it instead of aborting.

A worker process that fails writes a one-line JSON report (`write_report`) and, when it ran out of
memory, exits with OOM_EXIT; the launcher runs each job in its own process group (`run_job`) and
turns the exit status, the reports and the output into a status (`classify`); `read_scalars` gives
what a torchtitan job logged to TensorBoard; `worker_pids` and `proc_status` find a running torchrun
job's workers and read their memory through /proc. Standard library only at import (tensorboard is
imported when read), so the launchers can use it before torch is imported and the tests can load it on its own.
"""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

OK, OOM, TIMEOUT, SKIPPED = "ok", "OOM", "timeout", "skipped"
OOM_EXIT = 75  # a worker that ran out of memory exits with this after writing its report
# SIGKILL as subprocess reports it, and as a shell reports it (128 + 9): the kernel's OOM killer
KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)
OOM_TEXT = ("out of memory", "defaultcpuallocator: can't allocate memory")
# torchrun's failure summary names each failed rank's exit code; a rank the OOM killer took shows -9
_KILLED_RANK = re.compile(r"exitcode\s*:\s*(-9|137)\b")
_OOM_IN_OUTPUT = re.compile(r"OutOfMemoryError|out of memory|DefaultCPUAllocator: can't allocate memory", re.I)
# an exception's last line, also as torchrun prefixes a rank's output ("[rank0]: ValueError: ...")
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:)?\s*([\w.]*(?:Error|Exception|Interrupt)\b.*)$", re.M)
_ANY_ERROR = re.compile(r"^.*\b\w*Error\b.*$", re.M)
SIMULATE_ENV = "BENCH_SIMULATE_OOM"


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), MemoryError, or a RuntimeError that says it ran out of memory."""
    if isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in OOM_TEXT)


def _last_line(text: str, limit: int = 200) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def write_report(path: str | Path, exc: BaseException) -> bool:
    """Record this process's failure at `path`; True if it was an OOM."""
    oom = is_oom(exc)
    detail = _last_line(f"{type(exc).__name__}: {exc}")
    Path(path).write_text(json.dumps({"status": OOM if oom else "error", "detail": detail}))
    return oom


def read_reports(paths) -> list[dict]:
    """The reports that exist among `paths` (a rank killed before it could write has none)."""
    return [json.loads(Path(p).read_text()) for p in paths if Path(p).exists()]


def classify(returncode: int | None, output: str = "", reports=()) -> tuple[str, str]:
    """(status, detail) of a finished job: 'ok', 'OOM', 'timeout' (returncode None) or 'error: <last line>'."""
    if returncode is None:
        return TIMEOUT, ""
    for r in reports:
        if r.get("status") == OOM:
            return OOM, r.get("detail", "")
    if returncode in KILLED or _KILLED_RANK.search(output):
        return OOM, "killed by SIGKILL, as the kernel's OOM killer kills"
    if returncode == 0:
        return OK, ""
    m = _OOM_IN_OUTPUT.search(output)
    if returncode == OOM_EXIT or (m and not reports):
        # an OOM outside the worker's handler, e.g. while a rank was still starting up
        line = output[output.rfind("\n", 0, m.start()) + 1:].split("\n", 1)[0] if m else ""
        return OOM, line.strip()[:200]
    if reports:
        detail = reports[0].get("detail", "")
    else:
        # torchrun's own ChildFailedError only says that a rank failed; the rank's error is more telling
        named = [e for e in _ERROR_LINE.findall(output) if "ChildFailedError" not in e]
        named = named or [e for e in _ANY_ERROR.findall(output) if "ChildFailedError" not in e]
        detail = (named or [_last_line(output) or f"exit {returncode}"])[-1].strip()[:200]
    return f"error: {detail}", detail


def run_job(cmd: list[str], *, env=None, cwd=None, timeout: float | None = None) -> tuple[int | None, str]:
    """Run cmd in its own process group; (exit status, or None if it timed out, and its stdout + stderr).

    On a timeout the whole group is killed: torchrun's ranks must not outlive it holding device memory.
    """
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def simulated_oom(spec: str | None, name: str, pass_: str | None = None) -> str | None:
    """How the job `name` (and `pass_`) should fake an OOM under `spec`: 'raise', 'kill' or None.

    `spec` is a comma list of NAME[:PASS][:kill]; 'raise' throws torch.OutOfMemoryError, 'kill'
    SIGKILLs the process as the kernel's OOM killer would.
    """
    for item in filter(None, (spec or "").split(",")):
        parts = item.strip().split(":")
        mode = "kill" if parts[-1] == "kill" else "raise"
        parts = parts[:-1] if mode == "kill" else parts
        if parts[0] == name and (len(parts) == 1 or parts[1] == pass_):
            return mode
    return None


def fake_oom(mode: str, where: str) -> None:
    """Fail the way a real OOM does: raise torch.OutOfMemoryError, or be SIGKILLed."""
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    import torch

    raise torch.OutOfMemoryError(f"simulated: out of memory at the start of {where} ({SIMULATE_ENV} / --simulate-oom)")


def read_scalars(dump: Path) -> dict[int, dict[str, float]]:
    """step -> tag -> value from the TensorBoard events of a torchtitan dump folder (every launch in it,
    later ones winning); {} without events or without the tensorboard package."""
    runs = sorted((Path(dump) / "tb").glob("*")) if (Path(dump) / "tb").exists() else []
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    steps: dict[int, dict[str, float]] = {}
    for run in runs:
        acc = EventAccumulator(str(run))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                steps.setdefault(e.step, {})[tag] = e.value
    return steps


def proc_stats() -> dict[int, list[str]]:
    """Every live process's /proc/<pid>/stat fields after its name: [state, ppid, ...]."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone since the listing
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        out[int(entry)] = stat[stat.rfind(")") + 2 :].split()
    return out


def children(pid: int) -> list[int]:
    """Direct children of `pid` (a scan of /proc/*/stat: /proc/<pid>/task/*/children needs CONFIG_PROC_CHILDREN)."""
    return [p for p, fields in proc_stats().items() if int(fields[1]) == pid]


def worker_pids(torchrun_pid: int, variable: str = "RANK") -> dict[int, int]:
    """{rank: pid} of the torchrun job's workers started so far, each rank read from its environment's
    `variable` (RANK, or LOCAL_RANK)."""
    workers = {}
    for pid in children(torchrun_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if variable.encode() in env:
            workers[int(env[variable.encode()])] = pid
    return workers


def proc_status(pid: int, fields) -> dict[str, int] | None:
    """The `fields` of /proc/<pid>/status (e.g. VmRSS, VmHWM) that it has, in bytes; None if the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in fields:
                    out[key] = int(rest.split()[0]) * 1024  # kB
    except (FileNotFoundError, ProcessLookupError):
        return None
    return out
