"""Packed rows and the batch sources (stages 5 and 6 of the pipeline):

    5. rows        stream[r*S : r*S + S + 1]: consecutive rows share one token, so every token is
                   the target of exactly one input
    6. batches     rows in a seeded order reshuffled every epoch (Grain), each split its own.
                   The batch of a step is a function of (config, step) alone, which makes
                   resuming bit-exact.

`batches(cfg, split)` picks the source of `dataset_type`: TextBatches (the text pipeline or token
files) or SyntheticBatches.
"""

from __future__ import annotations

import grain
import jax
import numpy as np

from moebalance.config import Config
from moebalance.data.corpus import corpus_documents, split_documents
from moebalance.data.errors import DataError
from moebalance.data.tokenizer import EOT, load_stream, load_tokenizer
from moebalance.data.tokens import token_stream


# ---------------------------------------------------------------------------------------------
# 5. Packing


def num_rows(stream_len: int, seq_len: int) -> int:
    """Rows of S + 1 tokens, consecutive rows overlapping by one token, that fit the stream."""
    return max(stream_len - 1, 0) // seq_len


def pack_row(stream: np.ndarray, row: int, seq_len: int, eot_id: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row `row` of the stream as (tokens [S+1] int32, mask [S] bool, segment_ids [S] int32).

    tokens = stream[row*S : row*S + S + 1]; input t = tokens[t], target t = tokens[t + 1].
    segment_ids[t]: how many end-of-text tokens precede input t in the row (0 for the first,
    possibly continued, document; the token after end-of-text starts the next segment).
    mask[t]: the target is in the same document as the input, i.e. input t is not end-of-text
    (the end-of-text token itself is predicted; nothing is predicted across documents)."""
    tokens = np.asarray(stream[row * seq_len: row * seq_len + seq_len + 1], np.int32)
    is_eot = tokens[:-1] == eot_id  # [S]
    segment_ids = np.concatenate([[0], np.cumsum(is_eot[:-1])]).astype(np.int32)
    return tokens, ~is_eot, segment_ids


# ---------------------------------------------------------------------------------------------
# 6. Batches


def process_share(cfg: Config, num_processes: int | None, process_index: int | None,
                  global_batch: int | None) -> tuple[int, int, int]:
    """-> (global_batch, local_batch, first global row of this process). num_processes /
    process_index default to jax.process_count() / jax.process_index(); global_batch to
    per_device_batch_size * jax.device_count()."""
    num_processes = jax.process_count() if num_processes is None else num_processes
    process_index = jax.process_index() if process_index is None else process_index
    if global_batch is None:
        global_batch = cfg.per_device_batch_size * jax.device_count()
    if global_batch % num_processes:
        raise DataError(f"config key `per_device_batch_size`: the global batch {global_batch} "
                        f"does not split evenly over {num_processes} processes")
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index {process_index} not in [0, {num_processes})")
    local_batch = global_batch // num_processes
    return global_batch, local_batch, process_index * local_batch


def _check_ids(stream: np.ndarray, split: str, cfg: Config) -> None:
    if stream.size and int(stream.max()) >= cfg.vocab_size:
        raise DataError(f"the {split} stream has token ids >= vocab_size={cfg.vocab_size} (up to "
                        f"{int(stream.max())}): the tokenizer does not fit the model; lower "
                        "`tokenizer_vocab_size` / change `tokenizer_path` or raise `vocab_size`")


class TextBatches:
    """Batches of packed rows of one split, for this process.

    batch(step) -> (tokens [A, B_local, S+1] int32, mask [A, B_local, S] bool,
                    segment_ids [A, B_local, S] int32), NumPy arrays, where A is
    `gradient_accumulation_steps`, B_local = global_batch // num_processes, and global row j of
    micro-batch a of step s is element (s*A + a)*global_batch + j of the row sequence; this
    process holds global rows [process_index*B_local, (process_index + 1)*B_local).

    Row sequence: the split's rows in a seeded order (Grain's index shuffle, seed `cfg.seed` for
    'train', `cfg.seed + 1` for 'eval'), reshuffled each epoch; every row once per epoch, so the
    first num_rows rows of 'eval' are the whole held-out split and a batch is rows from all over
    it (a held-out split smaller than one batch repeats rows within the batch).

    The split's token stream comes from the text pipeline (dataset_type 'text') or from token
    files ('tokens'; `tokenizer` is then `tokenizer_path`'s, or None).

    Attributes: split, tokenizer, eot_id, num_rows, tokens_in_split, global_batch, local_batch.
    """

    def __init__(self, cfg: Config, split: str = "train", num_processes: int | None = None,
                 process_index: int | None = None, global_batch: int | None = None):
        """num_processes, process_index, global_batch: see `process_share`."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.global_batch, self.local_batch, self._first = process_share(
            cfg, num_processes, process_index, global_batch)
        if cfg.dataset_type == "tokens":
            stream, self.eot_id = token_stream(cfg, split)
            self.tokenizer = load_tokenizer(cfg, [])[0] if cfg.tokenizer_path else None
            if self.tokenizer and self.tokenizer.token_to_id(EOT) != self.eot_id:
                raise DataError(f"config key `tokenizer_path`: the tokenizer's {EOT} is id "
                                f"{self.tokenizer.token_to_id(EOT)}, the token files end their "
                                f"documents with eot_id {self.eot_id}; give the tokenizer the "
                                "files were made with")
        else:
            train_docs, eval_docs = split_documents(corpus_documents(cfg), cfg.eval_fraction,
                                                    cfg.seed)
            self.tokenizer, directory = load_tokenizer(cfg, train_docs)
            self.eot_id = self.tokenizer.token_to_id(EOT)
            docs = train_docs if split == "train" else eval_docs
            stream = load_stream(cfg, self.tokenizer, directory, docs, split)
        _check_ids(stream, split, cfg)
        self._stream = stream
        seq_len = cfg.max_target_length
        self.split, self.tokens_in_split = split, len(stream)
        self.num_rows = num_rows(len(stream), seq_len)
        if self.num_rows == 0:
            raise DataError(f"config key `max_target_length`: the corpus is too small; its {split} "
                            f"split has {len(stream)} tokens, fewer than max_target_length + 1 = "
                            f"{seq_len + 1}; add text to dataset_path, lower max_target_length or "
                            "(for the eval split) raise eval_fraction")
        # Grain takes seeds in [0, 2**32); the held-out split has its own order
        rows = grain.MapDataset.range(self.num_rows).shuffle(
            seed=(cfg.seed + (split == "eval")) % 2**32)
        self._rows = rows.repeat().map(lambda r: pack_row(stream, r, seq_len, self.eot_id))
        self._accum = cfg.gradient_accumulation_steps

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This process's share of the batch of optimizer step `step` (see the class docstring)."""
        a, b = self._accum, self.local_batch
        rows = [self._rows[(step * a + micro) * self.global_batch + self._first + j]
                for micro in range(a) for j in range(b)]
        tokens, mask, segment_ids = (np.stack([row[i] for row in rows]).reshape(a, b, -1)
                                     for i in range(3))
        return tokens, mask, segment_ids  # [A, B_local, S+1], [A, B_local, S], [A, B_local, S]

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """[V] int64: how often each token id occurs in this split (for balanced hash tables)."""
        return np.bincount(self._stream, minlength=vocab_size)


