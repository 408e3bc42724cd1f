"""The attention blocks of released models as backfuse configs, by name.

    preset = backfuse.presets.get("gemma3-4b")
    local = bnn.Gemma3Core(preset.local, **preset.scalars)     # its sliding-window layers
    full = bnn.Gemma3Core(preset.config, **preset.scalars)     # its global layers

Sizes from the models' published configurations (transformers' and diffusers' conversion of them): Gemma 3
interleaves five sliding-window layers with one global one, Gemma 2 alternates them; Wan's
cross-attention normalises q and k across the heads; Llama 3.2 Vision's cross-attention layers project
the image encoder's states to grouped KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .ops.gemma3_core.spec import Gemma3CoreConfig
from .ops.qkv_gqa.spec import QkvGqaConfig
from .ops.wan_xattn.spec import WanXattnConfig


@dataclass(frozen=True)
class Preset:
    """A released model's attention block: the operator (072, 037, 021), the config of its global (or
    only) layers, that of its sliding-window layers (None: it has none), and the module scalars."""

    name: str
    problem: str
    config: object
    local: object = None
    scalars: tuple = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.scalars)


def _gemma(name, hidden, heads, kv_heads, head_dim, window, query_pre_attn_scalar, softcap=None, qk_norm=True):
    full = Gemma3CoreConfig(hidden, heads, kv_heads, head_dim, 0, qk_norm=qk_norm)
    return Preset(name, "037", full, replace(full, window=window),
                  (("scaling", query_pre_attn_scalar ** -0.5), ("softcap", softcap), ("eps", 1e-6)))


PRESETS = {p.name: p for p in (
    _gemma("gemma3-1b", 1152, 4, 1, 256, 512, 256),
    _gemma("gemma3-4b", 2560, 8, 4, 256, 1024, 256),
    _gemma("gemma3-12b", 3840, 16, 8, 256, 1024, 256),
    _gemma("gemma3-27b", 5376, 32, 16, 128, 1024, 168),
    _gemma("gemma2-2b", 2304, 8, 4, 256, 4096, 256, softcap=50.0, qk_norm=False),
    _gemma("gemma2-9b", 3584, 16, 8, 256, 4096, 256, softcap=50.0, qk_norm=False),
    _gemma("gemma2-27b", 4608, 32, 16, 128, 4096, 144, softcap=50.0, qk_norm=False),
    Preset("wan2.1-1.3b", "021", WanXattnConfig(1536, 12, qk_norm=True), scalars=(("eps", 1e-6),)),
    Preset("wan2.2-ti2v-5b", "021", WanXattnConfig(3072, 24, qk_norm=True), scalars=(("eps", 1e-6),)),
    Preset("wan2.1-14b", "021", WanXattnConfig(5120, 40, qk_norm=True), scalars=(("eps", 1e-6),)),
    Preset("wan2.2-a14b", "021", WanXattnConfig(5120, 40, qk_norm=True), scalars=(("eps", 1e-6),)),
    Preset("llama3.2-vision-11b", "072", QkvGqaConfig(4096, 4096, 32, 8, 128)),
)}


def get(name: str) -> Preset:
    """The preset called `name` (a ValueError lists them when there is none)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"backfuse.presets: no preset {name!r}; there are {', '.join(PRESETS)}") from None
