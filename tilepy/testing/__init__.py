"""Helpers for checking and timing tilepy kernels: references, tolerances, CUDA-event timing."""
