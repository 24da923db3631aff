"""The engine directory: manifest, digests, compatibility checks.

Everything under `manifest.json` and the files it lists is deterministic. `build-info.json`
(when the build happened, on which host) is the one file deliberately left out of the digests.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping

from .config import KVCacheConfig, ModelConfig
from .errors import EngineError
from .jsonio import read_json_object

SCHEMA_VERSION = 3   # 2: kv.key_mean in the weights; 3: kv.key_mean is the pre-RoPE mean
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
DRAFT_DIR = "draft"            # the speculative draft model: its WEIGHTS, DRAFT_VOCAB and DRAFT_HEAD
DRAFT_VOCAB = "vocab.json"     # {"ranking": how the ids were chosen, "ids": the draft head's token ids}
DRAFT_HEAD = "head.safetensors"   # the draft's full head, read into host memory for each request's own ids
UNHASHED = ("build-info.json",)
# What every reader of a manifest relies on; anything else is optional or checked where used.
REQUIRED_KEYS = ("schema_version", "model", "kv", "plan", "files", "max_model_len", "max_num_seqs")


def bie_trt_version() -> str:
    try:
        return metadata.version("bie-trt")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def digest_files(files: list[Path], root: Path) -> str:
    """One digest over names and contents, independent of where `root` lives."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(root)).encode() + b"\0" + sha256_file(f).encode() + b"\0")
    return h.hexdigest()


