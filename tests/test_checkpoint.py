"""megatron-cp-pretrain --save / --load on CPU processes (gloo), through the GPU code path: Megatron's DDP with
the distributed optimizer, and Megatron-FSDP, in bf16 with fp32 main parameters. A run that saved at iteration
3 and went on to 6 is the reference; a second run resumes from its iteration-3 checkpoint. Their losses and
their final checkpoints (every model, Adam and main-parameter tensor, the schedule, the generators) must be
identical, bit for bit."""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from .ckpt_compare import read_checkpoint, same

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "2",
        "--seq-length", "256", "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--log-interval", "1",
        "--train-iters", "6", "--save-interval", "3", "--nproc", "2", "--bf16",
        "--hidden-dropout", "0.1"]    # dropout draws from the generators: the resume must restore them


def _pretrain(*flags, timeout=300):
    cmd = [sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.pretrain", *TINY, *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.parametrize("layout", [
    ["--use-distributed-optimizer", "--context-parallel-algo", "ring"],
    ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
     "--context-parallel-algo", "attention2d-o"],
], ids=["distributed-optimizer", "fsdp-optim_grads_params"])
def test_resumed_run_equals_uninterrupted_run_bit_for_bit(tmp_path, layout):
    ref, res = tmp_path / "ref", tmp_path / "res"
    _pretrain(*layout, "--save", str(ref), "--log-json", str(tmp_path / "ref.jsonl"))
    start = tmp_path / "start"                        # the reference's iteration-3 checkpoint, alone
    shutil.copytree(ref / "iter_0000003", start / "iter_0000003")
    (start / "latest_checkpointed_iteration.txt").write_text("3")
    info = json.loads((start / "iter_0000003" / "megatron_cp_plugin.json").read_text())
    assert info["iteration"] == 3 and info["distributed_optimizer"] is True
    _pretrain(*layout, "--load", str(start), "--save", str(res), "--log-json", str(tmp_path / "res.jsonl"))

    ref_losses, res_losses = _losses(tmp_path / "ref.jsonl"), _losses(tmp_path / "res.jsonl")
    assert len(ref_losses) == 6 and len(res_losses) == 3
    assert res_losses == ref_losses[3:], (ref_losses, res_losses)       # bit for bit, 3 steps after the resume

    a, b = read_checkpoint(ref / "iter_0000006", tmp_path), read_checkpoint(res / "iter_0000006", tmp_path)
    assert a.keys() == b.keys()
    moments = [k for k in a if "exp_avg" in k]
    assert moments and any(k.startswith("model") for k in a) and any("rng_state" in k for k in a)
    diff = [k for k in a if not same(a[k], b[k])]
    assert not diff, diff[:10]
    # The checkpoints differ from the start's: the comparison is not between two untouched copies.
    s = read_checkpoint(start / "iter_0000003", tmp_path)
    assert not all(same(s[k], a[k]) for k in moments)

    # Resuming with another layout fails at start-up (before any collective), naming both flag sets.
    other = ["--use-megatron-fsdp"] if "--use-distributed-optimizer" in layout else ["--use-distributed-optimizer"]
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.pretrain", *TINY, *other,
                        "--load", str(start)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "iter " not in r.stdout
    assert "--use-distributed-optimizer" in r.stderr and "--use-megatron-fsdp" in r.stderr, r.stderr[-3000:]

    if "--use-megatron-fsdp" in layout:
        # megatron-cp-generate --load of the fsdp_dtensor checkpoint (bf16 run, fp32 main weights in DCP): model
        # arguments and weights come from it, the same tokens at CP = 1 and 2, other tokens from iteration 3 (the
        # weights are read, not left at their seeded initialisation). torch_dist: tests/test_pretrain.py.
        last = _generated(ref, 1)
        assert _generated(ref, 2) == last and _generated(start, 1) != last
        from megatron_cp_plugin.inference.token_check import variety
        ids = [int(x) for x in last.split(":", 1)[1].replace("[", " ").replace("]", " ").replace(",", " ").split()]
        assert variety(ids) is None, (variety(ids), last)        # equal tokens that vary: a wrong merge would show


def _generated(ckpt, nproc):
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.inference.cli", "--nproc", str(nproc),
                        "--load", str(ckpt), "--prompt", "Once upon a time!", "--max-new-tokens", "8",
                        "--context-parallel-algo", "ring"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return next(x for x in r.stdout.splitlines() if x.startswith("tokens:"))


def test_save_onto_a_checkpoint_is_refused_unless_resumed_or_overwrite(tmp_path):
    from megatron_cp_plugin.training.checkpoint import check_save_dir
    from megatron_cp_plugin.training.config import parse_args

    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(ValueError, match=r"--save .* already holds a checkpoint \(iteration 3\) and no --load"):
        check_save_dir(parse_args(["--save", str(ckpt)]))
    with pytest.raises(ValueError, match="--load .* is another directory"):
        check_save_dir(parse_args(["--save", str(ckpt), "--load", str(tmp_path / "other")]))
    check_save_dir(parse_args(["--save", str(ckpt), "--load", str(ckpt)]))          # resume: allowed
    check_save_dir(parse_args(["--save", str(ckpt), "--overwrite"]))                # asked for
    check_save_dir(parse_args(["--save", str(tmp_path / "new")]))                   # nothing there


