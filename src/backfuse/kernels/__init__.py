"""What the operators' fused paths share: host pieces here (schedule, buffers, the host prelude,
the launcher), device code by dialect below (`triton/`)."""
