"""Triton kernels of gpukv, one module per concern."""
