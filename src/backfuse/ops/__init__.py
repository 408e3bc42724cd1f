"""The three operators, one package each: spec, config and plan, kernels, launcher; `fused`, the interface
every operator's fused backward implements (`FusedPath`) and its one driver."""

from . import gemma3_core, qkv_gqa, wan_xattn

PROBLEMS = {m.PROBLEM.id: m.PROBLEM for m in (qkv_gqa, gemma3_core, wan_xattn)}
