"""The prompt store: prompt prefixes' target caches in blocks, in memory and on disk.

`PromptStore` (store.py) keeps them; `keys.py` says what makes a block valid and keys it;
`disk.py` writes and reads block files. A `PromptCache(store=...)` uses one.
"""

from .disk import BadBlock
from .keys import CACHE_FORMAT
from .store import GB, Block, Link, PromptStore

__all__ = ["CACHE_FORMAT", "GB", "BadBlock", "Block", "Link", "PromptStore"]
