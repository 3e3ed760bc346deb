"""fasttoken: Prelude's inference-only tokenizer, trusted only after an equality check."""

from prelude.tokenizer.fasttoken.core import ByteStreamDetokenizer, FastTokenizer
from prelude.tokenizer.fasttoken.equality import check, compare, wrap_if_equal
from prelude.tokenizer.fasttoken.spec import Unsupported

__all__ = ["ByteStreamDetokenizer", "FastTokenizer", "Unsupported", "check", "compare", "wrap_if_equal"]
