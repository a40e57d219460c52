"""Asynchronous rollouts: generator processes draw, score and evaluate; the trainer trains and pushes its weights.

[online] generator_mode = "local" or "remote" (docs/async.md). Two sides, one protocol:

1. **Rendezvous.** The generators' rank 0 serves a TCPStore at generator_host:generator_port (local mode without a
   port: one it binds itself and writes to the dump folder's generator/port); every trainer rank connects to it.
   The trainer's rank 0 claims the generators (`trainers`, a counter: a second trainer is refused rather than
   mixing its weights in) and writes a `Hello`: the policy's parameter names, shapes and dtypes, the
   data position to draw from, the weights' version, max_staleness. Each generator rank answers `ready/<rank>`
   with "" or the reason it cannot serve this trainer (another model: the first differing parameter).
2. **Weights** go over a process group of the trainer's rank 0 and the generator ranks (gloo on CPU, NCCL on GPU),
   made from the store, apart from the training groups. A push is a header [version, flags] and then the weights
   in buckets of at most 256 MiB, each one dtype, in the Hello's order; a DTensor is gathered whole first
   (`full_tensor`, every trainer rank at once, in the main thread, so training and push collectives never
   interleave). Where the generators' TP layout is the trainer's (TP alone, as many ranks), each trainer rank
   sends its own shards to its generator rank over a group of the two, with no gather. A generator receives into
   one staging copy on a thread of its own, so a push returns once the bytes are across; it loads the copy between
   batches, never inside a sequence.
3. **Batches.** Batch b is drawn with the weights of step max(b * num_iterations - max_staleness, v0), v0 the
   version the trainer started with: a fixed schedule, so draws depend on keys and weights alone, a resumed run
   draws what the uninterrupted one drew, and max_staleness = 0 draws what the colocated run draws. The generator
   sends each batch whole (`batch/<b>`, a pickled plugin.data.online.Drawn: ids, log-probs, rewards); every
   trainer rank reads it and cuts its own microbatches, as colocated ranks do after their gather.
4. **Evaluation** runs on the generator: a push flagged EVALUATE is evaluated with exactly those weights, and the
   metrics come back as `eval/<step>`.
5. **Faults.** Every wait of the trainer is bounded by generator_timeout and checks the generators' processes (local
   mode), their heartbeats and the error they left (`error`); a lost store is a lost generator. The message names
   the address and the rank. The generators stop at a STOP header, or when the trainer's heartbeat is older than
   generator_timeout (local mode: when the trainer's process is gone).
"""

import json
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from plugin import cpu
from plugin.model.parallelize import unwrapped_name
from plugin.runtime import internals

STOP, EVALUATE = 1, 2  # push header flags
BUCKET_BYTES = 256 << 20
POLL_S = 0.01
HEARTBEAT_S = 1.0


class GeneratorError(RuntimeError):
    """The generator processes failed, hung, or cannot serve this trainer."""


@dataclass
class Hello:
    signature: list  # (name, shape, dtype) of every weight pushed, in push order
    model: str  # [model] name/flavor, for messages
    start_batch: int  # the first batch to draw
    stream_pos: int  # the prompt stream's position there
    version: int  # the version of the first push
    max_staleness: int
    num_iterations: int
    total_batches: int  # batches the run trains on: none is drawn past them
    dp_world_size: int  # the trainer's: a batch is as many groups as its plan says
    trainer: str  # host and pid, for the generators' log
    shards: bool = False  # trainer TP rank i sends its own shards to generator rank i (the same TP layout)


