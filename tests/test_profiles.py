"""Build profiles: the shipped TOML files, and picking one for the GPU at hand."""
from __future__ import annotations

import types

import pytest

import bie_trt.profiles as profiles
from bie_trt.errors import PlanError
from bie_trt.profiles import list_profiles, load_profile, match_profile, resolve_profile

GIB = 2**30
EIGHT_GB = ["rtx3060-8gb", "rtx3070-8gb", "rtx4060-8gb", "rtx4060ti-8gb", "rtx4070-laptop-8gb"]
BANDWIDTH = {
    "rtx3060-8gb": 240e9, "rtx3070-8gb": 448e9, "rtx4060-8gb": 272e9, "rtx4060ti-8gb": 288e9,
    "rtx4070-laptop-8gb": 256e9, "rtx4090-24gb": 1008e9, "h200-141gb": 4.8e12,
}


def test_required_profiles_ship():
    assert set(EIGHT_GB + ["rtx4090-24gb", "h200-141gb", "cpu"]) <= set(list_profiles())


@pytest.mark.parametrize("name", list_profiles())
def test_every_profile_loads_and_is_consistent(name):
    p = load_profile(name)
    assert p.name == name
    assert p.vram_bytes > p.cuda_context_reserve_bytes >= 0
    assert 0 < p.defaults.gpu_memory_utilization <= 1
    p.defaults.kv_config().validate(128)
    assert p.is_cpu == (name == "cpu")
    if not p.is_cpu:
        assert p.sm in (86, 89, 90) and p.gpu_name_patterns


@pytest.mark.parametrize("name", EIGHT_GB)
def test_8gb_profiles_plan_64k_int4(name):
    p = load_profile(name)
    d = p.defaults
    assert p.vram_bytes == 8 * GIB
    assert 300 * 2**20 <= p.cuda_context_reserve_bytes <= 500 * 2**20
    assert (d.max_model_len, d.kv_cache_dtype, d.kv_group_size, d.kv_sink_tokens, d.kv_window) == (
        65536, "int4_asym", 64, 8, 128)
    assert (d.block_size, d.chunked_prefill_size, d.gpu_memory_utilization) == (16, 256, 0.92)
    assert (d.lm_head_dtype, d.embedding_placement) == ("int8", "host")


@pytest.mark.parametrize("name,bandwidth", BANDWIDTH.items())
def test_bandwidth_is_the_public_spec(name, bandwidth):
    assert load_profile(name).memory_bandwidth_bytes_per_s == bandwidth


def test_cpu_profile():
    p = load_profile("cpu")
    assert p.sm == 0 and p.cuda_context_reserve_bytes == 0 and p.defaults.cuda_graph_batch_sizes == ()


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(PlanError) as e:
        load_profile("rtx9999")
    assert "rtx4060ti-8gb" in str(e.value) and "cpu" in str(e.value)


@pytest.mark.parametrize("device,expected", [
    ("NVIDIA GeForce RTX 3060", "rtx3060-8gb"),
    ("NVIDIA GeForce RTX 3070", "rtx3070-8gb"),
    ("NVIDIA GeForce RTX 4060", "rtx4060-8gb"),
    ("NVIDIA GeForce RTX 4060 Ti", "rtx4060ti-8gb"),
    ("NVIDIA GeForce RTX 4070 Laptop GPU", "rtx4070-laptop-8gb"),
    ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"),
    ("NVIDIA H200", "h200-141gb"),
])
def test_match_by_name_and_memory(device, expected):
    vram = load_profile(expected).vram_bytes
    reported = int(vram * 0.98)  # drivers report a little less than the nominal size
    p, why = match_profile(device, reported, 8, 9)
    assert p.name == expected and device in why


def test_same_name_other_memory_gets_a_generic_profile():
    # The 12 GB RTX 3060 shares its name with the 8 GB card.
    p, why = match_profile("NVIDIA GeForce RTX 3060", 12 * GIB, 8, 6)
    assert p.name == "generic-sm86" and p.vram_bytes == 12 * GIB
    assert p.defaults.max_model_len == 65536  # an 8 GB card's defaults: they fit in 12 GB
    assert why.startswith("warning:") and "rtx3060-8gb" in why


def test_unknown_gpu_gets_a_generic_profile():
    p, why = match_profile("NVIDIA A100-SXM4-80GB", 80 * GIB, 8, 0)
    assert (p.name, p.sm, p.vram_bytes) == ("generic-sm80", 80, 80 * GIB)
    assert p.memory_bandwidth_bytes_per_s == 0  # unknown: no roofline
    assert p.defaults == load_profile("rtx4090-24gb").defaults  # the biggest shipped card not bigger
    assert "warning" in why and "A100" in why


def fake_torch(monkeypatch, name: str | None, total: int = 0, major: int = 0, minor: int = 0) -> None:
    import torch

    props = types.SimpleNamespace(total_memory=total, major=major, minor=minor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)


def test_auto_without_cuda_is_cpu(monkeypatch):
    fake_torch(monkeypatch, None)
    p, why = resolve_profile("auto")
    assert p.name == "cpu" and "no CUDA" in why


def test_auto_with_a_known_gpu(monkeypatch):
    fake_torch(monkeypatch, "NVIDIA GeForce RTX 4060 Ti", 8_585_216_000, 8, 9)
    p, why = resolve_profile("auto")
    assert p.name == "rtx4060ti-8gb" and "RTX 4060 Ti" in why


def test_explicit_name():
    assert resolve_profile("rtx4090-24gb")[0].name == "rtx4090-24gb"
    with pytest.raises(PlanError, match="known profiles"):
        resolve_profile("nope")


def test_malformed_profile_names_file_and_fix(monkeypatch, tmp_path):
    (tmp_path / "broken.toml").write_text('name = "broken"\nsm = 89\n')
    monkeypatch.setattr(profiles, "PROFILES_DIR", tmp_path)
    with pytest.raises(PlanError, match=r"broken\.toml is malformed"):
        load_profile("broken")


def test_older_spelling_num_draft_tokens_still_loads(monkeypatch, tmp_path):
    text = (profiles.PROFILES_DIR / "cpu.toml").read_text()
    assert "num_speculative_tokens = 4" in text
    (tmp_path / "cpu.toml").write_text(text.replace("num_speculative_tokens = 4", "num_draft_tokens = 3"))
    monkeypatch.setattr(profiles, "PROFILES_DIR", tmp_path)
    profiles._parse_profile.cache_clear()
    try:
        assert load_profile("cpu").defaults.num_speculative_tokens == 3
    finally:
        profiles._parse_profile.cache_clear()
