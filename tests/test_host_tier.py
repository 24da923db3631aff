"""The host tier of the KV cache: prefix blocks the device evicts wait in host memory (their own layout:
quantised bodies as they are, FP16 sinks and window) and come back with a copy instead of a re-prefill.

A (a long prompt) -> B (another, which evicts A from a small device pool) -> A: the second A is served
from the host tier, and its tokens and logprobs equal those of a warm device-pool hit. Checked on a tiny
random model with flat logits, where a block read one bit differently soon flips a token."""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, rule

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.config import KVCacheConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.executor.model_runner import apply_moves
from bie_trt.kv.host_pool import HostPool, block_bytes
from bie_trt.model.synthetic import write_word_tokenizer
from test_block_manager import PROMPTS, BlockMachine, new_seq
from tiny_model import write_tiny_hf

VOCAB = 48
PROMPT_LEN = 417          # 26 full blocks and one token: a hit can cover 416 of them
MAX_LEN = 512             # with one sequence, the quantised pool holds 32 blocks: B's body evicts A's
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SPEC = {"none": {"method": "none"},
        # a fixed γ: logprobs are compared bit for bit, and adaptive γ's timed choices change a verify's width
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                  "adaptive": False}}


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("host_tier")
    tokenizer = write_word_tokenizer(root / "tok")
    hf = write_tiny_hf(root / "hf", tokenizer, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                       max_position_embeddings=1024)
    awq = quantize_checkpoint(hf, root / "awq", group_size=32)
    return build_engine(BuildOptions(checkpoint=str(awq), out=str(root / "engine"), profile="cpu",
                                     max_model_len=MAX_LEN, max_num_seqs=4, kv_cache_dtype="int4_asym",
                                     kv_group_size=32, kv_sink_tokens=8, kv_window=32), log=lambda m: None)


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    """Random ids with a repeated phrase at the end (so prompt lookup proposes)."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, VOCAB) for _ in range(6)]
    return [rng.randrange(3, VOCAB) for _ in range(length - 24)] + phrase * 4


A, B = prompt(1), prompt(2, 490)


def engine(tiny_engine: Path, dtype: str, spec: str, **config) -> BieEngine:
    small = {"max_num_seqs": 1, "max_model_len": MAX_LEN, "num_kv_blocks": 36}
    return BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", kv_cache_dtype=dtype,
                                  speculative=SPEC[spec], **{**small, **config}))


def same_output(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs


@pytest.mark.parametrize("dtype,spec", [("int4_asym", "none"), ("fp8", "ngram"), ("fp16", "none"),
                                        pytest.param("int4_asym", "ngram", marks=pytest.mark.slow),
                                        pytest.param("fp8", "none", marks=pytest.mark.slow),
                                        pytest.param("fp16", "ngram", marks=pytest.mark.slow)])
def test_a_prompt_evicted_to_the_host_comes_back_exactly(tiny_engine, dtype, spec):
    warm = engine(tiny_engine, dtype, spec, max_num_seqs=4, num_kv_blocks=None, host_kv_cache_gb=0)
    warm.generate(A, PARAMS)
    want = warm.generate(A, PARAMS)
    assert want.usage.cached_tokens == PROMPT_LEN - 1   # the reference is a warm device-pool hit

    tiered = engine(tiny_engine, dtype, spec, host_kv_cache_gb=0.01)
    first = tiered.generate(A, PARAMS)
    assert first.usage.cached_tokens == 0
    tiered.generate(B, PARAMS)
    host = tiered.stats().host_kv
    assert host["offloaded_bytes"] > 0 and host["blocks"] > 0
    again = tiered.generate(A, PARAMS)
    assert again.usage.cached_tokens >= 0.95 * PROMPT_LEN
    hit_from_host = tiered.stats().host_kv["hit_tokens"]
    assert hit_from_host >= 0.6 * PROMPT_LEN   # most of the hit was copied back, not found on the device
    same_output(again, want)
    assert first.token_ids == want.token_ids    # a cold prefill sums in another order: the same tokens


def test_without_the_tier_the_same_pool_recomputes(tiny_engine):
    """The pool above is small enough that B really evicts A: with the tier off, A's return misses."""
    untiered = engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=0)
    untiered.generate(A, PARAMS)
    untiered.generate(B, PARAMS)
    assert untiered.generate(A, PARAMS).usage.cached_tokens < 0.5 * PROMPT_LEN
    assert untiered.stats().host_kv["capacity_bytes"] == 0


