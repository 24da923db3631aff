"""GPU build profiles: one TOML file per GPU in `build_profiles/`, and picking one for this machine.

A profile says what the memory plan may spend (VRAM, CUDA-context reserve, utilisation) and the
defaults a build uses when the user does not say otherwise (context length, KV format, chunk
size, speculation, CUDA-graph batch sizes).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .config import KVCacheConfig, KVOverrides, ModelConfig
from .errors import PlanError

# The repository's build_profiles/, reached through a link inside the package so that a wheel ships them.
PROFILES_DIR = Path(__file__).parent / "data" / "build_profiles"
# A card whose name matches a profile but whose memory differs by more than this is another
# model of card (RTX 3060 8 GB vs 12 GB share one name); the driver reports a little less than
# the nominal size, hence the slack.
VRAM_TOLERANCE = 0.10
# Generic (unknown GPU) profiles reserve the consumer-card upper bound for the CUDA context.
GENERIC_CONTEXT_RESERVE = 512 * 2**20
LM_HEAD_DTYPES = ("int8", "fp16")
EMBEDDING_PLACEMENTS = ("host", "gpu")


@dataclass(frozen=True)
class ProfileDefaults:
    """What a build uses for each setting the user leaves unset."""

    max_model_len: int
    kv_cache_dtype: str
    kv_group_size: int
    kv_sink_tokens: int
    kv_window: int
    block_size: int
    chunked_prefill_size: int
    num_speculative_tokens: int   # proposals per decode step the plan holds room for, with a draft
    cuda_graph_batch_sizes: tuple[int, ...]
    gpu_memory_utilization: float
    max_num_seqs: int
    lm_head_dtype: str
    embedding_placement: str

    def kv_config(self, model: ModelConfig | None = None) -> KVCacheConfig:
        """The profile's KV format, with `model`'s family defaults over it (ModelFamily.kv_defaults)."""
        kv = KVCacheConfig(
            dtype=self.kv_cache_dtype,
            group_size=self.kv_group_size,
            sink_tokens=self.kv_sink_tokens,
            window=self.kv_window,
            block_size=self.block_size,
        )
        return dataclasses.replace(kv, **model.declared.kv_defaults) if model is not None else kv

    def build_kv(self, model: ModelConfig, overrides: KVOverrides) -> KVCacheConfig:
        """The KV format a build of `model` writes and `plan` prices: the profile's, the family's defaults
        over it, the options given over both; PlanError for one that cannot run on the model."""
        kv = overrides.apply(self.kv_config(model))
        try:
            kv.validate(model.head_dim)
        except ValueError as e:
            raise PlanError(str(e)) from None
        return kv


@dataclass(frozen=True)
class BuildProfile:
    name: str
    description: str
    gpu_name_patterns: tuple[str, ...]
    sm: int                              # 86, 89, 90 ...; 0 for the CPU
    vram_bytes: int                      # for the CPU: the host-memory budget
    memory_bandwidth_bytes_per_s: float  # 0 when unknown (generic profiles): no roofline then
    cuda_context_reserve_bytes: int
    defaults: ProfileDefaults

    @property
    def is_cpu(self) -> bool:
        return self.sm == 0

    def matches_name(self, device_name: str) -> bool:
        return any(re.search(p, device_name, re.IGNORECASE) for p in self.gpu_name_patterns)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def list_profiles() -> list[str]:
    """Names of the profiles shipped in `build_profiles/`."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load_profile(name: str) -> BuildProfile:
    path = PROFILES_DIR / f"{name}.toml"
    if not path.is_file():
        raise PlanError(
            f"unknown build profile {name!r}; known profiles: {', '.join(list_profiles())} "
            f"(or 'auto' to pick one for this machine's GPU)."
        )
    profile = _parse_profile(path)
    host = host_memory_bytes() if profile.is_cpu else None
    if host:   # the CPU's "VRAM" is this machine's memory, not the file's nominal desktop
        profile = dataclasses.replace(profile, vram_bytes=host)
    return profile


