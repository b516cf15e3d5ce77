"""The compute kernels: the innermost layer, importing nothing from the project but itself.

One layout for every op: one module per op, kernels/<op>.py, holding that op's implementations
side by side, and kernels/cpu/<op>.c the C source of its CPU kernel. In an op's module:
- the Triton kernel and its launcher (CUDA; the tests run it under TRITON_INTERPRET=1);
- <name>_cpu: the binding of the C kernel, for fp32 CPU tensors; it checks the layout it hands
  to C (kernels/cpu_binding.py) and calls the library kernels/cpu_library.py builds and loads;
- <name>_torch: the op in torch ops, on any device (the path where neither kernel runs), or
  <name>_ref: a slow torch reference the tests compare the kernels against;
- <name>_for(device): the dispatcher, where the caller takes whichever runs on its device
  (kernels/dispatch.py); then the Triton launcher is <name>_triton.
An op keeps the parts it has: linear, quant_linear and argmax are C only, paged_decode and
gguf_matmul Triton only. Where the caller chooses (an attention backend, a layer), the Triton
launcher has the op's plain name and the C binding the same name ending in _cpu.
An op whose choice depends on the tensors' layout, not only their device (grammar_bitmask),
dispatches under its plain name.

The ops: paged_attention, paged_decode (split-K decode), write_kv; activation (SwiGLU's
silu_and_mul), rms_norm, rotary; linear (the CPU path's blocked GEMMs, with its fused argmax and
SwiGLU), quant_linear (GGUF weights on the CPU, packed by gguf_quant), gguf_matmul (GGUF weights
on CUDA, packed by gguf_device); argmax, grammar_bitmask; prepare_inputs and post_update (a
step's inputs and state update, on the device); decode_stack (the CPU path's fused decode step).
"""
