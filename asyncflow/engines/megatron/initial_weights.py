"""Where a trainer's initial weights come from: a Hugging Face folder or a Megatron distributed checkpoint.

``trainer.load_dir`` names the folder (None: ``model.path``) and ``trainer.load_format`` its format; ``auto`` tells
them apart by their files. A Megatron-LM ``--save`` folder holds ``latest_checkpointed_iteration.txt`` and one
``iter_NNNNNNN`` (or ``release``) folder per save; the iteration it names is the one read.
"""

from __future__ import annotations

from pathlib import Path

from asyncflow.config import ConfigError

HF = "hf"
MEGATRON_DIST = "megatron_dist"
_TRACKER = "latest_checkpointed_iteration.txt"


def resolve(load_dir: str | Path | None, load_format: str, model_dir: str | Path) -> tuple[str, Path]:
    """``(format, folder)`` to read the initial weights from; a ``ConfigError`` naming the key when it cannot be."""
    if load_dir is None:
        if load_format == MEGATRON_DIST:
            raise ConfigError("trainer.load_format=megatron_dist needs trainer.load_dir (the checkpoint folder); "
                              "model.path is a Hugging Face folder")
        return HF, Path(model_dir)
    path = Path(load_dir)
    if not path.is_dir():
        raise ConfigError(f"trainer.load_dir={load_dir}: no such folder")
    dist = _dist_folder(path)
    hf = any(path.glob("*.safetensors"))
    if load_format == "auto":
        if dist is not None:
            return MEGATRON_DIST, dist
        if hf:
            return HF, path
        raise ConfigError(f"trainer.load_dir={load_dir}: neither a Megatron distributed checkpoint (metadata.json, "
                          f"or {_TRACKER}) nor a Hugging Face folder (*.safetensors); set trainer.load_format")
    if load_format == MEGATRON_DIST:
        if dist is None:
            raise ConfigError(f"trainer.load_dir={load_dir}: not a Megatron distributed checkpoint (no metadata.json "
                              f"and no {_TRACKER}); a Hugging Face folder needs trainer.load_format=hf")
        return MEGATRON_DIST, dist
    if not hf:
        raise ConfigError(f"trainer.load_dir={load_dir}: no *.safetensors files for trainer.load_format=hf")
    return HF, path


def _dist_folder(path: Path) -> Path | None:
    """The dist-checkpoint folder at ``path`` (itself, or the iteration a Megatron-LM tracker file names)."""
    if (path / "metadata.json").is_file():
        return path
    tracker = path / _TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    folder = path / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not (folder / "metadata.json").is_file():
        raise ConfigError(f"trainer.load_dir={path}: {_TRACKER} names {folder.name}, which is not a Megatron "
                          "distributed checkpoint (no metadata.json; only the torch_dist format is read)")
    return folder
