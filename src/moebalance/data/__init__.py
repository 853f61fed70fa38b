"""Text data: a corpus of local files, a cached byte-level BPE, packed rows, and seeded batches.

The pipeline, its tokenizer and streams cached under `data_cache_dir` so a second run starts at
once (each module's docstring says more about its stages):
    corpus.py      1. corpus: the documents of `dataset_path` (text files, and records of
                      JSON Lines and Parquet files, read by records.py)
                   2. split: training or held-out, by a stable hash of each document's name
    tokenizer.py   3. tokenizer: a byte-level BPE trained on the training split, or `tokenizer_path`
                   4. streams: per split, the documents' ids and <|endoftext|>, concatenated
    tokens.py      4. streams read from pre-tokenized token files instead (dataset_type 'tokens')
    batching.py    5. rows: overlapping windows of S + 1 tokens of a stream
                   6. batches: rows in a seeded order, reshuffled every epoch; a step's batch is
                      a function of (config, step) alone.  Also synthetic tokens.
    errors.py      DataError, raised by all of them

`batches(cfg, split)` is the entry point; the names below are the package's interface.
"""

from moebalance.data.batching import (SyntheticBatches, TextBatches, batches, num_rows,
                                      pack_row)
from moebalance.data.corpus import Document, corpus_documents, corpus_files, split_documents
from moebalance.data.errors import DataError
from moebalance.data.tokenizer import EOT, read_tokenizer, train_tokenizer

__all__ = ["EOT", "DataError", "Document", "SyntheticBatches", "TextBatches", "batches",
           "corpus_documents", "corpus_files", "num_rows", "pack_row", "read_tokenizer",
           "split_documents", "train_tokenizer"]
