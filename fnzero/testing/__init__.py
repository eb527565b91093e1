"""fnzero.testing: tools for testing sharded training code.

run_world(fn, n, ...)     run `fn` on n real gloo ranks on loopback (hard timeout, clear failures)
free_port(), WorldError
GPT, GPTConfig, MLP       small models of any size
text_corpus(), token_batches(...)   byte-level text batches from Python's own documentation
"""

from ._data import text_corpus, token_batches
from ._models import GPT, MLP, GPTConfig
from ._spawn import WorldError, free_port, run_world

__all__ = ["GPT", "GPTConfig", "MLP", "WorldError", "free_port", "run_world", "text_corpus", "token_batches"]
