"""Triton kernels: binned RPNys (``rpnys``), weighted attention for decode and prefill (``weighted_decode``,
``weighted_prefill``, host side in ``launch``), the reference queries' attention mass (``attention_mass``) and the
fit's products (``fit_products``).

Submodules import triton; import them lazily. Set ``TRITON_INTERPRET=1`` before importing one to run it on CPU.
"""
