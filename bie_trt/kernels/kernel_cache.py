"""Compiled Triton kernels inside the engine directory, so that `run` compiles nothing the build could.

Triton keys each compiled kernel by its source, the GPU, the Triton version and the launch's
specialisation (dtypes, constexprs, which integer arguments are 1 or multiples of 16). So a build
on the target GPU loads the finished engine with Triton's on-disk cache pointed into it and lets
the runner warm up (one of each step it serves: `ModelRunner.warm_up`); every kernel those steps
launch lands in `<engine>/kernels/`. At load the runtime points Triton at a copy of that folder:
engine directories may be read-only, and Triton still adds anything the build did not foresee.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

KERNELS_DIR = "kernels"


@contextmanager
def triton_cache_at(path: Path) -> Iterator[Path]:
    """Triton reads TRITON_CACHE_DIR at each compilation (3.6 and later), so this redirects them."""
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old


def forget_compiled_kernels() -> None:
    """Empty Triton's in-process kernel caches (one per @triton.jit function and device), which are
    consulted before the on-disk cache: a kernel this process already compiled (the build's tuning
    times the GEMV configs at the engine's shapes) would otherwise never be written into a new cache."""
    from triton.runtime.jit import JITFunction

    from . import triton_attention, triton_int8, triton_ops, triton_w4

    for module in (triton_attention, triton_int8, triton_ops, triton_w4):
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                obj.device_caches.clear()


def compiled_kernels(cache: Path) -> set[str]:
    """One entry per compilation in a Triton cache folder: its hash folder and kernel name. Each
    holds the kernel's metadata `<name>.json` beside a `__grp__<name>.json` listing its files."""
    return {f"{p.parent.name}/{p.stem}" for p in Path(cache).glob("*/*.json") if not p.name.startswith("__grp__")}


def _rebase_groups(folder: Path, final: Path) -> None:
    """Triton's `__grp__<name>.json` lists a compilation's files by absolute path, and a group whose
    files are missing is a cache miss: point the copy's groups at where its files will be."""
    for grp in Path(folder).glob("*/__grp__*.json"):
        data = json.loads(grp.read_text())
        if "child_paths" not in data:
            continue
        data["child_paths"] = {name: str(Path(final).absolute() / grp.parent.name / Path(p).name)
                               for name, p in data["child_paths"].items()}
        grp.write_text(json.dumps(data))


def installed_triton() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def use_engine_kernels(engine_dir: Path, files: Mapping[str, str], built_with: str | None,
                       cache_root: Path) -> Path | None:
    """Point Triton at a writable copy (under cache_root) of the engine's compiled kernels, if it has
    any and they come from the Triton installed here (`built_with`: the manifest's; `files`: its digests);
    returns the folder Triton now uses."""
    source = Path(engine_dir) / KERNELS_DIR
    if not source.is_dir() or built_with != installed_triton():
        return None
    digests = {name: sha for name, sha in files.items() if name.startswith(KERNELS_DIR + "/")}
    target = cache_root / "kernels" / hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]
    if not target.exists():
        # Copy beside and rename: two processes loading one engine never see half a copy.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".copy-", dir=target.parent))
        shutil.copytree(source, staging, dirs_exist_ok=True)
        _rebase_groups(staging, target)
        try:
            staging.rename(target)
        except OSError:   # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    os.environ["TRITON_CACHE_DIR"] = str(target)
    return target
