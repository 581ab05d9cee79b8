"""Triton kernels (rejection sampling, RNG, fused forward ops), each with a torch reference beside it."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU test suite: see common/triton_interpreter.py
    from common.triton_interpreter import install

    install()
