"""Load an engine directory onto a device: check it, allocate the plan once, run forward steps."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file

from .. import engine_format as ef
from ..config import EngineConfig, KVCacheConfig, ModelConfig
from ..errors import EngineError
from ..kv.pool import KVPools, allocate_pools
from ..model.llama import LlamaModel, SeqInput, centres_keys
from ..plan import kv_pool_blocks
from .cuda_graphs import DecodeGraphs


def pick_device(config: EngineConfig, manifest: dict) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    if torch.cuda.is_available() and ef.check_target(manifest, ef.present_gpu_sm()) is None:
        return torch.device("cuda")
    return torch.device("cpu")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.engine_dir = Path(config.engine_dir)
        self.manifest = ef.read_manifest(self.engine_dir)
        self.device = pick_device(config, self.manifest)
        if self.device.type == "cuda":
            problem = ef.check_target(self.manifest, ef.present_gpu_sm())
            if problem:
                raise EngineError(problem)
        self.dtype = {"auto": torch.float16 if self.device.type == "cuda" else torch.float32,
                      "float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
        self.model_config = ModelConfig.from_dict(self.manifest["model"]["config"])
        self.kv_config = dataclasses.replace(KVCacheConfig(**self.manifest["kv"]), **config.kv_overrides())
        try:
            self.kv_config.validate(self.model_config.head_dim)
        except ValueError as e:
            raise EngineError(str(e)) from None
        built_len = int(self.manifest["max_model_len"])
        self.max_model_len = min(config.max_model_len or built_len, built_len)
        self.max_num_seqs = min(config.max_num_seqs, int(self.manifest["max_num_seqs"]))
        self.chunk_size = config.chunked_prefill_size
        weights_path = self.engine_dir / ef.WEIGHTS
        if not weights_path.exists():
            raise EngineError(f"{weights_path}: missing; the engine directory is incomplete (rebuild it).")
        self._cap_memory()
        placement = self.manifest["plan"]["inputs"].get("embedding_placement", "gpu")
        self.model = LlamaModel(self.model_config, load_file(str(weights_path)), self.device, self.dtype,
                                embedding_on_host=placement == "host",
                                gemv_configs=self.manifest.get("kernels", {}).get("w4_gemv"))
        if centres_keys(self.kv_config) and self.model.key_mean is None:
            raise EngineError(f"{self.engine_dir}: key centering needs the calibrated kv.key_mean this engine "
                              "lacks; rebuild it with this version of bie-trt.")
        n_fp, n_q = kv_pool_blocks(self.model_config, self.kv_config, self.max_model_len, self.max_num_seqs, self.chunk_size)
        if config.num_kv_blocks is not None:  # tests and small hosts shrink the pool on purpose
            n_fp = config.num_kv_blocks
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        # "fp16" KV is stored in the activation dtype: exact fp32 on the CPU reference.
        self.pools: KVPools = allocate_pools(self.model_config, self.kv_config, n_fp, n_q, self.dtype, self.device,
                                             scratch_block=use_graphs)
        self.graphs = None
        if use_graphs:
            sizes = [b for b in self.manifest["profile"]["defaults"]["cuda_graph_batch_sizes"] if b <= self.max_num_seqs]
            if sizes:
                self.graphs = DecodeGraphs(self.model, self.pools, sizes, self.max_model_len, self.pools.scratch_block)

    def _cap_memory(self) -> None:
        """On CUDA, exceeding the plan must be an error, never a silent spill to host memory."""
        if self.device.type != "cuda":
            return
        budget = int(self.manifest["plan"]["budget_bytes"])
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), self.device)

    def forward(self, inputs: list[SeqInput]) -> list[torch.Tensor]:
        if self.graphs is not None and (logits := self.graphs.run(inputs)) is not None:
            return logits
        return self.model.forward(inputs, self.pools)
