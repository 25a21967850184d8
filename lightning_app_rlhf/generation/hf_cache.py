"""How a Hugging Face causal LM takes and returns its KV cache, for the installed transformers release.

transformers 5.24 renamed the forward argument and the output field ``past_key_values`` to ``cache``; the old name
warns there (a ``FutureWarning``) and goes in 5.40. Every decode loop of ours passes and reads the cache through
these two helpers, so each release gets its own public name and no call of ours runs into a deprecation.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

CACHE_ARGUMENT = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
"""The keyword a causal LM's ``forward`` takes its KV cache by (and the output field that returns it)."""


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{CACHE_ARGUMENT: cache}``: the keyword argument that hands ``cache`` to a causal LM's forward."""
    return {CACHE_ARGUMENT: cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a causal LM's forward returned in ``output``."""
    return getattr(output, CACHE_ARGUMENT)
