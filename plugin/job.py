"""What the GRPO builders of one job share: built once, with the job's checks, and handed to each.

torchtitan 0.2.2's Trainer calls the TrainSpec's builders one after another, giving each the
job's config and none of the others' results, and it builds the dataloader before the model.
So what they share is one `GRPOJob`, made by the first builder that asks for it
(`GRPOJob.of(job_config)`, which runs plugin.config.validate_job once) and kept on that config:

| field          | set by                               | read by                                              |
|----------------|--------------------------------------|------------------------------------------------------|
| stats          | GRPOJob                              | the policy (its configure), the loss, the metrics processor |
| online_stats   | the online dataset's builder         | the metrics processor                                |
| policy, parallel_dims | the parallelize function      | the online dataset, which samples from the policy    |
| vllm           | the first [online] use_vllm sampler  | training's and evaluation's samplers; the metrics processor closes it |
| kv_pool        | the first built-in sampler           | training's and evaluation's samplers: one KV cache for the run |
| reward_models  | the first reward list naming a folder | training's and evaluation's reward lists: one copy per folder |
| remote         | the online dataset, with a separate generator | evaluation (the generators evaluate); the metrics processor closes it |

The optimizer builder gets the policy from torchtitan and its reference and stats from it.
"""

from plugin.config import validate_job
from plugin.runtime.stats import GRPOStats, OnlineStats

_ATTRIBUTE = "grpo_job"  # its name on the job's config object


class GRPOJob:
    def __init__(self, job_config):
        validate_job(job_config)
        self.stats = GRPOStats(job_config.grpo.on_nonfinite)
        self.online_stats: OnlineStats | None = None
        self.policy = None  # the parallelized policy, once built
        self.parallel_dims = None
        self.vllm = None  # [online] use_vllm: this rank's engine (plugin.generation.vllm), built at the first generation
        self.kv_pool = None  # the built-in engine's KV cache (plugin.generation.engine.KVPool), made with its sampler
        self.reward_models = {}  # folder -> plugin.model.reward_model.RewardModel, built at its first scoring
        self.remote = None  # [online] generator_mode: the link to the generators (plugin.generation.remote)

    def reward_model(self, folder: str, key: str, job_config):
        """The job's reward model of `folder` (checked now, built at its first scoring), made at the first call."""
        if folder not in self.reward_models:
            from plugin.model.reward_model import RewardModel

            self.reward_models[folder] = RewardModel(folder, key, job_config)
        return self.reward_models[folder]

    @staticmethod
    def of(job_config) -> "GRPOJob":
        """The job's GRPOJob, made at the first call for this config object."""
        job = getattr(job_config, _ATTRIBUTE, None)
        if job is None:
            job = GRPOJob(job_config)
            setattr(job_config, _ATTRIBUTE, job)
        return job
