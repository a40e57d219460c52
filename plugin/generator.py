"""The generator processes of asynchronous rollouts: draw, score and evaluate with the weights the trainer pushes.

On one machine the trainer starts them itself ([online] generator_mode = "local"). On a cluster
(generator_mode = "remote") start them first, on their own devices, with the run's config:

    torchrun --nproc_per_node T -m plugin.generator --job.config_file X.toml --online.generator_port 29600

T is [online] generator_tensor_parallel_size: one engine, tensor-parallel over the T processes. They serve one
trainer and exit when it stops. The protocol is plugin.generation.remote's; docs/async.md has the placement.
"""

import importlib
import json
import math
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools import utils
from torchtitan.tools.logging import init_logger, logger

from plugin.generation.remote import (EVALUATE, HEARTBEAT_S, POLL_S, STOP, Hello, _Push, bucket_plan, connect,
                                      config_from_dict, heartbeat, local_signature, push_group, read_port,
                                      signature, weight_entries, write_port)


class _Captured:
    """The evaluator's metrics processor on a generator: it keeps what would be logged, for the trainer."""

    def __init__(self):
        self.logger, self.logged = self, {}

    def log(self, metrics: dict, step: int) -> None:
        self.logged[step] = metrics


class Generator:
    def __init__(self, job_config, port: int, port_file: str | None = None):
        self.job_config, o = job_config, job_config.online
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cores := os.environ.get("PLUGIN_GENERATOR_CORES"):  # local mode on CPU: the cores the trainer gave us
            mine = [int(c) for c in cores.split(",")][local::self.world]
            os.sched_setaffinity(0, mine)
            torch.set_num_threads(len(mine))
        self.device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.timeout = o.generator_timeout
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if self.rank else "127.0.0.1"
        timeout = max(self.timeout, 60)
        if self.rank == 0:  # port 0 (local mode): a port of the system's choosing, told through port_file
            self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout))
            port = self.store.port
            if port_file:
                write_port(port_file, port)
        else:
            port = port or read_port(port_file, timeout)
            self.store = connect(host, port, timeout, what=f"{timeout:g} s (the generators' rank 0's store)")
        self.address = f"{o.generator_host}:{port}"
        self.trainer_pid = int(os.environ.get("PLUGIN_TRAINER_PID", 0))  # local mode: the trainer's rank 0
        self.failed: BaseException | None = None  # the receiving thread's error
        self.done = threading.Event()
        threading.Thread(target=heartbeat, args=(host, port, f"heartbeat/{self.rank}", self.done), daemon=True,
                         name="generator-heartbeat").start()

    # -- start-up -----------------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            logger.info(f"Generator rank {self.rank} of {self.world}: waiting for a trainer at {self.address}")
            hello: Hello = pickle.loads(self._wait_key("hello"))
            problem = self._build(hello)
            self.store.set(f"ready/{self.rank}", problem.encode())
            if problem:  # kept serving the store until the trainer has read why
                logger.error(problem)
                deadline = time.monotonic() + self.timeout
                while not self.store.check([f"heard/{self.rank}"]) and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                return
            if hello.shards:  # trainer TP rank r sends this rank its own shards
                self.group = push_group(self.store, 1, 2, self.device, self.timeout, pair=self.rank)
            else:
                self.group = push_group(self.store, 1 + self.rank, 1 + self.world, self.device, self.timeout)
            self._loop(hello)
        except Exception:
            text = traceback.format_exc()
            logger.error(text)
            try:
                self.store.set("error", f"generator rank {self.rank}: {text}".encode())
            except (RuntimeError, OSError):
                pass
            raise
        finally:
            self.done.set()

    def _build(self, hello: Hello) -> str:
        """The engine's model (its own world: TP over the generator ranks), the online dataset and the evaluator;
        "" or why this generator cannot serve the trainer."""
        c = self.job_config
        if c.online.generator_tensor_parallel_size != self.world:
            return (f"[online] generator_tensor_parallel_size = {c.online.generator_tensor_parallel_size}, but "
                    f"{self.world} generator processes were started (torchrun --nproc_per_node)")
        p = c.parallelism  # the generator's layout: TP over its ranks, nothing else
        p.tensor_parallel_degree, p.data_parallel_shard_degree, p.data_parallel_replicate_degree = self.world, 1, 1
        p.expert_parallel_degree, p.expert_tensor_parallel_degree = 1, 1
        c.online.generator_mode, c.online.max_staleness = "colocate", 0  # it samples where it runs
        c.grpo.beta = 0.0  # no reference to build
        c.checkpoint.enable = False
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if "MASTER_ADDR" in os.environ:
                dist.init_process_group(backend, timeout=timedelta(seconds=max(self.timeout, 60)))
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        from plugin.data.evaluation import build_grpo_evaluator
        from plugin.job import GRPOJob

        job = GRPOJob.of(c)
        parallel_dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=self.world, pp=1, ep=1, etp=1,
                                     world_size=self.world)
        spec = get_train_spec(c.model.name)
        tokenizer = spec.build_tokenizer_fn(c)
        args = spec.model_args[c.model.flavor]
        args.update_from_config(c)
        with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[c.training.dtype]):
            model = spec.model_cls(args)
        model = spec.parallelize_fn(model, parallel_dims, c)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()  # as the trainer's policy samples
        self.model, self.entries = model, weight_entries(model)
        mine = signature(self.entries)
        if mine != hello.signature:
            diff = next((f"the trainer's {a} is this generator's {b}" for a, b in zip(hello.signature, mine) if a != b),
                        f"{len(hello.signature)} weights in the trainer, {len(mine)} here")
            return (f"it was built for another model than the trainer's {hello.model}: {diff} (start the generators "
                    "with the trainer's config)")
        self.shards = hello.shards
        sent = local_signature(self.entries) if self.shards else mine  # what a push holds: shards, or whole tensors
        self.buckets = bucket_plan(sent)
        self.buffers = [torch.empty(sum(math.prod(sent[i][1]) for i in b), dtype=getattr(torch, sent[b[0]][2]),
                                    device=self.device) for b in self.buckets]
        loader = spec.build_dataloader_fn(dp_world_size=hello.dp_world_size, dp_rank=0, tokenizer=tokenizer,
                                          job_config=c)
        self.dataset = loader.dataset
        self.dataset.policy, self.dataset.job = model, job
        job.policy, job.parallel_dims = model, parallel_dims
        self.dataset.stream_pos = hello.stream_pos
        self.evaluator, self.captured = None, _Captured()
        if c.validation.enable:
            self.evaluator = build_grpo_evaluator(c, hello.dp_world_size, 0, tokenizer, parallel_dims, self.captured)
            self.evaluator.dp_world_size = 1  # its count is the trainer's; every prompt is drawn here
        logger.info(f"Generator rank {self.rank}: serving the trainer {hello.trainer} from batch {hello.start_batch}, "
                    f"at most {hello.max_staleness} version(s) behind")
        return ""

    # -- the loop -----------------------------------------------------------------------------------------------

    def _loop(self, hello: Hello) -> None:
        """Draw every batch whose weights are here; else load the next push (evaluating it when flagged)."""
        staged: queue.Queue = queue.Queue(1)
        free = threading.Event()
        free.set()
        threading.Thread(target=self._receive, args=(staged, free), daemon=True, name="generator-receive").start()
        K = self.dataset.plan.groups_per_step
        mu, k, index, version = hello.num_iterations, hello.max_staleness, hello.start_batch, -1
        idle, since = 0.0, time.perf_counter()
        while True:
            if version >= 0 and index < hello.total_batches and max(index * mu - k, hello.version) <= version:
                drawn = self.dataset.draw(index, list(range(K)))
                now = time.perf_counter()
                drawn.version, drawn.idle_share, idle, since = version, idle / max(now - since, 1e-9), 0.0, now
                if self.rank == 0:
                    self.store.set(f"batch/{index}", pickle.dumps(drawn))
                index += 1
                continue
            start = time.perf_counter()
            push = self._next(staged)
            idle += time.perf_counter() - start
            if push.flags & STOP:
                logger.info(f"Generator rank {self.rank}: the trainer stopped; {index} batches drawn")
                return
            self._load()
            free.set()
            version = push.version
            if push.flags & EVALUATE:
                self.evaluator.validate([self.model], version)
                if self.rank == 0:
                    self.store.set(f"eval/{version}", pickle.dumps(self.captured.logged.pop(version)))

    def _next(self, staged: queue.Queue) -> _Push:
        """The next push, waiting while the trainer lives."""
        while True:
            try:
                return staged.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                pass
            if self.failed is not None:
                raise self.failed
            self._check_trainer()

    def _check_trainer(self) -> None:
        if self.store.check(["stop"]):
            raise SystemExit(0)
        if self.trainer_pid:
            try:
                os.kill(self.trainer_pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"the trainer (process {self.trainer_pid}) is gone") from None
        elif self.store.check(["heartbeat/trainer"]):
            age = time.time() - float(self.store.get("heartbeat/trainer"))
            if age > self.timeout:
                raise RuntimeError(f"the trainer's heartbeat stopped {age:.0f} s ago ([online] generator_timeout)")

    def _receive(self, staged: queue.Queue, free: threading.Event) -> None:
        """The pushes, in order, into the one staging copy (a thread: the trainer's push returns while we draw)."""
        try:
            seen = 0
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
            while True:
                while self.store.add("pushes", 0) <= seen:  # announced first: no collective waits on a long step
                    if self.done.is_set():
                        return
                    time.sleep(POLL_S)
                seen += 1
                free.wait()
                free.clear()
                self.group.broadcast([header], dist.BroadcastOptions()).wait()
                version, flags = header.tolist()
                if not flags & STOP:
                    for buf in self.buffers:
                        self.group.broadcast([buf], dist.BroadcastOptions()).wait()
                staged.put(_Push(version, flags))
                if flags & STOP:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            self.failed = e

    @torch.no_grad()
    def _load(self) -> None:
        """The staged weights into the engine's model (a TP shard: this rank's part of the whole tensor); with
        use_vllm, the engine reloads them from the model before its next generation (its weights_version moved)."""
        self.model.weights_version = getattr(self.model, "weights_version", 0) + 1
        for bucket, buf in zip(self.buckets, self.buffers):
            offset = 0
            for i in bucket:
                t = self.entries[i][1]
                if self.shards and isinstance(t, DTensor):  # our own shard, as the trainer's TP rank holds it
                    t = t.to_local()
                n = t.numel()
                whole = buf[offset:offset + n].view(t.shape)
                offset += n
                if isinstance(t, DTensor):
                    t.to_local().copy_(distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local())
                else:
                    t.copy_(whole)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _wait_key(self, key: str) -> bytes:
        """A key the trainer writes, while the trainer lives (remote generators wait for one to come)."""
        while not self.store.check([key]):
            self._check_trainer()
            time.sleep(0.05)
        return self.store.get(key)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    init_logger()
    if argv[:1] == ["--from-json"]:  # started by a local trainer: its whole config
        with open(argv[1]) as f:
            job_config = config_from_dict(json.load(f))
        port = int(argv[argv.index("--port") + 1])
        port_file = argv[argv.index("--port-file") + 1] if "--port-file" in argv else None
    else:
        job_config = ConfigManager().parse_args(argv)
        port, port_file = job_config.online.generator_port, None
        if not port:
            raise ValueError("[online] generator_port = 0: give the generators a port (--online.generator_port)")
    importlib.import_module(job_config.experimental.custom_import or "plugin")
    code = 0
    try:
        Generator(job_config, port, port_file).run()
    except SystemExit:
        pass
    except Exception:  # logged and left for the trainer by run()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # daemon threads may sit in a store call or a collective: no teardown to wait on


if __name__ == "__main__":
    main()
