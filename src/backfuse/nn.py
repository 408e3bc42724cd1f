"""Modules holding the parameters of the three attention blocks; forward and backward via `functional`.

Parameters carry the operators' official input names (`q_weight`, `query_bias`, ...), so
`load_state_dict` takes our own state dicts; `from_state_dict` also accepts the key names of the
model families' reference code (NeMo's `linear_q`, Hugging Face Gemma's `q_proj` / `q_norm`, Wan's
`q` / `o` linears, diffusers' `to_q` / `to_out.0`) and builds the module on the tensors' device. Like
`load_state_dict` it is strict by default: keys under the prefix that it does not use, and
parameters it finds no key for, are listed in one error (`strict=False`: in a warning instead, the
missing parameters keeping their initialisation).

Sizes come from each module's config (`QkvGqaConfig`, `Gemma3CoreConfig`, `WanXattnConfig`; the
default is the benchmark operator's); a checkpoint's tensors of other sizes are refused by shape,
naming the key.
"""

from __future__ import annotations

import math

import torch

from . import callsite
from . import functional as F
from .ops.gemma3_core.spec import Gemma3CoreConfig
from .ops.qkv_gqa.spec import QkvGqaConfig
from .ops.wan_xattn.spec import WanXattnConfig
from .problem import TRAINING_DTYPES, check_real, dtypes_text


def _linear_default(w):  # torch.nn.Linear's own initialisation (kaiming uniform, a = sqrt(5))
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))


class _Block(torch.nn.Module):
    CONFIG: type  # the operator's config class; its default is the benchmark operator's sizes
    ALIASES: dict = {}  # parameter name -> key names used by the model family's reference code
    UNSUPPORTED: dict = {}  # key suffix of the family's layer that this block has no parameter for -> why

    def __init__(self, config=None, *, device=None, dtype=torch.float32):
        """Parameters of the config's sizes (None: the benchmark operator's), of `dtype` (one the forward
        takes) on `device` (None: torch's default); bad values are refused here, in one line naming the
        argument, rather than at the first forward."""
        super().__init__()
        config = self.CONFIG() if config is None else config
        if not isinstance(config, self.CONFIG):
            raise TypeError(f"{self._label()}: config must be a {self.CONFIG.__name__}, got {type(config).__name__}")
        if dtype not in TRAINING_DTYPES:
            raise TypeError(f"{self._label()}: dtype must be {dtypes_text(TRAINING_DTYPES)} (what the forward takes), "
                            f"got {dtype!r}")
        self.config = config
        device = self._device(device)
        for name, shape, _ in self.params(config):
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.reset_parameters()

    @classmethod
    def params(cls, config) -> tuple:
        """(name, shape, init) of each parameter at config's sizes."""
        raise NotImplementedError

    @classmethod
    def from_preset(cls, name: str, *, local: bool = False, **kwargs):
        """The block of a released model (`backfuse.presets`), e.g. Gemma3Core.from_preset("gemma3-4b",
        local=True) for its sliding-window layers; kwargs go to the constructor (device, dtype, ...)."""
        from . import presets

        preset = presets.get(name)
        if preset.problem != cls._PROBLEM:
            raise ValueError(f"{cls._label()}: preset {name!r} is a {type(preset.config).__name__}, "
                             f"not a {cls.CONFIG.__name__}")
        if local and preset.local is None:
            raise ValueError(f"{cls._label()}: preset {name!r} has no sliding-window layers")
        return cls(preset.local if local else preset.config, **{**preset.kwargs, **kwargs})

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
            for name, _, init in self.params(self.config):
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
        config = kwargs.get("config") or cls.CONFIG()
        for name, shape, _ in cls.params(config):
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
    """Cross-attention q, k, v projections with grouped KV heads (072's operator; `QkvGqaConfig`, whose
    default is the benchmark's: 16 query heads of 256 from width 1536, 4 KV heads from width 1024), no
    biases. Initialised like `torch.nn.Linear`."""

    CONFIG = QkvGqaConfig
    _PROBLEM = "072"
    ALIASES = {"q_weight": ("linear_q.weight", "q_proj.weight"), "k_weight": ("linear_k.weight", "k_proj.weight"),
               "v_weight": ("linear_v.weight", "v_proj.weight")}
    UNSUPPORTED = {**{f"linear_out.{kind}": "072 is the q, k, v projections only" for kind in ("weight", "bias")},
                   **{f"linear_{n}.bias": "072's projections have no bias" for n in "qkv"}}

    @classmethod
    def params(cls, c):
        return (("q_weight", (c.q_out, c.hidden), _linear_default), ("k_weight", (c.kv_out, c.cross_hidden), _linear_default),
                ("v_weight", (c.kv_out, c.cross_hidden), _linear_default))

    def _sizes(self):
        c = self.config
        return dict(hidden=c.hidden, cross_hidden=c.cross_hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim)

    def forward(self, decoder_hidden, encoder_hidden):
        """decoder_hidden [B, Sd, hidden], encoder_hidden [B, Se, cross_hidden] -> query_states
        [B, H, Sd, D], key_states and value_states [B, H, Se, D]."""
        return F.qkv_gqa(decoder_hidden, encoder_hidden, self.q_weight, self.k_weight, self.v_weight,
                         head_dim=self.config.head_dim)


