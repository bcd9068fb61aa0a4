"""The Llama-family model: config, weight loaders (GGUF, safetensors) and the
serving decoder that runs flattened batches over the paged KV cache."""

from worker.model.model_config import ModelConfig
from worker.model.llama import LlamaDecoder
from worker.model.loader import load_weights

__all__ = ["LlamaDecoder", "ModelConfig", "load_weights"]
