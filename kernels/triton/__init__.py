"""The Triton kernels, one module per op (kernels/__init__.py describes the layout): the only
modules that import triton, imported only where a Triton kernel runs, on CUDA or in the tests
under TRITON_INTERPRET=1."""
