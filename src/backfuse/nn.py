"""Modules holding the parameters of the three attention blocks; forward and backward via `functional`.

Parameters carry the operators' official input names (`q_weight`, `query_bias`, ...), so
`load_state_dict` takes our own state dicts; `from_state_dict` also accepts the key names of the
model families' reference code (NeMo's `linear_q`, Hugging Face Gemma's `q_proj` / `q_norm`, Wan's
`q` / `o` linears, diffusers' `to_q` / `to_out.0`) and builds the module on the tensors' device. Like
`load_state_dict` it is strict by default: keys under the prefix that it does not use, and
parameters it finds no key for, are listed in one error (`strict=False`: in a warning instead, the
missing parameters keeping their initialisation).

The sizes are the benchmark operators' (fixed widths and head counts; batch and token counts are
free): they are not the released models' (README, "Training"), so a released checkpoint's tensors
are refused by shape.
"""

from __future__ import annotations

import math

import torch

from . import callsite
from . import functional as F
from .ops.gemma3_core import spec as _gemma
from .ops.qkv_gqa import spec as _qkv
from .ops.wan_xattn import spec as _wan
from .problem import TRAINING_DTYPES, check_real, dtypes_text


def _linear_default(w):  # torch.nn.Linear's own initialisation (kaiming uniform, a = sqrt(5))
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))


class _Block(torch.nn.Module):
    PARAMS: tuple = ()  # (name, shape, init)
    ALIASES: dict = {}  # parameter name -> key names used by the model family's reference code
    UNSUPPORTED: dict = {}  # key suffix of the family's layer that this block has no parameter for -> why

    def __init__(self, *, device=None, dtype=torch.float32):
        """Parameters of `dtype` (one the forward takes) on `device` (None: torch's default); bad values are
        refused here, in one line naming the argument, rather than at the first forward."""
        super().__init__()
        if dtype not in TRAINING_DTYPES:
            raise TypeError(f"{self._label()}: dtype must be {dtypes_text(TRAINING_DTYPES)} (what the forward takes), "
                            f"got {dtype!r}")
        device = self._device(device)
        for name, shape, _ in self.PARAMS:
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.reset_parameters()

    @classmethod
    def _label(cls) -> str:
        return f"backfuse.nn.{cls.__name__}"

    @classmethod
    def _device(cls, device):
        """device as a torch.device (None stays None), when it parses and, for CUDA, when one is there."""
        if device is None:
            return None
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"{cls._label()}: device must be a torch.device or a name such as 'cpu' or 'cuda', "
                             f"got {device!r}") from None
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            why = (f"torch {torch.__version__} was built without CUDA" if not torch.backends.cuda.is_built() else
                   f"{torch.cuda.device_count()} CUDA device(s) visible")
            raise ValueError(f"{cls._label()}: device '{device}' is not available ({why})")
        return device

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, _, init in self.PARAMS:
                init(getattr(self, name))

    @classmethod
    def from_state_dict(cls, state_dict: dict, prefix: str = "", *, strict: bool = True, **kwargs):
        """A module holding `state_dict`'s tensors (our names or the family's, after `prefix`), on
        their device; kwargs go to the constructor (dtype, the scalars).

        strict (default): every parameter must have a key, and every key that starts with `prefix`
        must be used, else a RuntimeError lists the missing and unexpected keys, as
        `torch.nn.Module.load_state_dict` does. strict=False: the same list comes as a BackfuseWarning;
        missing parameters keep their initialisation. A tensor of the wrong shape is a ValueError
        either way.
        """
        values, used, missing = {}, set(), []
        for name, shape, _ in cls.PARAMS:
            keys = [prefix + k for k in (name, *cls.ALIASES.get(name, ()))]
            found = [k for k in keys if k in state_dict]
            if not found:
                missing.append(f"'{name}' (looked for {', '.join(keys)})")
                continue
            value = state_dict[found[0]]
            if tuple(value.shape) != shape:
                raise ValueError(f"{cls.__name__}.from_state_dict: '{found[0]}' has shape {tuple(value.shape)}, "
                                 f"expected {shape}")
            values[name] = value
            used.add(found[0])
        unexpected = [k for k in state_dict if k.startswith(prefix) and k not in used]
        if missing or unexpected:
            report = cls._key_report(missing, unexpected, prefix)
            if strict:
                raise RuntimeError(f"{cls.__name__}.from_state_dict: {report}")
            callsite.warn(f"{cls.__name__}.from_state_dict (strict=False): {report}; "
                          f"{'the missing parameters keep their initialisation' if missing else 'loaded the rest'}",
                          callsite.BackfuseWarning)
        devices = [v.device for v in values.values()]
        module = cls(**{"device": devices[0] if devices else None, **kwargs})
        module.load_state_dict(values, strict=False)
        return module

    @classmethod
    def _key_report(cls, missing, unexpected, prefix) -> str:
        parts = []
        if missing:
            parts.append(f"missing key(s) for {', '.join(missing)}")
        if unexpected:
            why = [f"'{k}'" + "".join(f" ({text})" for suffix, text in cls.UNSUPPORTED.items()
                                      if k[len(prefix):] == suffix) for k in unexpected]
            parts.append(f"unexpected key(s) {', '.join(why)}")
        return "; ".join(parts)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self._sizes().items())

    def _sizes(self) -> dict:
        raise NotImplementedError


