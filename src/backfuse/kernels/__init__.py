"""What the operators' fused paths share: host pieces here (schedule, buffers, the task queue, the
launcher), device code by dialect below (`triton/`, `gluon/`). The host prelude of a fused call,
which also reserves the fp16 range guard's slots, is `ops/prelude.py`."""
