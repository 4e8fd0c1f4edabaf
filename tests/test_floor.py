"""The decode floor's bandwidth (inference/floor.py): measured in the run on a GPU, given, or none on a CPU."""
from __future__ import annotations

import pytest
import torch

from megatron_cp_plugin.inference import floor


def test_given_bandwidth_is_used_and_named_and_a_bad_one_refused():
    dev = torch.device("cpu")
    assert floor.memory_bandwidth(dev) is None and floor.bandwidth_note(dev, None) == "no bandwidth on a CPU"
    assert floor.memory_bandwidth(dev, 2e12) == 2e12
    assert floor.bandwidth_note(dev, 2e12).startswith("2.00 TB/s as given (--mem-bw)")
    with pytest.raises(ValueError, match="memory bandwidth must be positive"):
        floor.memory_bandwidth(dev, 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SKIPPED LOUDLY: needs a GPU (the measured bandwidth)")
def test_measured_bandwidth_is_the_higher_of_copy_and_read_and_is_reported_with_the_nominal():
    dev = torch.device("cuda")
    bw = floor.memory_bandwidth(dev)
    m = floor._MEASURED[0]                                 # "cuda" without an index: key 0
    assert bw == max(m["copy"], m["read"]) and 1e11 < bw < 2e13
    note = floor.bandwidth_note(dev, bw)
    assert "measured in this run (copy" in note and (m["nominal"] is None or "nominal" in note)
    nominal = floor.nominal_bandwidth(dev)
    assert nominal is None or bw < 1.05 * nominal          # no GPU of ours beats its spec sheet