def write_manifest(engine_dir: Path, manifest: dict[str, Any]) -> None:
    files = sorted(p for p in engine_dir.rglob("*") if p.is_file() and p.name != MANIFEST and p.name not in UNHASHED)
    manifest = dict(manifest, files={str(p.relative_to(engine_dir)): sha256_file(p) for p in files})
    (engine_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Target:
    gpu: str    # the profile's description of the GPU
    sm: int     # its compute capability (0: any, a CPU build)


@dataclass(frozen=True)
class Source:
    """The checkpoint the engine was built from."""

    checkpoint: str
    weight_group_size: int
    gguf: Mapping[str, Any] | None   # how a GGUF file was converted, tensor type by type (None: AWQ safetensors)
    digest: str = ""                 # digest_files over the checkpoint's files ("": an engine of before the key)

    def is_file(self, gguf: Path) -> bool:
        """Whether the engine was built directly from this GGUF file, so its weights are the file's own. A built-in
        name (`gemma3-270m`) or `bie-trt quantize` makes an AWQ conversion of the same file instead: another
        model, whose tokens a comparison with the file would blame on the runtime."""
        return self.gguf is not None and self.digest == digest_files([gguf], gguf.parent)


@dataclass(frozen=True)
class PlanSummary:
    """What the runtime reads of the memory plan solved at build."""

    budget_bytes: int
    total_bytes: int
    items: tuple[tuple[str, int], ...]   # (name, bytes), item by item
    embedding_placement: str             # "gpu" | "host"
    num_speculative_tokens: int          # the verify rows the plan holds room for (0: none)
    inputs: Mapping[str, Any]            # what it was solved for, as `plan.planned_step_tokens` reads it


@dataclass(frozen=True)
class DraftInfo:
    """The speculative draft model under draft/."""

    name: str
    config: ModelConfig
    vocab_size: int       # ids its own head covers
    request_vocab: int    # rows of each request's own ids added to that head (0: none)
    sink_tokens: int
    window: int


@dataclass(frozen=True)
class Manifest:
    """An engine's manifest.json, read and checked once (`read_manifest`); the JSON on disk is what
    `build` writes."""

    path: Path
    schema_version: int
    bie_trt_version: str
    model_name: str
    model: ModelConfig
    kv: KVCacheConfig
    max_model_len: int
    max_num_seqs: int
    chunked_prefill_size: int
    profile_name: str
    cuda_graph_batch_sizes: tuple[int, ...]
    target: Target
    plan: PlanSummary
    files: Mapping[str, str]              # path in the engine -> sha256
    source: Source
    w4_gemv_configs: Mapping[str, Any] | None   # tuned W4 GEMV configs per fused linear (None: none tuned)
    triton_version: str | None            # the Triton that compiled kernels/
    speculative: Mapping[str, Any] | None  # the build's speculation default, in vLLM's spelling
    draft: DraftInfo | None
    # how the build chose the KV settings it measured (builder/kv_choice.py); None: an engine of before
    kv_choice: Mapping[str, Any] | None = None


def read_manifest(engine_dir: str | Path) -> Manifest:
    path = Path(engine_dir) / MANIFEST
    if not path.exists():
        raise EngineError(f"{engine_dir}: no {MANIFEST}; this is not an engine directory (make one with `bie-trt build`).")
    manifest = read_json_object(path, "the engine is damaged: rebuild it with `bie-trt build`.", EngineError)
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise EngineError(
            f"{path}: engine schema version {version}, but this bie-trt ({bie_trt_version()}) reads "
            f"version {SCHEMA_VERSION}; rebuild the engine with this version."
        )
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise EngineError(f"{path}: missing {', '.join(missing)}; the engine is damaged: rebuild it with `bie-trt build`.")
    if not isinstance(manifest["files"], dict) or not manifest["files"]:
        raise EngineError(f"{path}: 'files' must map each file to its sha256; rebuild the engine with `bie-trt build`.")
    try:
        return _typed(path, manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise EngineError(f"{path}: malformed ({type(e).__name__}: {e}); rebuild the engine with "
                          f"`bie-trt build`.") from None


def _typed(path: Path, m: dict[str, Any]) -> Manifest:
    """The JSON as `build` writes it -> Manifest; KeyError/TypeError/ValueError where it is not."""
    plan, profile, target = m["plan"], m["profile"], m.get("target", {})
    inputs, source, draft = plan["inputs"], m["source"], m.get("draft")
    return Manifest(
        path=path, schema_version=int(m["schema_version"]), bie_trt_version=str(m["bie_trt_version"]),
        model_name=str(m["model"]["name"]), model=ModelConfig.from_dict(m["model"]["config"]),
        kv=KVCacheConfig(**m["kv"]), max_model_len=int(m["max_model_len"]), max_num_seqs=int(m["max_num_seqs"]),
        chunked_prefill_size=int(m.get("chunked_prefill_size", 512)),   # engines of before the key: 512
        profile_name=str(profile["name"]),
        cuda_graph_batch_sizes=tuple(int(b) for b in profile["defaults"]["cuda_graph_batch_sizes"]),
        target=Target(str(target.get("gpu", "?")), int(target.get("sm", 0))),
        plan=PlanSummary(int(plan["budget_bytes"]), int(plan["total_bytes"]),
                         tuple((str(i["name"]), int(i["bytes"])) for i in plan["items"]),
                         str(inputs.get("embedding_placement", "gpu")),
                         int(inputs.get("num_speculative_tokens") or 0), inputs),
        files=m["files"],
        source=Source(str(source["checkpoint"]), int(source["weight_group_size"]), source.get("gguf"),
                      str(source.get("digest", ""))),
        w4_gemv_configs=(m.get("kernels") or {}).get("w4_gemv"), triton_version=m.get("toolchain", {}).get("triton"),
        speculative=m.get("speculative"),
        draft=None if draft is None else DraftInfo(
            str(draft["name"]), ModelConfig.from_dict(draft["config"]), int(draft["vocab_size"]),
            int(draft.get("request_vocab", 0)), int(draft["sink_tokens"]), int(draft["window"])),
        kv_choice=m.get("kv_choice"),
    )


def set_umask_permissions(root: Path) -> None:
    """Give a finished directory tree the permissions a plain `mkdir`/`open` would have (0755 / 0644
    under the usual umask): the temporary directory it was built in was private (0700)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


@dataclass
class VerifyReport:
    ok: bool
    problems: list[str]
    notes: list[str]


def present_gpu_sm() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def check_target(target: Target, sm: int | None) -> str | None:
    """A problem sentence when the engine cannot run on a GPU of compute capability `sm`."""
    if sm is None or target.sm == 0:
        return None
    if sm != target.sm:
        return (f"engine was built for SM {target.sm} ({target.gpu}) but this GPU is SM {sm}; "
                f"rebuild it here with `bie-trt build --profile auto`.")
    return None


def file_problems(engine_dir: Path, listed: dict[str, str],
                  sha256: Callable[[Path], str] = sha256_file) -> list[str]:
    """One sentence per listed file that is missing or whose sha256 differs from the manifest's."""
    problems = []
    for name, want in sorted(listed.items()):
        f = engine_dir / name
        if not f.is_file():
            problems.append(f"{name}: missing")
        elif sha256(f) != want:
            problems.append(f"{name}: sha256 mismatch (the file was modified or corrupted)")
    return problems


def verify_engine(engine_dir: str | Path, sm: int | None = None, check_gpu: bool = True) -> VerifyReport:
    """Check the manifest, the digest of every file, that no file is unlisted, and that the engine
    fits this machine's GPU. A damaged manifest is a problem of the report, not an exception."""
    engine_dir = Path(engine_dir)
    try:
        manifest = read_manifest(engine_dir)
    except EngineError as e:
        return VerifyReport(False, [str(e)], [])
    listed = manifest.files
    problems, notes = file_problems(engine_dir, listed), []
    present = {str(p.relative_to(engine_dir)) for p in engine_dir.rglob("*") if p.is_file()}
    for extra in sorted(present - set(listed) - {MANIFEST, *UNHASHED}):
        problems.append(f"{extra}: not listed in the manifest (remove it, or rebuild the engine)")
    if check_gpu:
        sm = sm if sm is not None else present_gpu_sm()
        if sm is None:
            notes.append("no CUDA GPU here: SM compatibility not checked (pass --sm to check against one)")
        elif (p := check_target(manifest.target, sm)):
            problems.append(p)
    return VerifyReport(not problems, problems, notes)