class Gemma3Core(_Block):
    """Gemma's attention core (037's operator; `Gemma3CoreConfig`, whose default is the benchmark's:
    hidden 3072, 24 / 8 heads of 128): QK RMSNorm (weight applied as 1 + w), RoPE, causal GQA attention
    with an optional soft cap (softcap None: none, as Gemma 3) and sliding window (the config's),
    output projection. Initialised like Hugging Face Gemma: projections N(0, 0.02^2), norms 0."""

    CONFIG = Gemma3CoreConfig
    _PROBLEM = "037"
    ALIASES = {"q_weight": ("q_proj.weight",), "k_weight": ("k_proj.weight",), "v_weight": ("v_proj.weight",),
               "o_weight": ("o_proj.weight",), "q_norm_weight": ("q_norm.weight",),
               "k_norm_weight": ("k_norm.weight",)}
    SCALARS = ("scaling", "softcap", "eps")

    def __init__(self, config=None, *, scaling: float | None = None, softcap: float | None = 50.0, eps: float = 1e-6,
                 device=None, dtype=torch.float32):
        """scaling None: 1 / sqrt(head_dim); softcap None: no soft cap."""
        config = Gemma3CoreConfig() if config is None else config
        scaling = 1 / math.sqrt(config.head_dim) if scaling is None else scaling
        scaling, eps = (check_real(v, f"{self._label()}: {n}") for n, v in (("scaling", scaling), ("eps", eps)))
        if softcap is not None:
            softcap = check_real(softcap, f"{self._label()}: softcap")
            if softcap <= 0:
                raise ValueError(f"{self._label()}: softcap must be positive, or None for no soft cap, got {softcap:g}")
        super().__init__(config, device=device, dtype=dtype)
        self.scaling, self.softcap, self.eps = scaling, softcap, eps

    @classmethod
    def params(cls, c):
        init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
        norms = (("q_norm_weight", (c.head_dim,), torch.nn.init.zeros_),
                 ("k_norm_weight", (c.head_dim,), torch.nn.init.zeros_)) if c.qk_norm else ()
        return (("q_weight", (c.q_out, c.hidden), init), ("k_weight", (c.kv_out, c.hidden), init),
                ("v_weight", (c.kv_out, c.hidden), init), ("o_weight", (c.hidden, c.q_out), init), *norms)

    @classmethod
    def from_state_dict(cls, state_dict: dict, prefix: str = "", *, strict: bool = True, **kwargs):
        """As `_Block.from_state_dict`. A state dict holds no scalars: when it uses Hugging Face's
        names and scaling, softcap or eps is not passed, a BackfuseWarning says which values are kept
        (Gemma 3 scales by query_pre_attn_scalar**-0.5 and has no soft cap: softcap=None; Gemma 2 caps
        at 50)."""
        module = super().from_state_dict(state_dict, prefix, strict=strict, **kwargs)
        unset = [n for n in cls.SCALARS if n not in kwargs]
        family = any(prefix + alias in state_dict for aliases in cls.ALIASES.values() for alias in aliases)
        if family and unset:
            kept = ", ".join(f"{n}={getattr(module, n):g}" if getattr(module, n) is not None else f"{n}=None"
                             for n in unset)
            callsite.warn(f"{cls.__name__}.from_state_dict: the state dict holds no scalars; kept {kept} (pass "
                          f"{', '.join(n + '=' for n in unset)} to set them; Gemma 3 scales by "
                          f"query_pre_attn_scalar**-0.5 and has no soft cap: softcap=None)", callsite.BackfuseWarning)
        return module

    def _sizes(self):
        c = self.config
        return dict(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, window=c.window,
                    **({} if c.qk_norm else {"qk_norm": False}), scaling=self.scaling, softcap=self.softcap, eps=self.eps)

    def forward(self, hidden, cos, sin):
        """hidden [B, S, hidden]; cos, sin [B, S, head_dim] (RoPE tables)."""
        c = self.config
        return F.gemma3_core(hidden, cos, sin, self.q_weight, self.k_weight, self.v_weight, self.o_weight,
                             getattr(self, "q_norm_weight", None), getattr(self, "k_norm_weight", None), self.scaling,
                             self.softcap, self.eps, window=c.window, head_dim=c.head_dim)


