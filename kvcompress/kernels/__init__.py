"""Triton kernels (binned RPNys in ``rpnys``, weighted decode attention in ``weighted_decode``).

Submodules import triton; import them lazily. Set ``TRITON_INTERPRET=1`` before importing one to run it on CPU.
"""
