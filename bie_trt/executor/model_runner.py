"""Load an engine directory onto a device: check it, allocate the plan once, and do every step's
device work (copies, quantisations and host-tier moves the block manager decided, inputs, the forward,
CUDA graphs)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .. import engine_format as ef
from ..config import EngineConfig
from ..devices import available_host_memory as _available_memory, check_device_name, concrete
from ..errors import EngineError
from ..integrity import check_engine_files
from ..kernels import ops
from ..kernels.kernel_cache import use_engine_kernels
from ..kernels.step_inputs import SeqInput
from ..kv.host_pool import HostPool, block_bytes
from ..kv.pool import KVPools, allocate_kv
from ..kv.recurrent import allocate_recurrent
from ..kv.sizing import kv_pool_blocks, sliding_pool_blocks
from ..model.cuda_graphs import DecodeGraphs
from ..model.llama import centres_keys, model_class, scales_keys
from ..plan import host_bytes, linear_shapes
from ..resolve import resolve
from ..sampling import make_generator
from ..sampling_params import SamplingParams
from ..user_cache import cache_dir
from ..cache_tiers.block_manager import BlockManager, Copy, OutOfBlocks, Quantisation
from ..cache_tiers.exact_rows import join_runs
from ..cache_tiers.host_cache import Drop, Offload, Restore
from ..cache_tiers.state_snapshots import StateSnapshots
from .scheduler import Move, ScheduledBatch, Scheduler
from .sequence import Sequence


log = logging.getLogger(__name__)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:   # truncated or garbled (served with --skip-verify)
        raise EngineError(f"{path}: unreadable ({e}); rebuild the engine with `bie-trt build`.") from None


def quantise_blocks(pools: KVPools, pairs: list[Quantisation]) -> None:
    """Quantise each (FP16 block, quantised block) pair the block manager's compaction returned."""
    for fp_block, q_block in pairs:
        ops.quantize_block(pools, fp_block, q_block)


def apply_moves(pools: KVPools, host: HostPool, moves: list[Move]) -> None:
    """The block manager's quantisations and host-tier moves, in the order it decided them (each may
    read a block a later one reuses)."""
    for move in moves:
        if isinstance(move, Offload):
            host.offload(move.entry, move.slot)
        elif isinstance(move, Restore):
            host.restore(move.slot, move.entry)
        elif isinstance(move, Drop):
            host.drop(move.slot)
        else:
            quantise_blocks(pools, [move])


def copy_blocks(pools: KVPools, copies: list[Copy]) -> None:
    """Copy-on-write: every layer's K and V of each source FP16 block into its destination."""
    if copies:
        src, dst = (torch.tensor(ids, device=pools.k.device) for ids in zip(*copies))
        pools.k[:, dst] = pools.k[:, src]
        pools.v[:, dst] = pools.v[:, src]


