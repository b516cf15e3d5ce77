"""The engine's configuration: a leaf package that imports nothing else from the project.

engine.py holds EngineConfig (its groups, their checks, resolve() against the model directory,
and its JSON form for the processes that receive it), args.py the command-line flags,
model_arch.py the model's architecture as config.json describes it, vllm_only_args.py vLLM's
flags this engine accepts or refuses, generation_config.py the model's sampling defaults, and
default_model.py, gguf_convert.py and gguf_tensors.py the default model and GGUF files turned
into a Hugging Face-style directory. engine_core/resolve.py resolves a configuration once.
"""
