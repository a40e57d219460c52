"""What a measurement in this process stands on, for the benchmarks and the tests alike: the bundled
config, the model as torchtitan's Trainer builds it, and a memory meter.

The benchmarks import it from their own folder (a script's folder is first on its sys.path); the
tests through pytest's `pythonpath` setting (pyproject.toml). torchtitan and the plugin are imported
when first used, so a launcher can import this before it needs them.
"""

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/debug_cpu.toml"  # the main job; relative to REPO
# overrides of the bundled config (TP=2, FSDP on the rest) for a model on one rank
ONE_RANK = ("--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "1")


def parse_config(*overrides: str):
    """The bundled config merged with plugin.config's sections, as torchtitan parses it."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(REPO / CONFIG), *overrides])


def build_model(*overrides: str, parallel_dims=None, device="cpu", n_layers: int | None = None):
    """The model of the bundled config (with `overrides`) in this process, built as torchtitan's Trainer builds it:
    meta init, the TrainSpec's parallelize function, to_empty, init_weights (seed 0).

    Returns (model, job_config, parallel_dims, train_spec); one rank unless `parallel_dims` says otherwise.
    `n_layers` cuts the flavor's depth (a real model's width and vocabulary at a fraction of its cost).
    """
    import copy

    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    import plugin  # noqa: F401  registers the GRPO TrainSpecs

    cfg = parse_config(*overrides)
    pd = parallel_dims or ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    spec = get_train_spec(cfg.model.name)
    # a copy: update_from_config must not change the registered flavor for the next build
    model_args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    model_args.update_from_config(cfg)
    if n_layers is not None:
        model_args.n_layers = n_layers
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model = spec.parallelize_fn(model, pd, cfg)
    model.to_empty(device=device)
    torch.manual_seed(0)  # the same weights on every rank and in every run
    with torch.no_grad():
        model.init_weights()
    return model, cfg, pd, spec


class Memory:
    """This process's memory as the training loop reports it: allocated memory on CUDA, RSS on CPU (plugin.cpu)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def reset(self) -> int:
        """Start a new peak; returns the memory held now."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        from plugin import cpu

        # without the reset the peak would be the whole process's: no figure rather than a wrong one
        if not cpu.reset_peak_rss():
            raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs refused)")
        return cpu.current_rss_bytes()

    def peak(self) -> int:
        """The highest memory since the last reset (synchronizes on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from plugin import cpu

        return cpu.peak_rss_bytes()