_WAN_PROJECTIONS = tuple(f"{n}_{kind}" for n in ("query", "key", "value", "output") for kind in ("weight", "bias"))


class WanXattn(_Block):
    """Wan-style text-to-video cross-attention (021's operator; `WanXattnConfig`, whose default is the
    benchmark's: hidden 1024, 16 heads of 64, no q/k norm; Wan 2.1 / 2.2's have `qk_norm=True`).
    Initialised like Wan: weights Xavier-uniform, biases 0, norm weights 1."""

    CONFIG = WanXattnConfig
    _PROBLEM = "021"
    ALIASES = {**{f"{n}_{kind}": (f"{wan}.{kind}", f"{diffusers}.{kind}")  # Wan's own names, then diffusers'
                  for n, wan, diffusers in (("query", "q", "to_q"), ("key", "k", "to_k"), ("value", "v", "to_v"),
                                            ("output", "o", "to_out.0"))
                  for kind in ("weight", "bias")},
               "norm_q_weight": ("norm_q.weight",), "norm_k_weight": ("norm_k.weight",)}
    UNSUPPORTED = {f"{norm}.weight": "this config has no q/k RMSNorm (WanXattnConfig(qk_norm=True) has)"
                   for norm in ("norm_q", "norm_k")}

    def __init__(self, config=None, *, scale: float | None = None, eps: float = 1e-6, device=None,
                 dtype=torch.float32):
        """scale None: 1 / sqrt(head size); eps: the q, k norms' (with qk_norm)."""
        config = WanXattnConfig() if config is None else config
        scale = check_real(1 / math.sqrt(config.head_dim) if scale is None else scale, f"{self._label()}: scale")
        eps = check_real(eps, f"{self._label()}: eps")
        super().__init__(config, device=device, dtype=dtype)
        self.scale, self.eps = scale, eps

    @classmethod
    def params(cls, c):
        norms = tuple((f"norm_{n}_weight", (c.hidden,), torch.nn.init.ones_) for n in "qk") if c.qk_norm else ()
        return tuple(p for n in ("query", "key", "value", "output") for p in (
            (f"{n}_weight", (c.hidden, c.hidden), torch.nn.init.xavier_uniform_),
            (f"{n}_bias", (c.hidden,), torch.nn.init.zeros_))) + norms

    def _sizes(self):
        c = self.config
        return dict(hidden=c.hidden, heads=c.heads, head_dim=c.head_dim, **({"qk_norm": True} if c.qk_norm else {}),
                    scale=self.scale)

    def forward(self, video, text):
        """video [B, Nv, hidden], text [B, Nt, hidden] -> [B, Nv, hidden]."""
        c = self.config
        projections = [getattr(self, name) for name in _WAN_PROJECTIONS]
        norms = dict(norm_q_weight=self.norm_q_weight, norm_k_weight=self.norm_k_weight, eps=self.eps) if c.qk_norm else {}
        return F.wan_xattn(video, text, *projections, self.scale, heads=c.heads, **norms)


# The names of earlier releases.
CrossAttnQKVGQA = QkvGqa
Gemma3AttentionCore = Gemma3Core
WanTextVideoCrossAttention = WanXattn
