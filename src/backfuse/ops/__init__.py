"""The three operators, one module each."""

from . import cross_attn_qkv_gqa, gemma3_attn_core, wan_text_video_xattn

PROBLEMS = {m.PROBLEM.id: m.PROBLEM for m in (cross_attn_qkv_gqa, gemma3_attn_core, wan_text_video_xattn)}