class SyntheticBatches:
    """Seeded uniform random token ids with the interface of TextBatches: one document per row,
    every target counted. The 'eval' split is drawn from another seed (cfg.seed + 1)."""

    def __init__(self, cfg: Config, split: str = "train", num_processes: int | None = None,
                 process_index: int | None = None, global_batch: int | None = None):
        self.global_batch, self.local_batch, self._first = process_share(
            cfg, num_processes, process_index, global_batch)
        self._cfg, self._seed = cfg, cfg.seed + (split == "eval")
        self.split, self.num_rows, self.tokenizer = split, None, None

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self._cfg
        a, s = c.gradient_accumulation_steps, c.max_target_length
        rng = np.random.default_rng([self._seed, step])
        tokens = rng.integers(0, c.vocab_size, (a, self.global_batch, s + 1), dtype=np.int32)
        tokens = tokens[:, self._first: self._first + self.local_batch]
        return tokens, np.ones((a, self.local_batch, s), bool), np.zeros(
            (a, self.local_batch, s), np.int32)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """Uniform: every id equally likely."""
        return np.ones(vocab_size, np.int64)


def batches(cfg: Config, split: str = "train", **kwargs) -> TextBatches | SyntheticBatches:
    """The data source of `cfg.dataset_type` for a split ('train' or 'eval')."""
    source = SyntheticBatches if cfg.dataset_type == "synthetic" else TextBatches
    return source(cfg, split, **kwargs)