# -- the block manager with a host tier, as a state machine ------------------------------------------------

def _launching(name: str):
    def call(self, *args, **kwargs):
        out = getattr(BlockManager, name)(self, *args, **kwargs)
        # as the scheduler orders them: the host moves a call decided go before the pairs it returns
        apply_moves(self.pools, self.host_pool, self.take_host_moves())
        self.host.settle()
        return out
    return call


class LaunchingBlocks(BlockManager):
    """A block manager whose host moves are launched as each call returns (the machine launches the
    quantisations and copies the calls return at once too)."""
    locals().update({name: _launching(name) for name in ("admit", "grow", "compact", "row_views", "free",
                                                         "reset_prefix_cache", "truncate", "commit", "fork")})


class HostTierMachine(BlockMachine):
    """test_block_manager's machine (every block owned once, no cached or held K/V ever changes, every row
    reads what plain decoding read) over a device pool with a host tier of a few blocks behind it: evicted
    blocks come back through it, and it never holds more than its bound."""
    num_fp, num_quant = 7, 6       # a small device pool: blocks are evicted often
    HOST_FP16, HOST_QUANT = 4, 8   # blocks' worth; a block's bytes go to the host only while it can hold them

    def __init__(self):
        super().__init__()
        sizes = block_bytes(self.pools)
        # no margin past the window: FP16 copies with twins go to the host only from a prompt's last window
        self.blocks = LaunchingBlocks(self.kv, self.num_fp, self.num_quant, True,
                                      self.HOST_FP16 * sizes[False] + self.HOST_QUANT * sizes.get(True, 0), sizes,
                                      host_tail_tokens=0)
        self.blocks.pools, self.blocks.host_pool = self.pools, HostPool(self.pools)

    @rule(prompt=PROMPTS)
    def visit(self, prompt):
        """A whole request: admitted with its hit (restored from the host tier when it is there), computed
        and freed, its blocks cached (evicting older ones)."""
        seq = new_seq(prompt)
        hit = self.blocks.match(seq)
        if self.blocks.can_admit(hit, seq.num_tokens):
            self.blocks.admit(seq, hit)
            self._run(seq, seq.num_pending)
            size = self.kv.block_size
            self.key_tokens.update({key: seq.token_ids[:(b + 1) * size] for b, key in enumerate(seq.block_keys)})
            self.blocks.free(seq)

    @invariant()
    def the_host_tier_stays_bounded_and_exact(self):
        host, pool = self.blocks.host, self.blocks.host_pool
        assert host.held <= host.capacity
        assert pool.nbytes == host.used and set(pool.slots) == {slot for slot, _ in host.blocks.values()}
        assert not set(host.blocks) & set(self.blocks.cache.entry_of)   # a block lives in one tier


class FP16HostTierMachine(HostTierMachine):
    kv = KVCacheConfig(dtype="fp16", block_size=4)


TestHostTierInt4 = HostTierMachine.TestCase
TestHostTierFP16 = FP16HostTierMachine.TestCase
TestHostTierInt4.settings = TestHostTierFP16.settings = settings(max_examples=60, stateful_step_count=30,
                                                                 deadline=None)


