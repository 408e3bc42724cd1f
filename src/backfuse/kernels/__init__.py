"""What the operators' fused paths share: host pieces here (schedule, buffers, the task queue, the
launcher), device code by dialect below (`triton/`, `gluon/`). The fused paths' interface and
driver, which also reserve the fp16 range guard's slots, are `ops/fused.py`."""
