"""The harnesses' YAML loader lives in the library (``kvcompress.config``); re-exported for the CLIs in eval/."""

from kvcompress.config import CHECKOUT_ROOT as REPO_ROOT
from kvcompress.config import load_yaml

__all__ = ["REPO_ROOT", "load_yaml"]
