"""GRPO for torchtitan: `[experimental] custom_import = "plugin"` registers grpo_llama3 and grpo_qwen3."""

import dataclasses

from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

from plugin import cpu

# before torchtitan reads its device type (custom_import runs first in Trainer.__init__)
cpu.activate()

from plugin.data.evaluation import build_grpo_evaluator  # noqa: E402
from plugin.data.loader import build_rollout_dataloader  # noqa: E402
from plugin.model.llama3 import llama3_family  # noqa: E402
from plugin.model.optimizer import build_grpo_optimizers  # noqa: E402
from plugin.model.parallelize import build_grpo_parallelize_fn  # noqa: E402
from plugin.model.policy import FAMILIES, grpo_model_cls  # noqa: E402
from plugin.model.qwen3 import qwen3_family  # noqa: E402
from plugin.runtime.metrics import build_grpo_metrics_processor  # noqa: E402
from plugin.scoring.loss import build_grpo_loss  # noqa: E402


def grpo_train_spec(base_name: str):
    """torchtitan's TrainSpec for `base_name` with only what GRPO changes swapped in."""
    base = get_train_spec(base_name)
    if base_name == "llama3":  # weight tying and the smollm2_135m flavor (plugin.model.llama3)
        base = dataclasses.replace(base, **llama3_family(base))
    if base_name == "qwen3":  # the debugmodel_small flavor (plugin.model.qwen3)
        base = dataclasses.replace(base, **qwen3_family(base))
    return dataclasses.replace(
        base,
        model_cls=grpo_model_cls(base.model_cls, base_name),
        parallelize_fn=build_grpo_parallelize_fn(base.parallelize_fn),
        pipelining_fn=None,
        build_optimizers_fn=build_grpo_optimizers,
        build_dataloader_fn=build_rollout_dataloader,
        build_loss_fn=build_grpo_loss,
        build_validator_fn=build_grpo_evaluator,  # [validation] runs the GRPO evaluation
        build_metrics_processor_fn=build_grpo_metrics_processor,
    )


for _name in FAMILIES:
    register_train_spec(f"grpo_{_name}", grpo_train_spec(_name))
