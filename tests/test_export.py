"""plugin.runtime.export: a last_save_in_hf export gets the assets folder's config and tokenizer files, nothing else."""

from conftest import parse_config
from plugin.runtime.export import complete_hf_export, hf_export_folder


def test_export_gets_the_assets_non_weight_files(tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        (assets / name).write_text(name)
    cfg = parse_config("--job.dump_folder", str(tmp_path / "dump"), "--model.hf_assets_path", str(assets),
                       "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.no-load-only",
                       "--training.steps", "3")
    out = hf_export_folder(cfg)
    assert out == tmp_path / "dump" / "checkpoint" / "step-3"
    assert complete_hf_export(cfg) == []  # the run stopped before its last step: no export to complete
    out.mkdir(parents=True)
    (out / "model-00001-of-00001.safetensors").write_text("trained")
    (out / "config.json").write_text("already there")
    assert complete_hf_export(cfg) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert (out / "config.json").read_text() == "already there"
    assert (out / "tokenizer.json").read_text() == "tokenizer.json"
    assert sorted(f.name for f in out.iterdir()) == ["chat_template.jinja", "config.json",
                                                     "model-00001-of-00001.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    cfg.checkpoint.last_save_in_hf = False
    (out / "tokenizer.json").unlink()
    assert complete_hf_export(cfg) == [] and not (out / "tokenizer.json").exists()