@pytest.mark.parametrize("machine", [HostTierMachine, FP16HostTierMachine])
def test_a_prefix_comes_back_from_the_host_tier_as_it_was(machine):
    """A -> B (evicting A's blocks to the host tier) -> A: the hit is restored, and every row of A's
    rest reads the K/V it had (the machine's step checks each one)."""
    m = machine()
    first, other = [0, 1] * 10 + [1], [1, 1, 0] * 7
    m.visit(first)
    m.visit(other)
    host = m.blocks.host
    assert host.num_offloaded > 0
    hit = m.blocks.match(new_seq(first))
    assert len(hit) == 5 and sum(isinstance(item, bytes) for item in hit) >= 2   # some of it from the host
    m.visit(first)
    assert host.num_restored >= 2
    m.the_host_tier_stays_bounded_and_exact()
    m.no_content_ever_changes()
    m.every_block_owned_once_and_counted()


def test_fp16_copies_of_a_body_stay_off_the_host_unless_a_prompt_ends_near_them():
    """A 48-token prompt (window 8) in a pool that holds it once; another as long evicts it. Its body's
    FP16 copies, released as it was quantised, are not worth the host tier (their quantised twins are
    there); the FP16 blocks a hit on the whole prompt reads are, and A's return hits all it can."""
    class Roomy(HostTierMachine):
        num_fp, num_quant = 14, 10
        HOST_FP16, HOST_QUANT = 6, 16

    m = Roomy()
    first = [0, 1, 1] * 16
    m.visit(first)
    m.visit([1, 0, 0, 0] * 12)
    size, keys = m.kv.block_size, m.blocks._keys(new_seq(first), 12)
    fp16_on_host = {key for key, (_, quantised) in m.blocks.host.blocks.items() if not quantised}
    body = set(keys[1:(len(first) - 1) // size * size // size - m.kv.window // size])
    assert fp16_on_host and not body & fp16_on_host
    hit = m.blocks.match(new_seq(first))
    assert len(hit) == (len(first) - 1) // size and any(isinstance(item, bytes) for item in hit)
    m.visit(first)   # restored: every row of the rest reads what it read before (the machine checks)
    m.no_content_ever_changes()


def test_the_host_cache_drops_its_oldest_blocks_to_stay_within_its_bound():
    from bie_trt.cache_tiers.host_cache import Drop, HostCache

    host = HostCache(100, {False: 40, True: 10}, itertools.count())
    moves = []
    slots = [host.put(bytes([i]), i % 2 == 1, moves) for i in range(6)]   # 40 + 10 + 40 + 10 + ...
    assert host.held == 100 and moves == [Drop(slots[0]), Drop(slots[1])]
    assert bytes([0]) not in host and bytes([5]) in host
    assert host.put(bytes([5]), True, moves) is None                      # stored once
    assert host.take(bytes([4])) == (slots[4], False, False)
    # a restore not launched yet still holds its bytes: room for a new block pushes out an older one
    moves.clear()
    host.put(b"x", False, moves)
    assert host.held == 100 and moves == [Drop(slots[2])]
    host.settle()
    assert host.held == host.used == 60
    too_small = HostCache(30, {False: 40}, itertools.count())
    assert too_small.put(b"y", False, moves) is None     # a block larger than the whole tier


# -- over HTTP ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv_files")


@pytest.fixture(scope="module")
def tiered_server(tiny_engine, cache_dir):
    from bie_trt.server.app import ServerOptions
    from test_server import serving

    tiered = engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=0.01)
    with serving(tiered, ServerOptions(kv_cache_dir=str(cache_dir))) as base:
        yield tiered, base


def test_responses_report_cached_tokens_and_metrics_count_the_host_tier(tiered_server):
    import httpx
    from test_concurrency import metric

    tiered, base = tiered_server

    def complete(ids: list[int], **extra) -> dict:
        r = httpx.post(base + "/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0, **extra},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    assert complete(A)["prompt_tokens_details"] == {"cached_tokens": 0}
    complete(B)
    assert metric(base, "bie_host_kv_copied_bytes_total", direction="offload") > 0
    assert metric(base, "bie_host_kv_cache_used_bytes") > 0
    assert metric(base, "bie_host_kv_cache_used_bytes") <= metric(base, "bie_host_kv_cache_capacity_bytes")
    again = complete(A)
    assert again["prompt_tokens_details"]["cached_tokens"] >= 0.95 * PROMPT_LEN
    assert metric(base, "bie_host_kv_cache_hits_total") >= 0.6 * PROMPT_LEN
    assert metric(base, "bie_host_kv_copied_bytes_total", direction="restore") > 0
    # streamed with include_usage: the last chunk carries it too
    r = httpx.post(base + "/v1/completions", json={"prompt": A, "max_tokens": 2, "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}}, timeout=120)
    usage = [line for line in r.text.splitlines() if '"usage"' in line][-1]
    assert '"prompt_tokens_details": {"cached_tokens": 416}' in usage


def test_the_plan_table_shows_the_host_tier_beside_the_device_plan():
    import json

    from click.testing import CliRunner

    from bie_trt.cli import main

    config = Path(__file__).parents[1] / "docs" / "examples" / "llama-3.1-8b-instruct-awq.config.json"
    args = ["plan", "--model-config", str(config), "--profile", "rtx4060ti-8gb", "--max-model-len", "65536",
            "--kv-cache-dtype", "int4_asym"]
    # 36 KiB a token of INT4 K/V on Llama-3-8B: 2.25 GiB holds a 64k document
    table = CliRunner().invoke(main, args + ["--host-kv-cache-gb", "2.25"]).stdout
    assert "host KV tier: 2.25 GiB of host RAM (outside the budget): 4,096 int4_asym blocks" in table
    assert "65,536 tokens" in table
    tier = json.loads(CliRunner().invoke(main, args + ["--host-kv-cache-gb", "0", "--json"]).stdout)["host_kv_cache"]
    assert tier["bytes"] == 0 and tier["tokens"] == 0


def test_a_preempted_sequence_comes_back_through_the_host_tier_with_the_same_tokens(tiny_engine):
    """Three sequences in a pool with room for about one and a half: they preempt each other. A victim's
    full blocks stay in the prefix cache, the device evicts them to the host tier when it needs the room,
    and the victim's re-admission copies them back: only its partly filled last block is recomputed."""
    prompts = [prompt(seed, 150) for seed in (3, 4, 5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = engine(tiny_engine, "int4_asym", "none", max_num_seqs=1, num_kv_blocks=None)
    want = [alone.generate(p, params).token_ids for p in prompts]
    crowded = engine(tiny_engine, "int4_asym", "none", max_num_seqs=3, num_kv_blocks=10, chunked_prefill_size=32,
                     host_kv_cache_gb=0.01)
    got = [out.token_ids for out in crowded.generate(prompts, params)]
    stats = crowded.stats()
    assert stats.preemptions > 0 and stats.host_kv["hit_tokens"] > 0
    assert got == want
    assert stats.kv_blocks["fp16"]["used"] == 0 and stats.kv_blocks["quant"]["used"] == 0


# -- cache files ------------------------------------------------------------------------------------------

def test_a_saved_cache_restores_into_a_new_engine_with_the_same_tokens(tiny_engine, tmp_path):
    warm = engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=0.01)
    warm.generate(A, PARAMS)
    want = warm.generate(A, PARAMS)
    saved = warm.save_cache(A, tmp_path / "a.kvc")
    assert saved["tokens"] == PROMPT_LEN - 1 and not list(tmp_path.glob(".*.tmp"))   # renamed into place
    warm.generate(B, PARAMS)
    assert warm.save_cache(A, tmp_path / "a2.kvc")["tokens"] == PROMPT_LEN - 1      # partly from the host tier

    for name in ("a.kvc", "a2.kvc"):
        fresh = engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=0.01)
        assert fresh.load_cache(tmp_path / name, A)["tokens"] == PROMPT_LEN - 1
        got = fresh.generate(A, PARAMS)
        assert got.usage.cached_tokens == PROMPT_LEN - 1
        same_output(got, want)


@pytest.fixture(scope="module")
def saved_file(tiny_engine, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache") / "a.kvc"
    engine(tiny_engine, "int4_asym", "none").save_cache(A[:100], path)
    return path


def refused(tiny_engine, path: Path, dtype: str = "int4_asym", engine_dir: Path | None = None) -> str:
    from bie_trt.cache_tiers.cache_file import CacheFileError

    with pytest.raises(CacheFileError) as e:
        engine(engine_dir or tiny_engine, dtype, "none").load_cache(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_cache_file_is_refused_when_damaged_or_made_elsewhere(tiny_engine, saved_file, tmp_path):
    import shutil

    data = saved_file.read_bytes()
    (tmp_path / "cut.kvc").write_bytes(data[:-100])
    assert "truncated" in refused(tiny_engine, tmp_path / "cut.kvc")
    for at in (20, len(data) // 2):   # in the header, in a block
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        (tmp_path / "flip.kvc").write_bytes(bytes(flipped))
        assert "checksum mismatch" in refused(tiny_engine, tmp_path / "flip.kvc")
    assert "kv_layout" in refused(tiny_engine, saved_file, dtype="fp8")
    other = tmp_path / "other"
    shutil.copytree(tiny_engine, other)
    manifest = (other / "manifest.json").read_text()
    (other / "manifest.json").write_text(manifest.replace('"max_num_seqs": 4', '"max_num_seqs": 3'))
    assert "the engine with manifest sha256" in refused(tiny_engine, saved_file, engine_dir=other)


def test_save_then_restart_then_restore_over_http_gives_the_same_tokens(tiny_engine, tiered_server, cache_dir):
    import httpx

    from bie_trt.server.app import ServerOptions
    from test_server import serving

    _, base = tiered_server
    body = {"prompt": A, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    first = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
    r = httpx.post(base + "/v1/cache/save", json={"prompt": A, "file": "doc-a.kvc"}, timeout=120)
    assert r.status_code == 200 and r.json()["tokens"] == PROMPT_LEN - 1, r.text
    want = httpx.post(base + "/v1/completions", json=body, timeout=120).json()   # a warm hit
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_LEN - 1
    assert first["choices"][0]["text"] == want["choices"][0]["text"]

    restarted = engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=0.01)
    with serving(restarted, ServerOptions(kv_cache_dir=str(cache_dir))) as again:
        r = httpx.post(again + "/v1/cache/restore", json={"file": "doc-a.kvc", "prompt": A}, timeout=120)
        assert r.status_code == 200 and r.json()["blocks"] == (PROMPT_LEN - 1) // 16, r.text
        got = httpx.post(again + "/v1/completions", json=body, timeout=120).json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_LEN - 1
        assert got["choices"] == want["choices"]
        for file, status, words in [("../doc-a.kvc", 400, "file"), ("missing.kvc", 404, "no cache file"),
                                    ("doc-a.kvc", 400, "another prompt")]:
            r = httpx.post(again + "/v1/cache/restore", json={"file": file, "prompt": B}, timeout=120)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_generate_saves_and_loads_a_cache_file(tiny_engine, tmp_path):
    import json

    from click.testing import CliRunner

    from bie_trt.cli import main

    words = "the a of and to in is was it that for on with as by at from".split()
    text = " ".join(random.Random(7).choice(words) for _ in range(300))
    args = ["generate", "--engine", str(tiny_engine), "--prompt", text, "--max-tokens", "4", "--temperature", "0",
            "--device", "cpu", "--json"]
    saved = CliRunner().invoke(main, args + ["--save-cache", str(tmp_path / "doc.kvc")])
    assert saved.exit_code == 0, saved.output
    assert "saved 288 prompt tokens" in saved.stderr
    loaded = CliRunner().invoke(main, args + ["--load-cache", str(tmp_path / "doc.kvc")])
    assert loaded.exit_code == 0, loaded.output
    out, first = json.loads(loaded.stdout), json.loads(saved.stdout)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
    assert out["token_ids"] == first["token_ids"]
    (tmp_path / "doc.kvc").write_bytes((tmp_path / "doc.kvc").read_bytes()[:1000])
    cut = CliRunner().invoke(main, args + ["--load-cache", str(tmp_path / "doc.kvc")])
    assert cut.exit_code == 2 and "truncated" in json.loads(cut.stdout)["error"]   # --json: the error as JSON


@pytest.mark.slow
def test_load_with_a_small_pool_and_a_full_host_tier_leaks_nothing(tiny_engine, tmp_path):
    """The load test's clients (hang-ups and bad bodies included) against a device pool smaller than the
    prompts and a host tier of a few dozen blocks: evictions fill it, it drops its oldest, hits come back
    from it, and no request fails; afterwards no block is held, and the tier never held more than its bound."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "load.json"
    text = " ".join(random.Random(3).choice("the a of and to in is was it that".split()) for _ in range(2000))
    (tmp_path / "words.txt").write_text(text)
    proc = subprocess.run([sys.executable, "scripts/load_test.py", "--engine", str(tiny_engine), "--clients", "4",
                           "--duration", "8", "--max-model-len", "512", "--max-prompt-words", "400",
                           "--max-tokens", "16", "--num-kv-blocks", "8", "--chunked-prefill-size", "32",
                           "--host-kv-cache-gb", "0.0002", "--text", str(tmp_path / "words.txt"), "--out", str(out)],
                          cwd=root, timeout=600, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["server_errors_5xx"] == 0 and result["outcomes"].get("completed", 0) > 0, result
    assert result["kv_blocks_used_after"] == result["kv_blocks_used_before"] == 0
    assert 0 < result["host_kv_used_max_bytes"] <= result["host_kv_capacity_bytes"] == int(0.0002 * 2**30)
    assert result["ok"] and proc.returncode == 0


def test_the_copy_bench_runs_and_round_trips(tmp_path):
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_host_tier import bench_copy

    result = bench_copy(argparse.Namespace(device="cpu", blocks=8))   # asserts each block came back intact
    # 8 blocks of 16 tokens at 36 KiB a token (Llama-3-8B, INT4 with group-64 scales)
    assert result["tokens"] == 128 and result["bytes"] == 128 * 36 * 1024 and result["restore_gb_s"] > 0


def test_a_host_tier_too_small_for_the_prompt_degrades_to_recompute(tiny_engine):
    """A tier of a few blocks: B's evictions push A's blocks through it and out; A's return recomputes
    what is gone, with the same tokens, and nothing fails."""
    warm = engine(tiny_engine, "int4_asym", "none", max_num_seqs=4, num_kv_blocks=None, host_kv_cache_gb=0)
    warm.generate(A, PARAMS)
    want = warm.generate(A, PARAMS)
    small = engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=20e3 / 2**30)   # 20 kB
    small.generate(A, PARAMS)
    small.generate(B, PARAMS)
    again = small.generate(A, PARAMS)
    host = small.stats().host_kv
    assert 0 < host["used_bytes"] <= host["capacity_bytes"] and small.core.blocks.host.num_dropped > 0
    assert again.usage.cached_tokens < 0.95 * PROMPT_LEN
    assert again.token_ids == want.token_ids


def test_a_negative_host_tier_size_is_refused_with_the_fix(tiny_engine):
    from bie_trt.errors import EngineError

    with pytest.raises(EngineError, match=r"host_kv_cache_gb must be >= 0 \(0 turns the host tier off\); got -1"):
        engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=-1)
