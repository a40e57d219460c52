"""A `[checkpoint] last_save_in_hf` export that transformers can load: torchtitan 0.2.2 writes only the
safetensors into <dump_folder>/<checkpoint folder>/step-<steps>; this copies the model's config, tokenizer
and chat template next to them from `[model] hf_assets_path`, the folder the run's tokenizer was read from.

torchtitan's Trainer has no hook after its last save; the metrics processor is closed after the checkpointer
(Trainer.close), so it calls `complete_hf_export` then.
"""

import shutil
from pathlib import Path

import torch.distributed as dist
from torchtitan.tools.logging import logger

# the weights come from the run; everything else in the assets folder (config, tokenizer, chat template,
# generation config) describes the exported model unchanged
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf")


def hf_export_folder(job_config) -> Path:
    """Where torchtitan writes the last step's HF export (CheckpointManager._create_checkpoint_id)."""
    ckpt = job_config.checkpoint
    return Path(job_config.job.dump_folder) / ckpt.folder / f"step-{job_config.training.steps}"


def complete_hf_export(job_config) -> list[str]:
    """Copy the assets folder's non-weight files into the last step's HF export; the names copied (rank 0 only)."""
    ckpt = job_config.checkpoint
    if not (ckpt.enable and ckpt.last_save_in_hf and not ckpt.load_only):
        return []
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    out, assets = hf_export_folder(job_config), Path(job_config.model.hf_assets_path or "")
    if not any(out.glob("*.safetensors")):  # no last step (the run stopped early), or another layout
        return []
    if not assets.is_dir():
        logger.warning(f"{out}: the HF export has no config or tokenizer: [model] hf_assets_path = "
                       f"{str(assets)!r} is not a folder to copy them from")
        return []
    copied = []
    for f in sorted(assets.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    logger.info(f"HF export {out}: copied {', '.join(copied) or 'nothing'} from [model] hf_assets_path = {assets}")
    return copied
