"""The compute kernels: the innermost layer, importing nothing from the project but itself.

One layout for every op: kernels/<op>.py holds what runs without Triton, kernels/triton/<op>.py the
op's Triton kernels, and kernels/cpu/<op>.c the C source of its CPU kernel. Only the modules under
kernels/triton/ import triton, and nothing imports them until a Triton kernel is about to run (on
CUDA, or in the tests under TRITON_INTERPRET=1): a CPU process never imports Triton
(tests/test_no_triton_on_cpu.py).
- kernels/triton/<op>.py: the Triton kernel and its launcher;
- in kernels/<op>.py, <name>_cpu: the binding of the C kernel, for fp32 CPU tensors; it checks
  the layout it hands to C (kernels/cpu_binding.py) and calls the library kernels/cpu_library.py
  builds and loads;
- <name>_torch: the op in torch ops, on any device (the path where neither kernel runs), or
  <name>_ref: a slow torch reference the tests compare the kernels against; and the input checks
  and layout predicates (fits, flattens) the launcher and its callers share;
- <name>_for(device): the dispatcher, where the caller takes whichever runs on its device
  (kernels/dispatch.py: the Triton launcher comes from a function that imports its module, called
  only for CUDA); then the Triton launcher is <name>_triton.
An op keeps the parts it has: linear, quant_linear and argmax are C only, paged_decode and
gguf_matmul Triton only (kernels/triton/ alone). Where the caller chooses (an attention backend, a
layer), the Triton launcher has the op's plain name, imported inside the caller's CUDA branch or by
a backend module that is itself imported only when selected, and the C binding the same name ending
in _cpu.
An op whose choice depends on the tensors' layout, not only their device (grammar_bitmask),
dispatches under its plain name.
What both an op's module and its Triton module need lives in a third one (step_inputs:
prepare_inputs' outputs; moe_activation: fused_moe's activations), so that the dispatcher's lazy
import of the Triton module makes no import loop (tests/test_import_direction.py).

The ops: paged_attention, paged_decode (split-K decode), write_kv, mla_attention (latent attention);
fused_moe (mixture of experts); activation (SwiGLU's silu_and_mul), rms_norm, rotary; linear (the
CPU path's blocked GEMMs, with its fused argmax and SwiGLU), quant_linear (GGUF weights on the CPU,
packed by gguf_quant), gguf_matmul (GGUF weights on CUDA, packed by gguf_device); argmax,
grammar_bitmask; prepare_inputs and post_update (a step's inputs and state update, on the device);
decode_stack (the CPU path's fused decode step).
"""