def weight_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a push sends: the model's parameters and persistent buffers, a tied weight once, under the model's own
    names (the same on the trainer and the generator)."""
    seen, out = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((unwrapped_name(name), t))
    return out


def signature(entries) -> list[tuple[str, tuple, str]]:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in entries]


def local_signature(entries) -> list[tuple[str, tuple, str]]:
    """The signature of this rank's own part of each entry (a DTensor's local shard)."""
    return signature([(name, t.to_local() if isinstance(t, DTensor) else t) for name, t in entries])


def bucket_plan(sig) -> list[list[int]]:
    """Consecutive entries in buckets of one dtype and at most BUCKET_BYTES (a larger entry alone)."""
    buckets, size = [], 0
    for i, (_, shape, dtype) in enumerate(sig):
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if not buckets or sig[buckets[-1][-1]][2] != dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def push_group(store, rank: int, size: int, device: torch.device, timeout: float, pair: int | None = None):
    """The weights' process group, apart from training's: trainer rank 0 (rank 0 here) and the generator ranks; with
    shards, one group per pair of trainer TP rank `pair` (rank 0) and generator rank `pair` (rank 1)."""
    store = dist.PrefixStore("push" if pair is None else f"push/{pair}", store)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size, internals.nccl_options(timedelta(seconds=timeout)))
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))


def heartbeat(host: str, port: int, key: str, stop: threading.Event) -> None:
    """Set `key` in the generators' store to the time, every HEARTBEAT_S until `stop` (a daemon thread, on a
    connection of its own); ends quietly when the store is gone (the main thread names that at its next wait)."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
        while not stop.wait(HEARTBEAT_S):
            store.set(key, str(time.time()).encode())
    except (RuntimeError, OSError):
        return


def connect(host: str, port: int, timeout: float, check=lambda: None, what: str = "") -> dist.TCPStore:
    """A client of the generators' store at host:port, once it listens, within `timeout` seconds (`check` runs between
    tries: a dead local generator raises there; `what`: the limit a failure names, and its setting).

    A plain socket probes first: a connect to a local port nobody listens on yet can connect to itself (TCP's
    simultaneous open: the kernel may pick that very port as the source), and a TCPStore client then waits on its
    own echo for its whole timeout, as a trainer rank did in CI. A probe that finds itself is closed and retried
    (SO_REUSEADDR, so it never keeps the port from the store that is about to bind it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.settimeout(max(1.0, min(10.0, deadline - time.monotonic())))
                probe.connect(address)
                if probe.getsockname() == probe.getpeername():
                    raise ConnectionRefusedError(f"the connection to {host}:{port} reached itself, nobody listens yet")
            store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=max(1.0, min(30.0, deadline - time.monotonic()))))
            store.set_timeout(timedelta(seconds=timeout))
            return store
        except (RuntimeError, OSError) as e:  # not listening yet: the generators are still starting
            check()
            if time.monotonic() > deadline:
                raise GeneratorError(f"no generator answered at {host}:{port} within {what}: {e}") from None
            time.sleep(0.2)


def read_port(path: str, timeout: float, check=lambda: None) -> int:
    """The port a local generator's store bound (it writes `path` once it listens), within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        check()
        if time.monotonic() > deadline:
            raise GeneratorError(f"the local generator did not start its store within [online] generator_timeout = "
                                 f"{timeout:g} s (it writes its port to {path})")
        time.sleep(0.1)
    with open(path) as f:
        return int(f.read())


