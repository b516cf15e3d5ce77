"""The engine's configuration: a leaf package that imports nothing else from the project.

One module per group, each a dataclass checked at construction: model.py (which model, dtype,
generation defaults, CUDA graphs), cache.py (the paged KV cache), scheduler.py (per-step
limits), parallel.py (tensor and data parallelism), load.py (where weights come from),
device.py (which device) and observability.py (logging). engine.py holds EngineConfig, their
aggregate: resolve() against the model directory, and its JSON form for the processes that
receive it. attention.py is the attention backends' capability table, quantization.py decides
whether the weights stay GGUF-quantized, sizes.py parses '2GiB'. args.py holds the
command-line flags, model_arch.py the model's architecture as config.json describes it,
vllm_only_args.py vLLM's flags this engine accepts or refuses, generation_config.py the model's
sampling defaults, and default_model.py, gguf_convert.py and gguf_tensors.py the default model
and GGUF files turned into a Hugging Face-style directory. engine_core/resolve.py resolves a
configuration once.
"""