class QkvGqa(_Block):
    """072's cross-attention projections (benchmark attributed to Parakeet TDT 0.6B v3, which has no such
    layer: README, "Sizes"): decoder states to 16 query heads of 256, encoder states to 4 KV heads
    repeated to 16, no biases. Initialised like NeMo's `nn.Linear` layers."""

    PARAMS = (
        ("q_weight", (_qkv.Q_OUT, _qkv.HIDDEN), _linear_default),
        ("k_weight", (_qkv.KV_OUT, _qkv.CROSS_HIDDEN), _linear_default),
        ("v_weight", (_qkv.KV_OUT, _qkv.CROSS_HIDDEN), _linear_default),
    )
    ALIASES = {"q_weight": ("linear_q.weight", "q_proj.weight"), "k_weight": ("linear_k.weight", "k_proj.weight"),
               "v_weight": ("linear_v.weight", "v_proj.weight")}
    UNSUPPORTED = {**{f"linear_out.{kind}": "072 is the q, k, v projections only" for kind in ("weight", "bias")},
                   **{f"linear_{n}.bias": "072's projections have no bias" for n in "qkv"}}

    def _sizes(self):
        return dict(hidden=_qkv.HIDDEN, cross_hidden=_qkv.CROSS_HIDDEN, heads=_qkv.HEADS, kv_heads=_qkv.KV_HEADS,
                    head_dim=_qkv.HEAD_DIM)

    def forward(self, decoder_hidden, encoder_hidden):
        """decoder_hidden [B,Sd,1536], encoder_hidden [B,Se,1024] -> query_states [B,16,Sd,256], key_states
        and value_states [B,16,Se,256]."""
        return F.qkv_gqa(decoder_hidden, encoder_hidden, self.q_weight, self.k_weight, self.v_weight)


