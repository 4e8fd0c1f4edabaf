"""Single-device pieces: local block attention (fwd/bwd with fp32 lse) and the (o, lse) merge."""