def host_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say (the cpu profile keeps its file's)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def profiles_epilog() -> str:
    """The shipped profiles, one line each, for the `--help` pages of the commands that take --profile."""
    lines = [f"  {p.name:<20}{p.description}" for p in map(load_profile, list_profiles())]
    return "\b\nBuild profiles (--profile; auto picks this machine's GPU, cpu without one):\n" + "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _parse_profile(path: Path) -> BuildProfile:
    with path.open("rb") as f:
        data = tomllib.load(f)
    where = f"build_profiles/{path.name}"
    try:
        table = dict(data.pop("defaults"))
        table["cuda_graph_batch_sizes"] = tuple(table.get("cuda_graph_batch_sizes", ()))
        if "num_draft_tokens" in table:   # the key's older spelling
            table.setdefault("num_speculative_tokens", table.pop("num_draft_tokens"))
        defaults = ProfileDefaults(**table)
        profile = BuildProfile(
            **{**data, "gpu_name_patterns": tuple(data.get("gpu_name_patterns", ())), "defaults": defaults}
        )
    except (KeyError, TypeError) as e:
        raise PlanError(
            f"{where} is malformed ({e}); give it the same top-level keys and [defaults] table "
            f"as build_profiles/cpu.toml."
        ) from None
    if profile.name != path.stem:
        raise PlanError(f"{where} says name = {profile.name!r}; rename the file or the name so they agree.")
    _check_defaults(profile.defaults, where)
    return profile


def _check_defaults(d: ProfileDefaults, where: str) -> None:
    if d.lm_head_dtype not in LM_HEAD_DTYPES:
        raise PlanError(f"{where}: lm_head_dtype {d.lm_head_dtype!r} is unknown; use one of {LM_HEAD_DTYPES}.")
    if d.embedding_placement not in EMBEDDING_PLACEMENTS:
        raise PlanError(
            f"{where}: embedding_placement {d.embedding_placement!r} is unknown; use one of {EMBEDDING_PLACEMENTS}."
        )
    if not 0 < d.gpu_memory_utilization <= 1:
        raise PlanError(f"{where}: gpu_memory_utilization must be in (0, 1]; got {d.gpu_memory_utilization}.")
    try:
        d.kv_config().validate()
    except ValueError as e:
        raise PlanError(f"{where}: {e}") from None


def match_profile(device_name: str, total_memory: int, major: int, minor: int) -> tuple[BuildProfile, str]:
    """The shipped profile for a CUDA device, or a generic one built from its properties."""
    known = [load_profile(n) for n in list_profiles()]
    by_name = [p for p in known if not p.is_cpu and p.matches_name(device_name)]
    for p in by_name:
        if abs(total_memory - p.vram_bytes) <= VRAM_TOLERANCE * p.vram_bytes:
            return p, f"picked for {device_name!r}"
    why = (
        f"{device_name!r} matches profile {by_name[0].name} by name but has {total_memory / 2**30:.1f} GiB, "
        f"not {by_name[0].vram_bytes / 2**30:.1f} GiB"
        if by_name
        else f"no shipped profile matches {device_name!r}"
    )
    generic = generic_profile(device_name, total_memory, major, minor)
    return generic, (
        f"warning: {why}; using generic profile {generic.name} ({total_memory / 2**30:.1f} GiB, "
        f"defaults of {_closest_gpu_profile(total_memory).name}). Check `bie-trt plan` or pass --profile."
    )


def generic_profile(device_name: str, total_memory: int, major: int, minor: int) -> BuildProfile:
    """A profile for a GPU we ship none for: its own memory and SM, defaults of a similar shipped card."""
    sm = major * 10 + minor
    return BuildProfile(
        name=f"generic-sm{sm}",
        description=f"{device_name} (no shipped profile; built from its device properties)",
        gpu_name_patterns=(re.escape(device_name),),
        sm=sm,
        vram_bytes=int(total_memory),
        memory_bandwidth_bytes_per_s=0.0,
        cuda_context_reserve_bytes=GENERIC_CONTEXT_RESERVE,
        defaults=_closest_gpu_profile(total_memory).defaults,
    )


def _closest_gpu_profile(total_memory: int) -> BuildProfile:
    """The biggest shipped card that is not bigger than this one, whose defaults should fit it;
    the smallest card for a GPU below them all (the plan then says what to change)."""
    gpus = sorted((p for p in map(load_profile, list_profiles()) if not p.is_cpu), key=lambda p: p.vram_bytes)
    fitting = [p for p in gpus if p.vram_bytes <= total_memory * (1 + VRAM_TOLERANCE)]
    return fitting[-1] if fitting else gpus[0]


def resolve_profile(name: str) -> tuple[BuildProfile, str]:
    """`name`, or for "auto" the profile of this machine's first CUDA GPU (the cpu profile without one).

    Returns the profile and a short phrase saying why it was picked (a warning when the GPU has
    no shipped profile), for the user to see next to the profile's name.
    """
    if name != "auto":
        return load_profile(name), "chosen with --profile"
    import torch  # lazy: planning and `--help` should not pay for importing torch

    if not torch.cuda.is_available():
        return load_profile("cpu"), "no CUDA GPU found"
    props = torch.cuda.get_device_properties(0)
    return match_profile(torch.cuda.get_device_name(0), props.total_memory, props.major, props.minor)
