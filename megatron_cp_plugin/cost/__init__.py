"""The cost model: every algorithm's FLOPs, bytes per rank (equal to its CommStats counters) and predicted time,
`auto`'s choice, and the decode steps' (docs/cost_model.md).

One module per concern, their public names importable from here (`from megatron_cp_plugin.cost import HARDWARE,
Problem, predict, choose_algo`):
  hardware.py    HARDWARE presets, the links a phase crosses, the memory-bound steps' bytes (MERGE_BYTES, ...)
  model.py       Problem, Prediction, the ring and Attention2D entries, predict, comm_bytes, best_grid, choose_algo
  collective.py  the allgather, ulysses and ulysses-ring entries and their byte formulas
  compute.py     each algorithm's measured compute factor (configs/rank_compute.json; `megatron-cp-bench rank`)
  decode.py      decode steps: DecodeProblem, decode_bytes, predict_decode, choose_tree_variant; the whole
                 graphed step of a GPT (DecodeModel, decode_step_time)

Each row of algos/registry.py names its entry here ("module:function", imported on first use); the package
imports algos (the registry, ulysses' head spans), never the reverse (tests/test_layering.py).
"""
from .collective import allgather_bytes, allgather_cost, ulysses_bytes, ulysses_cost, ulysses_ring_cost
from .decode import (DECODE_METHODS, GRAPH_LATENCY_RATIO, GRAPH_LAUNCH_S, LAUNCH_S, PEER_METHOD, PEER_SIGNAL_S,
                     DecodeModel, DecodeProblem, choose_decode, choose_tree_variant, decode_bytes, decode_step_time,
                     predict_decode)
from .hardware import (ADD_BYTES, ATTNFIX_BYTES, FA2_H100, HARDWARE, MERGE_BYTES, Hardware, Link, check_int,
                       overlapped, pairs_link, phase_link)
from .model import (ALGO_TIME_TIE, GRID_TIME_TIE, Prediction, Problem, attention2d_cost, attention_flops, best_grid,
                    choose_algo, comm_bytes, predict, ring_family_cost)

__all__ = [
    # hardware.py
    "ADD_BYTES", "ATTNFIX_BYTES", "FA2_H100", "HARDWARE", "MERGE_BYTES", "Hardware", "Link", "check_int",
    "overlapped", "pairs_link", "phase_link",
    # model.py
    "ALGO_TIME_TIE", "GRID_TIME_TIE", "Prediction", "Problem", "attention2d_cost", "attention_flops", "best_grid",
    "choose_algo", "comm_bytes", "predict", "ring_family_cost",
    # collective.py
    "allgather_bytes", "allgather_cost", "ulysses_bytes", "ulysses_cost", "ulysses_ring_cost",
    # decode.py
    "DECODE_METHODS", "GRAPH_LATENCY_RATIO", "GRAPH_LAUNCH_S", "LAUNCH_S", "PEER_METHOD", "PEER_SIGNAL_S",
    "DecodeModel", "DecodeProblem",
    "choose_decode", "choose_tree_variant", "decode_bytes", "decode_step_time", "predict_decode",
]
