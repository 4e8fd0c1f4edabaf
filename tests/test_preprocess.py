"""Byte tokenizer + megatron-cp-preprocess: IndexedDataset round trip and a megatron.core GPTDataset
built from the output (CPU, torch.distributed not initialised)."""

import json
import os
import subprocess
import sys

import numpy
import pytest

from megatron_cp_plugin.megatron_lm.preprocess import main, preprocess
from megatron_cp_plugin.megatron.tokenizer import ByteTokenizer

# Blank lines (empty or whitespace-only) are not documents: preprocess skips them.
DOCS = ["hello world", "Grüße aus Köln — ünïcödé ✓ 日本語 🙂", "  leading and trailing spaces  ",
        "x", "the quick brown fox jumps over the lazy dog " * 3]
TEXT = DOCS[0] + "\n\n" + DOCS[1] + "\r\n   \n" + DOCS[2] + "\n" + DOCS[3] + "\n\t\n" + DOCS[4]


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return ds, [ds[i].tolist() for i in range(len(ds))]


def test_tokenizer():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod, tok.eos, tok.pad, tok.bos) == (257, 256, 256, -1, None)
    for d in DOCS:
        ids = tok.tokenize(d)
        assert ids == list(d.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.detokenize(ids + [tok.eod]) == d
        assert tok.detokenize(numpy.array(ids)) == d
    assert tok.detokenize([0xE2, 0x82]) == "\ufffd"  # truncated UTF-8 -> replacement char
    assert len(tok.vocab) == 257 and tok.inv_vocab[256] == "<eod>"
    big = ByteTokenizer(vocab_size=512)
    assert big.vocab_size == 512 and len(big.vocab) == 512 and big.detokenize([104, 300, 105]) == "hi"
    assert json.dumps(big.unique_identifiers)  # GPTDataset hashes it into its cache key
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(vocab_size=256)


def test_text_round_trip(tmp_path, capsys):
    tok = ByteTokenizer()
    src = tmp_path / "corpus.txt"
    src.write_bytes(TEXT.encode("utf-8"))
    prefix = str(tmp_path / "out" / "corpus")  # parent directory is created
    main(["--input", str(src), "--output-prefix", prefix])
    out = capsys.readouterr().out
    assert "5 documents" in out and "3 blank skipped" in out and prefix + ".bin" in out
    ds, seqs = _read(prefix)
    assert ds.index.dtype == numpy.uint16
    assert seqs == [tok.tokenize(d) + [tok.eod] for d in DOCS]
    assert list(ds.document_indices) == list(range(len(DOCS) + 1))  # one sequence per document
    assert [tok.detokenize(s) for s in seqs] == DOCS

    summary = preprocess(str(src), prefix + "_noeod", append_eod=False)
    assert summary["tokens"] == sum(len(d.encode()) for d in DOCS)
    assert _read(prefix + "_noeod")[1] == [tok.tokenize(d) for d in DOCS]


def test_jsonl_round_trip(tmp_path):
    tok = ByteTokenizer()
    src = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"content": d, "id": i}, ensure_ascii=i % 2 == 0) for i, d in enumerate(DOCS)]
    lines.insert(2, "")  # blank line
    lines.insert(3, json.dumps({"content": "  ", "id": -1}))  # blank text
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "j")
    s = preprocess(str(src), prefix, json_key="content")
    assert (s["documents"], s["skipped"]) == (len(DOCS), 2)
    assert _read(prefix)[1] == [tok.tokenize(d) + [tok.eod] for d in DOCS]

    with pytest.raises(SystemExit, match="--json-key 'text'"):  # default key is absent
        main(["--input", str(src), "--output-prefix", str(tmp_path / "k")])
    assert not os.path.exists(str(tmp_path / "k.bin"))  # partial output removed


def test_errors(tmp_path):
    with pytest.raises(SystemExit, match="--input .*no such file"):
        main(["--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "o")])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(SystemExit, match="--input .*no documents"):
        main(["--input", str(empty), "--output-prefix", str(tmp_path / "o")])
    assert not os.path.exists(str(tmp_path / "o.bin")) and not os.path.exists(str(tmp_path / "o.idx"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(SystemExit, match=r"--input .*bad.jsonl:2"):
        main(["--input", str(bad), "--output-prefix", str(tmp_path / "o")])
    with pytest.raises(SystemExit):  # argparse: --output-prefix is required
        main(["--input", str(bad)])


def test_python_m(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("abc\ndéf\n", encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "megatron_cp_plugin.megatron_lm.preprocess", "--input", str(src),
                        "--output-prefix", str(tmp_path / "c"), "--no-append-eod"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "2 documents" in r.stdout and "7 tokens" in r.stdout
    assert _read(str(tmp_path / "c"))[1] == [list(b"abc"), list("déf".encode())]


def make_gpt_dataset_config(prefix, seq_len, cache_dir, seed=1234):
    """The GPTDatasetConfig the pretraining code uses (kept in sync with the report)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([prefix], None),
        split="1,0,0",
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # default True adds a [1, S, S] bool mask to every sample
        path_to_cache=cache_dir,
    )


def test_gpt_dataset(tmp_path):
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    assert not torch.distributed.is_initialized()
    tok = ByteTokenizer()
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT, encoding="utf-8")
    prefix = str(tmp_path / "corpus")
    main(["--input", str(src), "--output-prefix", prefix])
    seq = 16
    num_samples = 40  # > one epoch (~14 samples): the builder repeats the data

    config = make_gpt_dataset_config(prefix, seq, str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    assert isinstance(train, GPTDataset) and valid is None and test is None
    assert len(train) >= num_samples
    assert os.listdir(tmp_path / "cache")  # indices were cached where asked

    eods = 0
    for i in range(len(train)):
        s = train[i]
        assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            assert s[k].shape == (seq,), k
        assert s["tokens"].dtype == torch.int64 and s["loss_mask"].dtype == torch.float32
        tokens, labels = s["tokens"].tolist(), s["labels"].tolist()
        assert tokens[1:] == labels[:-1]  # labels are the tokens shifted by one
        assert all(0 <= t <= tok.eod for t in tokens + labels)
        assert s["position_ids"].tolist() == list(range(seq))
        assert torch.all(s["loss_mask"] == 1.0)
        eods += tokens.count(tok.eod)
        # every EOD-free window is a contiguous piece of one document
        pieces = [p for p in _split(tokens, tok.eod) if p]
        for p in pieces:
            assert any(_contains(tok.tokenize(d), p) for d in DOCS), p
    assert eods > 0

    # Same config again: the cached indices give the same samples.
    again = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True,
        make_gpt_dataset_config(prefix, seq, str(tmp_path / "cache")),
    ).build()[0]
    assert torch.equal(again[3]["tokens"], train[3]["tokens"])


def _split(seq, sep):
    part = []
    for t in seq:
        if t == sep:
            yield part
            part = []
        else:
            part.append(t)
    yield part


def _contains(hay, needle):
    n = len(needle)
    return any(hay[i:i + n] == needle for i in range(len(hay) - n + 1))
