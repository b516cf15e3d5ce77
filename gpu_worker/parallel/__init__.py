"""Tensor parallelism: the process group of the ranks and the layers that split across them."""