def pick_device(config: EngineConfig, manifest: ef.Manifest) -> torch.device:
    if config.device != "auto":
        return concrete(check_device_name(config.device))
    if torch.cuda.is_available() and ef.check_target(manifest.target, ef.present_gpu_sm()) is None:
        return concrete("cuda")
    return torch.device("cpu")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.engine_dir = Path(config.engine_dir)
        self.manifest = ef.read_manifest(self.engine_dir)
        self.manifest_digest = ef.sha256_file(self.engine_dir / ef.MANIFEST)
        self.settings = resolve(config, self.manifest)   # before hashing: refuse what the plan cannot hold
        if not config.skip_verify:
            check_engine_files(self.engine_dir, self.manifest)
        self.device = pick_device(config, self.manifest)
        if self.device.type == "cuda":
            problem = ef.check_target(self.manifest.target, ef.present_gpu_sm())
            if problem:
                raise EngineError(problem)
        self.dtype = {"auto": torch.float16 if self.device.type == "cuda" else torch.float32,
                      "float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
        self.model_config = self.manifest.model
        self.kv_config = self.settings.kv
        self.max_model_len = self.settings.max_model_len
        self.max_num_seqs = self.settings.max_num_seqs
        self.chunked_prefill_size = self.settings.chunked_prefill_size
        weights_path = self.engine_dir / ef.WEIGHTS
        if not weights_path.exists():
            raise EngineError(f"{weights_path}: missing; the engine directory is incomplete (rebuild it).")
        self._cap_memory()
        if self.device.type == "cuda":   # before the first kernel compiles
            use_engine_kernels(self.engine_dir, self.manifest.files, self.manifest.triton_version, cache_dir())
        self.model = model_class(self.model_config)(
            self.model_config, load_weights(weights_path), self.device, self.dtype,
            embedding_on_host=self.manifest.plan.embedding_placement == "host",
            gemv_configs=self.manifest.w4_gemv_configs, keep_dense=self._dense_fits())
        if centres_keys(self.kv_config) and self.model.key_mean is None:
            raise EngineError(f"{self.engine_dir}: key centering needs the calibrated kv.key_mean this engine "
                              "lacks; rebuild it with this version of bie-trt.")
        if scales_keys(self.kv_config) and self.model.key_scale is None:
            raise EngineError(f"{self.engine_dir}: the key scale needs the calibrated kv.key_scale this engine "
                              "lacks; rebuild it with this version of bie-trt, or run it with --no-kv-key-scale.")
        sizes = (self.model_config, self.kv_config, self.max_model_len, self.max_num_seqs, self.chunked_prefill_size)
        n_fp, n_q = kv_pool_blocks(*sizes)
        n_sliding = sliding_pool_blocks(*sizes)
        if config.num_kv_blocks is not None:  # tests and small hosts shrink the pool on purpose
            n_fp = config.num_kv_blocks
        # (the DeltaNet step is not captured yet: a model with linear-attention layers runs eagerly)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and not self.model_config.linear_layers
        # "fp16" KV is stored in the activation dtype: exact fp32 on the CPU reference.
        # a hybrid model's sliding layers in pools.sliding, sized by the same formula as the plan's
        self.pools: KVPools = allocate_kv(self.model_config, self.kv_config, n_fp, n_q, n_sliding, self.dtype,
                                          self.device, scratch_block=use_graphs)
        if self.model_config.linear_layers:   # a state slot for each sequence that may run at once, and the plan's
            # snapshot slots for prefix hits (an engine planned without them has none: prefix caching off)
            self.pools.recurrent = allocate_recurrent(self.model_config, self.max_num_seqs, self.dtype, self.device,
                                                      int(self.manifest.plan.inputs.get("state_snapshots") or 0))
        if config.state_snapshot_interval < 0 or config.state_snapshot_interval % self.kv_config.block_size:
            raise EngineError(f"state_snapshot_interval {config.state_snapshot_interval} must be 0 or a positive "
                              f"multiple of the KV block size {self.kv_config.block_size}.")
        self.state_snapshot_interval = config.state_snapshot_interval
        try:
            self.host_bytes = host_bytes(config.host_kv_cache_gb, _available_memory())
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.host_pool = HostPool(self.pools)
        self.block_bytes = block_bytes(self.pools)
        self.graphs = None
        if use_graphs:
            if self.settings.cuda_graph_batch_sizes:
                self.graphs = DecodeGraphs(self.model, self.pools, list(self.settings.cuda_graph_batch_sizes),
                                           self.max_model_len, self.pools.scratch_block)
        if self.device.type == "cuda":
            self.warm_up()

    def prefix_caching(self, asked: bool) -> bool:
        """Whether this engine's prefix cache can be on. With linear-attention layers only if the plan holds
        snapshot slots: a hit skips their tokens too, so it must resume from their state saved at its end."""
        states = self.pools.recurrent
        if asked and states is not None and not states.num_snapshots:
            log.warning("prefix caching off: this engine's plan holds no recurrent state snapshots, which a hit on "
                        "a model with linear-attention layers resumes from; rebuild it with this version of bie-trt")
            return False
        return asked

    def block_manager(self, enable_prefix_caching: bool = False, host_bytes: int = 0) -> BlockManager:
        """A block manager over this runner's pools: every cache group of a hybrid model (the sliding layers'
        blocks, the linear-attention layers' snapshots)."""
        sliding, states = self.pools.sliding, self.pools.recurrent
        caching = self.prefix_caching(enable_prefix_caching)
        if caching and host_bytes and states is not None:
            log.info("host KV tier off: the linear-attention layers' state snapshots stay on the device, and a "
                        "hit restored from the host would need them")
        return BlockManager(self.kv_config, self.pools.num_fp_blocks, self.pools.num_quant_blocks, caching,
                            host_bytes, self.block_bytes,
                            sliding_window=int(self.model_config.sliding_window or 0) if sliding else 0,
                            num_sliding_blocks=sliding.num_fp_blocks if sliding else 0,
                            snapshots=StateSnapshots(states.snapshot_slots, self.state_snapshot_interval)
                            if caching and states is not None else None)

    def _dense_fits(self) -> bool:
        """The CPU path keeps every dequantised weight matrix (fast, but 4 bytes a weight in fp32) only
        when that takes at most half the memory available; otherwise it dequantises each layer as it
        runs, so an 8B engine (28 GB dense) is slow on a small host rather than killed."""
        if self.device.type != "cpu":
            return True
        weights = self.model_config.num_layers * sum(i * o for _, i, o in linear_shapes(self.model_config))
        available = _available_memory()
        return available is None or weights * self.dtype.itemsize <= available // 2

    def _cap_memory(self) -> None:
        """On CUDA, exceeding the plan must be an error, never a silent spill to host memory."""
        if self.device.type != "cuda":
            return
        budget = self.manifest.plan.budget_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), self.device)

    def warm_up(self) -> None:
        """One of each step serving launches, so that every kernel is compiled (or loaded from the
        engine's kernels) before the first request: prefill chunks of each kind of size, blocks
        leaving the window (the quantiser), short prompts beside a decode, and decodes of
        1..max_num_seqs rows, each through `execute` and `Scheduler.postprocess` as serving runs them. Its
        own block manager and scheduler: the pools are scratch until requests own blocks.

        Chunk sizes: Triton specialises integer arguments on being a multiple of 16, and the W4
        tiles grow with the rows (16, 32, 64), so one size of each kind, at start positions that
        are and are not multiples of 16."""
        blocks = self.block_manager()
        n, chunk = self.max_num_seqs, self.chunked_prefill_size
        scheduler = Scheduler(blocks, n, chunk + n, chunk, states=self.pools.recurrent)
        chunks = [k for k in (chunk, chunk - 1, 15, 16, 31, 32) if 0 < k <= chunk]
        if sum(chunks) > self.max_model_len - 2 * n and chunk > 48:
            chunks[:2] = [48, 47]   # the same kinds of launch as a full chunk (W4 BLOCK_M 64, rows % 16 == 0 or not)
        while sum(chunks) > self.max_model_len - 2 * n:   # the long prompt then decodes 2n - 1 times
            chunks.pop(0)
        vocab = self.model_config.vocab_size
        seqs = [Sequence([t % vocab for t in range(length)], SamplingParams(), make_generator(SamplingParams(), 0))
                for length in [sum(chunks)] + [17] * (n - 1)]

        def step(work: list[tuple[Sequence, int]]) -> None:
            copies = []
            for seq, k in work:
                try:
                    copies += blocks.grow(seq, seq.num_cached + k)
                except OutOfBlocks:   # a pool shrunk on purpose (num_kv_blocks): warm what fits
                    return
            self.execute(scheduler.batch(work, copies, {}))
            for seq, k in work:
                scheduler.postprocess(seq, k, had_lookahead=False)

        first, rest = seqs[0], seqs[1:]
        for k in chunks:
            step([(first, k)])
        for seq in rest:   # each short prompt beside a decode of the long one
            first.output_ids.append(0)
            step([(seq, seq.num_pending), (first, 1)])
        for batch in range(1, n + 1):
            for seq in seqs[:batch]:
                seq.output_ids.append(0)
            step([(seq, 1) for seq in seqs[:batch]])
        self.launch_moves(scheduler.take_moves())
        if self.graphs is not None:   # they count the steps served, not these
            self.graphs.reset_counts()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_verify_graphs(self, num_speculative_tokens: int) -> None:
        """CUDA graphs of the speculative verify step (γ+1 rows a sequence) at the decode graphs' batch
        sizes; nothing off the GPU or with --enforce-eager."""
        if self.graphs is not None and num_speculative_tokens > 0:
            self.graphs.add_verify([num_speculative_tokens + 1])
            torch.cuda.synchronize(self.device)

    def launch_moves(self, moves: list[Move]) -> None:
        """The block manager's quantisations and host-tier moves, in order, on this runner's pools."""
        apply_moves(self.pools, self.host_pool, moves)

    def execute(self, batch: ScheduledBatch, drafts: dict[Sequence, list[int]] | None = None) -> list[torch.Tensor]:
        """One scheduled step on the device: the block manager's quantisations and host-tier moves, then its
        copies (both read blocks that later writes may reuse), then the forward. -> each chunk's logits: [V],
        or [1 + k, V] for a decode followed by its k proposals in `drafts`."""
        self.launch_moves(batch.moves)
        copy_blocks(self.pools, batch.copies)
        if self.pools.recurrent is not None:   # a verify's log starts afresh (one cut short by a failure is stale)
            for seq in drafts or {}:
                self.pools.recurrent.drop_log(seq.state_slot)
        inputs, num_runs, all_logits = self.prepare_inputs(batch, drafts or {})
        return join_runs(self.forward(inputs, batch.layer_quantisations), num_runs, all_logits)

    @staticmethod
    def prepare_inputs(batch: ScheduledBatch, drafts: dict[Sequence, list[int]]
                       ) -> tuple[list[SeqInput], list[int], list[bool]]:
        """Each chunk's tokens from its first uncached one, with the proposals verified after it: one input
        per run of rows (the batch's views, cut to the proposals that came). -> (inputs, runs per chunk,
        whether each chunk wants every row's logits)."""
        inputs, num_runs, all_logits = [], [], []
        for seq, n in batch.chunks:
            extra, saves = drafts.get(seq, []), batch.saves.get(seq, [])
            ids = torch.tensor(seq.token_slice(seq.num_cached, seq.num_cached + n) + extra)
            views = [(row, min(rows, len(ids) - row), table)
                     for row, rows, table in batch.views.get(seq, [(0, len(ids), seq.block_table)]) if row < len(ids)]
            # (a dense model's sequences have no sliding table: [] -> None)
            # a verify logs its linear-attention layers' inputs, for `keep_rows` to roll back the rejected ones
            # a state saved after position p: by the input whose rows end at or past it
            inputs += [SeqInput(ids[row:row + rows], seq.num_cached + row, table, all_logits=bool(extra),
                                sliding_table=seq.sliding_table or None, state_slot=seq.state_slot,
                                log_state=bool(extra),
                                save_states=[(p - seq.num_cached - row, slot) for p, slot in saves
                                             if row < p - seq.num_cached <= row + rows])
                       for row, rows, table in views]
            num_runs.append(len(views))
            all_logits.append(bool(extra))
        return inputs, num_runs, all_logits

    def keep_rows(self, seq: Sequence, keep: int) -> None:
        """After seq's verify: its linear-attention layers' state as after the first `keep` rows (the pending
        token and the accepted proposals), the rejected ones rolled back (LlamaModel.roll_back_recurrent)."""
        states = self.pools.recurrent
        if states is None:
            return
        if keep < states.logged_rows(seq.state_slot):
            self.model.roll_back_recurrent(self.pools, seq.state_slot, keep)
        states.drop_log(seq.state_slot)

    def forward(self, inputs: list[SeqInput], quantise: list[Quantisation] = ()) -> list[torch.Tensor]:
        """Each input's logits; `quantise`: blocks the step writes and later rows read quantised, which the
        forward quantises layer by layer between the K/V write and attention (graphs never hold those)."""
        if self.graphs is not None and (logits := self.graphs.run(inputs, bool(quantise))) is not None:
            return logits
        return self.model.forward(inputs, self.pools, quantise)
