"""Tokenize a jsonl corpus into Megatron ``.bin/.idx`` files (same flags as Megatron-LM's).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/my \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --append-eod --workers 2

Writes ``{output-prefix}_{key}_document.{bin,idx}`` for each ``--json-keys`` key. See
``megazero/data/preprocess.py`` (also ``python -m megazero.data.preprocess``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
