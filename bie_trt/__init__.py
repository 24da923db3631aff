"""bie-trt: AWQ 4-bit Llama-family engines with a fixed memory plan (64k context in 8 GB)."""
from .config import EngineConfig, KVCacheConfig, ModelConfig, SpeculativeConfig
from .errors import BieError, CheckpointError, EngineError, PlanError, RequestError
from .executor.engine import BieEngine
from .executor.engine_core import EngineCore
from .executor.outputs import ChatOutput, RequestOutput, StreamEvent
from .sampling_params import SamplingParams, StructuredOutputs

__all__ = [
    "BieEngine", "ChatOutput", "EngineCore", "EngineConfig", "SamplingParams", "KVCacheConfig", "ModelConfig", "RequestOutput",
    "SpeculativeConfig", "StreamEvent", "StructuredOutputs", "BieError", "CheckpointError", "EngineError", "PlanError", "RequestError",
]