class Gemma3Core(_Block):
    """037's Gemma 3-style attention core at the benchmark's sizes (hidden 3072, 24 / 8 heads of 128; not
    Gemma 3 4B's: README, "Sizes"): QK RMSNorm (weight applied as 1 + w), RoPE, soft-capped causal GQA,
    output projection. Initialised like Hugging Face Gemma 3: projections N(0, 0.02²), norms 0."""

    PARAMS = tuple((n, shape, lambda w: torch.nn.init.normal_(w, std=0.02)) for n, shape in (
        ("q_weight", (_gemma.Q_OUT, _gemma.HIDDEN)), ("k_weight", (_gemma.KV_OUT, _gemma.HIDDEN)),
        ("v_weight", (_gemma.KV_OUT, _gemma.HIDDEN)), ("o_weight", (_gemma.HIDDEN, _gemma.Q_OUT)))) + (
        ("q_norm_weight", (_gemma.HEAD_DIM,), torch.nn.init.zeros_),
        ("k_norm_weight", (_gemma.HEAD_DIM,), torch.nn.init.zeros_),
    )
    ALIASES = {"q_weight": ("q_proj.weight",), "k_weight": ("k_proj.weight",), "v_weight": ("v_proj.weight",),
               "o_weight": ("o_proj.weight",), "q_norm_weight": ("q_norm.weight",),
               "k_norm_weight": ("k_norm.weight",)}
    SCALARS = ("scaling", "softcap", "eps")

    def __init__(self, *, scaling: float = 1 / math.sqrt(_gemma.HEAD_DIM), softcap: float = 50.0,
                 eps: float = 1e-6, device=None, dtype=torch.float32):
        scalars = [check_real(v, f"{self._label()}: {n}") for n, v in zip(self.SCALARS, (scaling, softcap, eps))]
        super().__init__(device=device, dtype=dtype)
        self.scaling, self.softcap, self.eps = scalars

    @classmethod
    def from_state_dict(cls, state_dict: dict, prefix: str = "", *, strict: bool = True, **kwargs):
        """As `_Block.from_state_dict`. A state dict holds no scalars: when it uses Hugging Face's
        names and scaling, softcap or eps is not passed, a BackfuseWarning says which benchmark values
        are kept (released Gemma 3 configs scale by query_pre_attn_scalar**-0.5 and have no
        attention soft cap, which these kernels do not support)."""
        module = super().from_state_dict(state_dict, prefix, strict=strict, **kwargs)
        unset = [n for n in cls.SCALARS if n not in kwargs]
        family = any(prefix + alias in state_dict for aliases in cls.ALIASES.values() for alias in aliases)
        if family and unset:
            kept = ", ".join(f"{n}={getattr(module, n):g}" for n in unset)
            callsite.warn(f"{cls.__name__}.from_state_dict: the state dict holds no scalars; kept the benchmark's "
                          f"{kept} (pass {', '.join(n + '=' for n in unset)} to set them; released Gemma 3 configs "
                          f"scale by query_pre_attn_scalar**-0.5 and have no attention soft cap)", callsite.BackfuseWarning)
        return module

    def _sizes(self):
        return dict(hidden=_gemma.HIDDEN, heads=_gemma.HEADS, kv_heads=_gemma.KV_HEADS, head_dim=_gemma.HEAD_DIM,
                    scaling=self.scaling, softcap=self.softcap, eps=self.eps)

    def forward(self, hidden, cos, sin):
        """hidden [B,S,3072]; cos, sin [B,S,128] (RoPE tables)."""
        return F.gemma3_core(hidden, cos, sin, self.q_weight, self.k_weight, self.v_weight, self.o_weight,
                             self.q_norm_weight, self.k_norm_weight, self.scaling, self.softcap, self.eps)


class WanXattn(_Block):
    """021's Wan-style text-to-video cross-attention at the benchmark's sizes (hidden 1024, 16 heads of 64,
    no q/k norm; not Wan 2.2 A14B's: README, "Sizes"). Initialised like Wan: weights Xavier-uniform,
    biases 0."""

    PARAMS = tuple(p for n in ("query", "key", "value", "output") for p in (
        (f"{n}_weight", (_wan.HIDDEN, _wan.HIDDEN), torch.nn.init.xavier_uniform_),
        (f"{n}_bias", (_wan.HIDDEN,), torch.nn.init.zeros_)))
    ALIASES = {f"{n}_{kind}": (f"{wan}.{kind}", f"{diffusers}.{kind}")  # Wan's own names, then diffusers'
               for n, wan, diffusers in (("query", "q", "to_q"), ("key", "k", "to_k"), ("value", "v", "to_v"),
                                         ("output", "o", "to_out.0"))
               for kind in ("weight", "bias")}
    UNSUPPORTED = {f"{norm}.weight": "021 has no q/k RMSNorm; Wan 2.2's cross-attention normalises q and k"
                   for norm in ("norm_q", "norm_k")}

    def __init__(self, *, scale: float = 1 / math.sqrt(_wan.HEAD_DIM), device=None, dtype=torch.float32):
        scale = check_real(scale, f"{self._label()}: scale")
        super().__init__(device=device, dtype=dtype)
        self.scale = scale

    def _sizes(self):
        return dict(hidden=_wan.HIDDEN, heads=_wan.HEADS, head_dim=_wan.HEAD_DIM, scale=self.scale)

    def forward(self, video, text):
        """video [B,Nv,1024], text [B,Nt,1024] -> [B,Nv,1024]."""
        return F.wan_xattn(video, text, *(getattr(self, n) for n, _, _ in self.PARAMS), self.scale)


# The names of earlier releases.
CrossAttnQKVGQA = QkvGqa
Gemma3AttentionCore = Gemma3Core
WanTextVideoCrossAttention = WanXattn
