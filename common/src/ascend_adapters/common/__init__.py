"""Shared layer of the ascend-adapters distributions.

Importing this package is cheap: it imports neither torch nor vLLM. Submodules
that need them (dispatch kernels, quant methods, the test layer) import them
themselves.
"""

__version__ = "0.1.0"
