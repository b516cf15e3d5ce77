"""Reasoning parsers (--reasoning-parser, vLLM's names): a reasoning model's thinking read out of
its answer, into the chat reply's `reasoning` (and `reasoning_content`), streamed or not.

stream.py is the contract (ReasoningStream splits one choice's text as it arrives), parser.py the
base of a family's parser, one file per family (deepseek_r1, qwen3, granite), registry.py the
names, chat.py what chat completions asks of them. gpt-oss's reasoning is a harmony channel
(frontend/serving_harmony.py), named openai_gptoss here only to be checked against the model.
"""
