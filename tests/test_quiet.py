"""Quiet by default: megatron-core's TE / Apex fallback warnings are filtered in one place (quiet.py), in the
process and in the processes it starts; MEGATRON_CP_VERBOSE=1 (or set_verbose) shows them."""
import os
import subprocess
import sys

CODE = ("import megatron_cp_plugin, subprocess, sys\n"
        "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs\n"
        "subprocess.run([sys.executable, '-c', 'import warnings; warnings.warn(\"Apex is not installed. x\")'])\n")


def _stderr(**env):
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "MEGATRON_CP_VERBOSE")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", CODE], env=e, capture_output=True, text=True, timeout=300).stderr


def test_fallback_warnings_are_filtered_here_and_in_children():
    err = _stderr()
    assert "not installed" not in err, err


def test_verbose_shows_them():
    assert "Apex is not installed" in _stderr(MEGATRON_CP_VERBOSE="1")


def test_set_verbose_undoes_the_filters():
    import warnings

    from megatron_cp_plugin import quiet

    quiet.install()
    try:
        assert any(f[1] is not None and f[1].match("Apex is not installed. x") for f in warnings.filters)
        quiet.set_verbose()
        assert not any(f[1] is not None and f[1].match("Apex is not installed. x") for f in warnings.filters)
        assert "Apex" not in os.environ.get("PYTHONWARNINGS", "")
    finally:
        os.environ.pop("MEGATRON_CP_VERBOSE", None)