SMALL = [sys.executable, "-W", "ignore", "-m", "megatron_cp_plugin.pretrain", "--nproc", "2", "--num-layers", "1",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64", "--context-parallel-algo", "ring"]


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("small") / "ckpt"
    cmd = [*SMALL, "--train-iters", "1", "--save", str(ckpt)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return ckpt


def _damage(ckpt, name, how):
    it = ckpt / "iter_0000001"
    if name == "*.distcp":        # the last data file: __0_1 with megatron-core 0.16.1 on CPUs, other names elsewhere
        file = sorted(it.glob("*.distcp"))[-1]
    else:
        file = it / name if name != "tracker" else ckpt / "latest_checkpointed_iteration.txt"
    if not file.exists():
        import megatron.core
        pytest.skip(f"this checkpoint has no {name} (megatron-core {megatron.core.__version__} on "
                    f"{'a GPU' if torch.cuda.is_available() else 'CPUs'})")
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2] if how == "truncate" else b"\x00garbage" * 8)
    return file


@pytest.mark.parametrize("name,how,needle", [
    ("*.distcp", "truncate", "truncated: "),
    (".metadata", "truncate", "unreadable"),
    (".metadata", "garbage", "unreadable"),
    ("common.pt", "garbage", "unreadable"),
    ("metadata.json", "garbage", "not valid JSON"),
    ("megatron_cp_plugin.json", "truncate", "not valid JSON"),
    ("tracker", "garbage", "must hold an iteration number"),
])
def test_damaged_checkpoint_names_the_file(small_checkpoint, tmp_path, name, how, needle):
    from megatron_cp_plugin.training.checkpoint import check_resumable
    from megatron_cp_plugin.training.config import parse_args

    ckpt = tmp_path / "ckpt"
    shutil.copytree(small_checkpoint, ckpt)
    args = parse_args(["--load", str(ckpt)])
    check_resumable(args)                                       # the intact copy passes
    file = _damage(ckpt, name, how)
    with pytest.raises(ValueError) as e:
        check_resumable(args)
    msg = str(e.value)
    assert str(file) in msg and needle in msg and "\n" not in msg, msg


def _index(it):
    """The checkpoint's own (intact) .metadata, unpickled: the test wrote it."""
    with open(it / ".metadata", "rb") as f:
        return pickle.load(f)


def _pickled_values(md):
    """{MetadataIndex: _StorageInfo} of the non-tensor values (torch.save blobs) in the .distcp files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    return {i: s for i, s in md.storage_data.items() if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata)}


def test_garbage_data_file_of_the_right_size_fails_in_one_line(small_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(small_checkpoint, ckpt)
    data = ckpt / "iter_0000001" / "__0_0.distcp"
    md = _index(ckpt / "iter_0000001")
    raw = bytearray(data.read_bytes())           # its tensors' bytes, not its pickled values (checked at start-up)
    for i, info in md.storage_data.items():
        if info.relative_path == data.name and i not in _pickled_values(md):
            raw[info.offset:info.offset + info.length] = b"\x07" * info.length
    data.write_bytes(bytes(raw))                                # passes the size check, fails to unpickle
    r = subprocess.run([*SMALL, "--train-iters", "2", "--load", str(ckpt)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert f"ValueError: checkpoint {ckpt / 'iter_0000001'}: a .distcp data file is damaged" in r.stderr, \
        r.stderr[-3000:]


class _RunsCode:
    """Unpickling it calls exec(), which creates `marker`: what a crafted checkpoint does to run anything."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _plant(it, where, marker):
    """Make one pickle of the checkpoint directory `it` one whose unpickling would create `marker`; its path."""
    if where == "common.pt":
        torch.save({"iteration": 1, "payload": _RunsCode(marker)}, it / "common.pt")
        return it / "common.pt"
    md = _index(it)
    if where == ".metadata":
        md.planner_data = _RunsCode(marker)
        file = it / ".metadata"
    else:                   # a pickled value in a .distcp file (rng_state's, read by every rank): appended there
        values = _pickled_values(md)
        i = min(values, key=lambda i: not i.fqn.startswith("rng_state"))
        file = it / values[i].relative_path
        blob = io.BytesIO()
        torch.save(_RunsCode(marker), blob)
        md.storage_data[i] = dataclasses.replace(values[i], offset=file.stat().st_size, length=len(blob.getvalue()))
        with open(file, "ab") as f:
            f.write(blob.getvalue())
    with open(it / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return file


@pytest.mark.parametrize("where", ["common.pt", ".metadata", "distcp-value"])
def test_load_refuses_a_pickle_that_would_run_code_before_anything_runs_it(small_checkpoint, tmp_path, where):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    shutil.copytree(small_checkpoint, ckpt)
    file = _plant(ckpt / "iter_0000001", where, marker)
    r = subprocess.run([*SMALL, "--train-iters", "2", "--load", str(ckpt)], capture_output=True, text=True,
                       timeout=300)
    assert not marker.exists(), f"the checkpoint's code ran: {r.stderr[-3000:]}"
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "iter " not in r.stdout, r.stderr[-3000:]
    assert lines[0].startswith(f"megatron-cp-pretrain: error: checkpoint file {file}"), lines[0]
    assert "refused: its pickle would call" in lines[0] and "exec" in lines[0], lines[0]

    # megatron-cp-generate --load checks the same files before megatron-core or torch reads them
    from megatron_cp_plugin.inference.checkpoint import checkpoint_path
    with pytest.raises(ValueError, match="refused: its pickle would call"):
        checkpoint_path(str(ckpt))
    assert not marker.exists()
