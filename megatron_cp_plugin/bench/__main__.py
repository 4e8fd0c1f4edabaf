import os
import sys

from .cli import main

rc = main()
if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
    # A torchrun rank leaves without the interpreter's teardown, as megatron-cp-pretrain's ranks do: its reports
    # are written and closed and its process group destroyed; in teardown, gloo's worker thread could free a
    # finished send/recv's tensors while the interpreter finalises and abort the process ("terminate called
    # without an active exception": the packed bench on 2 CPU ranks, 1 run in ~10).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 0)
sys.exit(rc)
