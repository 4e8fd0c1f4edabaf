"""Tokenize a text corpus into a Megatron IndexedDataset (PREFIX.bin / PREFIX.idx).

    megatron-cp-preprocess --input FILE --output-prefix PREFIX [--json-key text]
                           [--append-eod | --no-append-eod]
    python -m megatron_cp_plugin.megatron_lm.preprocess ...   (same)

Input: plain text, one document per line, or JSON lines (FILE ending in .jsonl / .json): one
object per line with the document text under --json-key. The file is read as UTF-8 (a leading
BOM is ignored); the line terminator is not part of a document.

Empty-line policy: blank lines (empty or whitespace-only) are not documents and are skipped, in
both formats; so are JSON objects whose text is empty or whitespace-only. Other whitespace is
kept verbatim. The number skipped is in the summary.

Output: one sequence (and one document) per input document, token ids from ``ByteTokenizer``
(UTF-8 bytes), followed by the EOD id 256 unless --no-append-eod; stored as numpy.uint16.
Read it back with ``megatron.core.datasets.indexed_dataset.IndexedDataset(PREFIX)``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterator, List, Optional, Tuple

from megatron_cp_plugin.megatron.tokenizer import ByteTokenizer

__all__ = ["main", "preprocess", "build_parser", "iter_documents", "token_dtype"]

PROG = "megatron-cp-preprocess"
JSON_SUFFIXES = (".jsonl", ".json")


def _fail(msg: str) -> "SystemExit":
    """A SystemExit whose message (printed to stderr, exit status 1) names the argument."""
    return SystemExit(f"{PROG}: error: {msg}")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``main``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Tokenize text (one document per line) or JSON lines into a Megatron "
        "IndexedDataset PREFIX.bin/PREFIX.idx with the byte-level tokenizer "
        "(ids 0-255 = UTF-8 bytes, 256 = EOD). Blank lines are skipped.",
    )
    p.add_argument("--input", required=True, metavar="FILE",
                   help="plain text, one document per line; .jsonl/.json: one JSON object per line")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin and PREFIX.idx (parent directories are created)")
    p.add_argument("--verbose", action="store_true", help="also show megatron-core's fallback warnings")
    p.add_argument("--json-key", default="text", metavar="KEY",
                   help="key of the document text in JSON lines input (default: text)")
    eod = p.add_mutually_exclusive_group()
    eod.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                     help="append the EOD id (256) to every document (default)")
    eod.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                     help="do not append EOD")
    return p


def token_dtype(vocab_size: int):
    """Smallest numpy dtype for the ids: uint16 up to 65536 ids, else int32 (as GPTDataset)."""
    import numpy

    return numpy.uint16 if vocab_size <= numpy.iinfo(numpy.uint16).max + 1 else numpy.int32


def iter_documents(
    path: str, json_key: Optional[str] = None
) -> Iterator[Tuple[int, Optional[str]]]:
    """Yield (line number, document text) per line; text is None for a skipped blank document.

    ``json_key`` None means plain text, otherwise every line is a JSON object holding the text
    under that key. Raises SystemExit naming --input / --json-key on malformed lines.
    """
    with open(path, "r", encoding="utf-8-sig") as f:
        lineno = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                raise _fail(f"--input {path}: not valid UTF-8: {e}") from e
            if not line:
                return
            lineno += 1
            if line.endswith("\n"):
                line = line[:-1]
            if not line.strip():
                yield lineno, None
                continue
            if json_key is None:
                yield lineno, line
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(f"--input {path}:{lineno}: not a JSON object: {e}") from e
            if not isinstance(obj, dict):
                raise _fail(f"--input {path}:{lineno}: expected a JSON object, got "
                            f"{type(obj).__name__}")
            if json_key not in obj:
                raise _fail(f"--json-key {json_key!r}: missing in --input {path}:{lineno} "
                            f"(keys: {sorted(obj)[:10]})")
            text = obj[json_key]
            if not isinstance(text, str):
                raise _fail(f"--json-key {json_key!r}: value in --input {path}:{lineno} is "
                            f"{type(text).__name__}, not a string")
            yield lineno, (text if text.strip() else None)


def preprocess(input_path: str, output_prefix: str, json_key: str = "text",
               append_eod: bool = True) -> dict:
    """Tokenize ``input_path`` into ``output_prefix``.bin/.idx (see the module docstring).

    Returns a summary dict: documents, skipped, tokens, bin, idx. Raises SystemExit (message
    naming --input / --output-prefix / --json-key) on bad input.
    """
    path = input_path
    if not os.path.exists(path):
        raise _fail(f"--input {path}: no such file")
    if not os.path.isfile(path):
        raise _fail(f"--input {path}: not a regular file")
    if not output_prefix or output_prefix.endswith(os.sep):
        raise _fail(f"--output-prefix {output_prefix!r}: needs a file name part")
    is_json = path.lower().endswith(JSON_SUFFIXES)
    key = json_key if is_json else None

    # megatron.core is imported only now: it takes seconds, and argument errors should not wait.
    import numpy
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    tokenizer = ByteTokenizer()
    dtype = token_dtype(tokenizer.vocab_size)
    bin_path, idx_path = get_bin_path(output_prefix), get_idx_path(output_prefix)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    eod = numpy.array([tokenizer.eod], dtype=dtype)

    n_docs = n_skipped = n_tokens = 0
    builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
    try:
        for _, text in iter_documents(path, key):
            if text is None:
                n_skipped += 1
                continue
            # == tokenizer.tokenize(text), without a Python list per byte
            ids = numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8).astype(dtype)
            if append_eod:
                ids = numpy.concatenate([ids, eod])
            builder.add_document(ids, [int(ids.size)])  # one sequence == one document
            n_docs += 1
            n_tokens += int(ids.size)
        if n_docs == 0:
            raise _fail(f"--input {path}: no documents (the file is empty or has only blank "
                        f"lines{'' if key is None else ' / blank texts'})")
        builder.finalize(idx_path)
    except BaseException:
        builder.data_file.close()
        for p in (bin_path, idx_path):
            if os.path.exists(p):
                os.remove(p)
        raise

    summary = {"documents": n_docs, "skipped": n_skipped, "tokens": n_tokens,
               "bin": bin_path, "idx": idx_path}
    print(f"{PROG}: {n_docs} documents ({n_skipped} blank skipped), {n_tokens} tokens "
          f"({'with' if append_eod else 'without'} EOD, {numpy.dtype(dtype).name}) "
          f"-> {bin_path}, {idx_path}", flush=True)
    return summary


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point: parse ``argv`` (default sys.argv[1:]) and run ``preprocess``."""
    args = build_parser().parse_args(argv)
    preprocess(args.input, args.output_prefix, json_key=args.json_key,
               append_eod=args.append_eod)


if __name__ == "__main__":
    main()
