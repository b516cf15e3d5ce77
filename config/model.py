"""ModelConfig: which model, in which dtype, with which generation defaults and CUDA graphs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from config.errors import ConfigError

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# vLLM's --quantization names this engine runs (config/quantization.py resolves them).
QUANTIZATIONS = ("gguf", "fp8", "gptq", "awq", "compressed-tensors", "modelopt", "fbgemm_fp8")


@dataclass(slots=True)
class ModelConfig:
    """Which model, in which dtype, how long a sequence may get."""

    model: str | None = None
    tokenizer: str | None = None
    # vLLM's --revision, --tokenizer-revision (default: revision) and --hf-token (a token, or True
    # for huggingface_hub's saved one): a Hub model's branch, tag or commit (config/hub.py).
    # EngineConfig.resolve() drops hf_token: the resolved configuration travels in argv.
    revision: str | None = None
    tokenizer_revision: str | None = None
    hf_token: str | bool | None = None
    # One name or several (vLLM's list): the API answers to each; the first is the one reported
    # (responses, metrics). None: the --model value. served_model_names holds them all.
    served_model_name: str | list[str] | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    max_logprobs: int = 20
    # 'gguf': linear weights stay as the GGUF file quantizes them, run by the CPU kernels with
    # float32 activations. None: resolve() picks 'gguf' for a GGUF model (a .gguf file or the
    # default model) on the CPU when dtype is 'auto'; an explicit dtype dequantizes at load.
    # Else the quant_method of a quantized checkpoint's config.json, which resolve() fills when
    # None ('fp8' on a dense checkpoint quantizes it at load): config/quantization.py.
    quantization: str | None = None
    # vLLM's --enforce-eager: no CUDA graphs (on the CPU every step is eager anyway).
    enforce_eager: bool = False
    # vLLM's --cuda-graph-sizes: one value N captures decode batches of 1, 2, 4 and multiples
    # of 8 up to N; several values capture exactly those. None: N = max_num_seqs. Capped at
    # max_num_seqs either way (cuda_graph_capture_sizes()).
    cuda_graph_sizes: list[int] | None = None
    # vLLM's --trust-remote-code: accepted; the loader never runs a model's own code (it says
    # so once when a model's config.json asks for it through auto_map).
    trust_remote_code: bool = False
    # 'auto': the model's generation_config.json gives defaults to requests that leave a
    # sampling field unset (engine_core.generation_config); 'vllm': none; else a folder.
    generation_config: str = "auto"
    # Merged over those defaults, e.g. {"temperature": 0.5}: a dict or its JSON text.
    override_generation_config: dict[str, Any] | str | None = None
    served_model_names: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._check_served_names()
        if isinstance(self.override_generation_config, str):
            try:
                self.override_generation_config = json.loads(self.override_generation_config)
            except ValueError as e:
                raise ConfigError(f"override_generation_config is not valid JSON: {e}") from None
        if not isinstance(self.override_generation_config, (dict, type(None))):
            raise ConfigError(
                "override_generation_config must be a JSON object, e.g. '{\"temperature\": 0.5}'"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be -1 or non-negative, got {self.max_logprobs}")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise ConfigError(
                f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}"
            )
        if self.cuda_graph_sizes is not None and self.enforce_eager:
            raise ConfigError(
                "cuda_graph_sizes asks for CUDA graphs, which enforce_eager turns off: pass one"
            )

    def _check_served_names(self) -> None:
        names = self.served_model_name
        if names is None:
            return
        if isinstance(names, str):
            names = [names]
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                f"served_model_name must be a non-empty name or list of names, "
                f"got {self.served_model_name!r}"
            )
        if self.served_model_names[:1] == names:  # decoded (EngineConfig.encode): both kept
            return
        self.served_model_names = list(dict.fromkeys(names))
        self.served_model_name = names[0]