def write_port(path: str, port: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(path + ".tmp", path)  # whole or absent: a reader never sees half a number


def _child_env(job_config, port: int, trainer_pid: int) -> dict:
    """The generators' environment: none of the trainer's torchrun variables, and their placement."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    o = job_config.online
    env["PLUGIN_TRAINER_PID"] = str(trainer_pid)
    if o.generator_devices and not cpu.is_active():
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, o.generator_devices))
    elif o.generator_devices:
        env["PLUGIN_GENERATOR_CORES"] = ",".join(map(str, o.generator_devices))
        env["OMP_NUM_THREADS"] = str(max(1, len(o.generator_devices) // o.generator_tensor_parallel_size))
    return env


class LocalGenerators:
    """generator_mode = "local": the generator processes rank 0 starts on this machine, as the dataset is built, so
    they start up while the trainer builds its model and loads its checkpoint. Rank 0 holds the process; every rank
    learns the port when it connects (`TrainerLink`). Without generator_port the generators' store binds a port of
    the system's choosing and writes it to `port_file`: a port picked here and handed over would be free for a
    moment, for any other socket on the machine to take."""

    def __init__(self, job_config):
        o = job_config.online
        self.proc, self.port = None, o.generator_port
        self.port_file = os.path.join(job_config.job.dump_folder, "generator", "port")
        if dist.get_rank() == 0:
            self.proc = _spawn(job_config, self.port, self.port_file)
            # a trainer that fails before it connects (its model, its checkpoint) leaves no generator behind
            weakref.finalize(self, _kill, self.proc)
        if cpu.is_active() and o.generator_devices:  # the trainer ranks on the cores the generators leave
            _pin_trainer(o.generator_devices)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _spawn(job_config, port: int, port_file: str) -> subprocess.Popen:
    """Start the generator processes on this machine, given this job's whole config (a JSON file in the dump
    folder): one process, or a torchrun of generator_tensor_parallel_size (vLLM's launcher reads torchrun's
    variables, so with use_vllm always the latter)."""
    o = job_config.online
    folder = os.path.join(job_config.job.dump_folder, "generator")
    os.makedirs(folder, exist_ok=True)
    config = os.path.join(folder, "job_config.json")
    if os.path.exists(port_file):  # an earlier run's
        os.remove(port_file)
    with open(config, "w") as f:
        json.dump(asdict(job_config), f)
    launcher = ([] if o.generator_tensor_parallel_size == 1 and not o.use_vllm else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={o.generator_tensor_parallel_size}"])
    command = [sys.executable, *launcher, "-m", "plugin.generator", "--from-json", config, "--port", str(port),
               "--port-file", port_file]
    logger.info(f"Starting {o.generator_tensor_parallel_size} generator process(es) at 127.0.0.1:"
                f"{port or '(a port of their choosing)'}"
                + (f" on {'cores' if cpu.is_active() else 'GPUs'} {o.generator_devices}" if o.generator_devices else ""))
    return subprocess.Popen(command, env=_child_env(job_config, port, os.getpid()))


class TrainerLink:
    """The trainer's side: every trainer rank holds one (they all read the batches and gather the weights)."""

    def __init__(self, job_config, policy, parallel_dims, stats, local: LocalGenerators | None):
        o = job_config.online
        self.job_config, self.cfg, self.policy, self.stats = job_config, o, policy, stats
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lead = self.rank == 0
        self.device = next(policy.parameters()).device
        self.proc, self.group, self.pushed, self.start_version, self.total = None, None, -1, 0, 0
        port = o.generator_port
        if o.generator_mode == "local":
            self.proc, port = local.proc, local.port
            if not port:  # the generators chose it: rank 0 waits for it, then tells the others
                box = [read_port(local.port_file, o.generator_timeout, self._check_process) if self.lead else 0]
                dist.broadcast_object_list(box, src=0)
                port = box[0]
        # the engine's TP layout is the trainer's (TP alone over every rank, no EP): each rank sends its own shards
        self.shards = (self.world == o.generator_tensor_parallel_size > 1 and parallel_dims.tp == self.world
                       and not parallel_dims.ep_enabled)
        host = "127.0.0.1" if o.generator_mode == "local" else o.generator_host
        self.address = f"{host}:{port}"
        self.store = self._connect(host, port)
        self.alive = threading.Event()
        if self.lead:  # the generators stop when this stops: a trainer that died without closing
            threading.Thread(target=heartbeat, args=(host, port, "heartbeat/trainer", self.alive), daemon=True,
                             name="trainer-heartbeat").start()

    # -- set-up -------------------------------------------------------------------------------------------------

    def _connect(self, host: str, port: int):
        return connect(host, port, self.cfg.generator_timeout, self._check_process,
                       f"[online] generator_timeout = {self.cfg.generator_timeout:g} s ([online] generator_host / "
                       f"generator_port)")

    def start(self, fetched: int, stream_pos: int, held: dict, version: int, dp_world_size: int) -> tuple[int, int]:
        """Claim the generators and tell them where to draw from; batches a checkpoint `held` that are now too stale
        are dropped (counted) and drawn again. Returns the first batch the generators draw, and its stream position."""
        o, mu, k = self.cfg, self.cfg.num_iterations, self.cfg.max_staleness
        for index in sorted(held):
            if index * mu - held[index].version > k:  # a resume with a smaller max_staleness: draw again
                stale = sorted(i for i in held if i >= index)
                logger.warning(f"Batches {stale} of the checkpoint were drawn more than [online] max_staleness = {k} "
                               "versions before the steps that train them: dropped, drawn again")
                self.stats.record_stale(len(stale))
                fetched, stream_pos = index, held[index].stream_start
                for i in stale:
                    del held[i]
                break
        self.start_version, self.total = version, math.ceil(self.job_config.training.steps / mu)
        entries = weight_entries(self.policy)
        self.signature = signature(entries)
        self.buckets = bucket_plan(local_signature(entries) if self.shards else self.signature)
        if self.lead:
            if self._call(lambda: self.store.add("trainers", 1), "claiming them") != 1:
                raise GeneratorError(f"the generators at {self.address} already serve a trainer: start generators of "
                                     "their own for this run ([online] generator_host / generator_port)")
            model = f"[model] name = {self.job_config.model.name!r}, flavor = {self.job_config.model.flavor!r}"
            hello = Hello(self.signature, model, fetched, stream_pos, version, k, mu, self.total, dp_world_size,
                          f"{socket.gethostname()}:{os.getpid()}", self.shards)
            self.store.set("hello", pickle.dumps(hello))
            for r in range(o.generator_tensor_parallel_size):
                answer = self._wait(f"ready/{r}", "its start-up").decode()
                if answer:
                    self.store.set(f"heard/{r}", b"1")  # the generator may go now
                    raise GeneratorError(f"generator rank {r} at {self.address} cannot serve this run: {answer}")
            if not self.shards:
                self.group = push_group(self.store, 0, 1 + o.generator_tensor_parallel_size, self.device,
                                        o.generator_timeout)
        if self.shards:
            dist.barrier()  # the generators said yes to rank 0
            self.group = push_group(self.store, 0, 2, self.device, o.generator_timeout, pair=self.rank)
        logger.info(f"Generators at {self.address}: draw from batch {fetched} with the weights of step {version} on, "
                    f"at most {k} version(s) behind; weights sent "
                    + ("by each TP rank, its own shards" if self.shards else "whole, by rank 0"))
        return fetched, stream_pos

    # -- the steps ----------------------------------------------------------------------------------------------

    def push(self, version: int, evaluate: bool = False) -> None:
        """Send the policy's weights of `version` (optimizer steps); every trainer rank calls it (the gathers)."""
        if version == self.pushed and not evaluate:
            return
        start = time.perf_counter()
        entries = weight_entries(self.policy)
        nbytes, sends = 0, self.lead or self.shards
        if self.lead:
            self._announce()
        if sends:
            self._broadcast(torch.tensor([version, EVALUATE if evaluate else 0], dtype=torch.int64), "a push header")
        for bucket in self.buckets:
            parts = []
            for i in bucket:
                t = entries[i][1].detach()
                if isinstance(t, DTensor):  # a shard: this rank's own, or gathered whole (every rank at once)
                    t = t.to_local() if self.shards else t.full_tensor()
                parts.append(t.reshape(-1))
            if sends:
                flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
                nbytes += flat.numel() * flat.element_size()
                self._broadcast(flat, f"the weights of step {version}")
        self.pushed = version
        self.stats.record_push(time.perf_counter() - start, nbytes)

    def unrepeatable(self, fetched: int, version: int) -> list[int]:
        """Batches from `fetched` on that the generators draw with weights older than `version`."""
        mu, k = self.cfg.num_iterations, self.cfg.max_staleness
        out, index = [], fetched
        while index < self.total and max(index * mu - k, self.start_version) < version:
            out.append(index)
            index += 1
        return out

    def batch(self, index: int):
        """Batch `index`, as the generators drew it."""
        start = time.perf_counter()
        key = f"batch/{index}"
        drawn = pickle.loads(self._wait(key, f"batch {index}"))
        if self._call(lambda: self.store.add(f"read/{index}", 1), "a batch") == self.world:
            self.store.delete_key(key)  # every trainer rank has it
        lag = index * self.cfg.num_iterations - drawn.version
        if lag > self.cfg.max_staleness:  # the schedule makes this impossible: say so loudly rather than train on it
            raise GeneratorError(f"batch {index} from {self.address} was drawn by the weights of step {drawn.version}, "
                                 f"{lag} versions before the step that trains it ([online] max_staleness = "
                                 f"{self.cfg.max_staleness}): is another trainer's config serving them?")
        self.stats.record_async(lag, drawn.version, time.perf_counter() - start, drawn.idle_share)
        return drawn

    def evaluation(self, step: int) -> dict:
        """The generators' evaluation of the weights after `step` (pushed now)."""
        self.push(step, evaluate=True)
        return pickle.loads(self._wait(f"eval/{step}", f"the evaluation after step {step}"))

    def close(self) -> None:
        """Stop the generators (a STOP header), and with local mode wait for their processes."""
        self.alive.set()
        if (self.lead or self.shards) and self.group is not None and sys.exc_info()[1] is None:
            try:
                if self.lead:
                    self._announce()
                self._broadcast(torch.tensor([self.pushed, STOP], dtype=torch.int64), "the stop")
            except GeneratorError as e:
                logger.warning(f"{e}")
        if self.lead:
            try:
                self.store.set("stop", b"1")
            except (RuntimeError, OSError):
                pass  # the generators are gone already
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    # -- waiting, with every failure named -------------------------------------------------------------------

    def _check_process(self) -> None:
        if self.proc is not None and (code := self.proc.poll()) is not None:
            who = ("processes (their torchrun)" if self.cfg.generator_tensor_parallel_size > 1 or self.cfg.use_vllm
                   else "process (rank 0)")
            raise GeneratorError(f"the generator {who} at {self.address} exited with code {code} (their log is above)")

    def _call(self, fn, what: str):
        try:
            return fn()
        except (RuntimeError, OSError) as e:
            if self.proc is not None:  # a lost store is most often a generator that died: its exit code says how
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            self._check_process()
            raise GeneratorError(f"lost the generators at {self.address} (their rank 0 serves the store) while waiting "
                                 f"for {what}: {e}") from None

    def _wait(self, key: str, what: str) -> bytes:
        start = time.monotonic()
        while not self._call(lambda: self.store.check([key]), what):
            self._check_process()
            if self._call(lambda: self.store.check(["error"]), what):
                raise GeneratorError(f"the generators at {self.address} failed: {self.store.get('error').decode()}")
            if time.monotonic() - start > self.cfg.generator_timeout:
                raise GeneratorError(f"no {what} from the generators at {self.address} within [online] "
                                     f"generator_timeout = {self.cfg.generator_timeout:g} s{self._stale_ranks()}")
            time.sleep(POLL_S)
        return self._call(lambda: self.store.get(key), what)

    def _stale_ranks(self) -> str:
        now, stale = time.time(), []
        for r in range(self.cfg.generator_tensor_parallel_size):
            try:
                beat = float(self.store.get(f"heartbeat/{r}")) if self.store.check([f"heartbeat/{r}"]) else 0.0
            except (RuntimeError, OSError):
                beat = 0.0
            if now - beat > 10 * HEARTBEAT_S:
                stale.append(r)
        return (f": generator rank(s) {stale} stopped answering" if stale else
                ": every generator rank is alive, but none finished it (a hung tool call or reward function?)")

    def _announce(self) -> None:
        """A push is coming: the generators enter its broadcast only now, so none waits in a collective while we
        train (a step, a checkpoint may take longer than any collective's timeout)."""
        self._call(lambda: self.store.add("pushes", 1), "a push")

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            self.group.broadcast([tensor.to(self.device)], dist.BroadcastOptions()).wait()
        except (RuntimeError, OSError) as e:
            self._check_process()
            raise GeneratorError(f"sending {what} to the generators at {self.address} failed: {e}") from None


def _pin_trainer(generator_cores: list[int]) -> None:
    """On CPU, this trainer rank on its share of the cores the generators leave, its threads as many."""
    cores = [c for c in sorted(os.sched_getaffinity(0)) if c not in generator_cores]
    local, ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    mine = cores[local::ranks] if len(cores) >= ranks else cores
    if mine:
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))


def config_from_dict(data: dict):
    """The job config a local trainer wrote (`_spawn`): torchtitan's JobConfig merged with the plugin's sections."""
    from torchtitan.config import ConfigManager

    module = data["job"].get("custom_config_module") or "plugin.config"
    # the merged config class (parsed with the real assets folder, which torchtitan's check reads)
    cls = type(ConfigManager().parse_args(["--job.custom_config_module", module,
                                           "--model.hf_assets_path", data["model"]["hf_assets_path"]]))

    def build(kind, values):
        if not hasattr(kind, "__dataclass_fields__") or not isinstance(values, dict):
            return values
        fields = kind.__dataclass_fields__
        return kind(**{k: build(fields[k].type, v) for k, v in values.items() if k in fields})

    return build(cls, data)


@dataclass
class _Push:
    """A push a generator received: its weights wait in the staging copy."""

    version: int
    flags: int
