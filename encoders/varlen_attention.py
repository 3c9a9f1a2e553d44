"""One variable-length attention call per layer for transformers' vision towers.

transformers' packed vision attentions (``Qwen3VLVisionAttention`` and its Qwen2-VL
relatives) take every image of a call as one sequence split by ``cu_seqlens``. They hand
``cu_seqlens`` to the attention function only when ``is_flash_attention_requested(config)``,
which is ``"flash" in config._attn_implementation``; under any other implementation they do
``lengths.tolist()`` (a device->host sync in every layer on CUDA) and call attention once
per image per layer. So the functions here are registered with transformers'
``AttentionInterface`` under names that contain ``"flash"`` (``pie_flash_varlen_torch``,
``pie_flash_varlen_flashinfer``); a tower whose config names one calls it once per layer
with the ``cu_seqlens`` of all the images (and video frames) of the call.

Kernels (CUDA, float16/bfloat16):

* ``torch``: ``torch.nn.attention.varlen.varlen_attn`` (torch's FlashAttention-2 varlen
  kernel; no compilation, any head size that is a multiple of 8 up to 256);
* ``flashinfer``: ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper`` with
  ``causal=False`` and ``qo_indptr = kv_indptr = cu_seqlens``, planned once per tower
  call (the plan is kept while the call's ``cu_seqlens`` tensor is the one every layer
  passes) and run in every layer; head sizes 64, 128, 256 (those flashinfer ships).

``select_kernel`` picks one for a device, dtype and head size: ``"auto"`` takes ``torch``
when it is usable, else ``flashinfer``, else none. On the CPU none is picked: the tower
keeps what it runs today (sdpa once per image; neither kernel runs on the CPU). flashinfer
is imported only after ``torch.cuda.is_available()`` (or when a test installs a stand-in
under ``sys.modules["flashinfer"]``).

The choice comes from the encoder's ``varlen_attention`` option, else the environment
variable ``PIE_MEDIA_VISION_VARLEN`` (``auto``, ``torch``, ``flashinfer``, ``off``;
default ``auto``). A named kernel that cannot run raises :class:`VarlenUnavailableError`;
``auto`` falls back to the per-image path and says why in the log.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from encoders.errors import EncoderError

log = logging.getLogger(__name__)

ENV_VAR = "PIE_MEDIA_VISION_VARLEN"
CHOICES = ("auto", "torch", "flashinfer", "off")
NAME_PREFIX = "pie_flash_varlen_"
"""Our implementations' names start with this; transformers' vision attentions test
``"flash" in name`` to decide whether to pass ``cu_seqlens``."""
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024
"""flashinfer's float workspace (split-KV partial results); its docs recommend 128 MiB."""


class VarlenUnavailableError(EncoderError, ValueError):
    """A variable-length attention kernel was asked for by name and cannot run here."""


class VarlenKernel:
    """Attention over packed sequences: ``q``, ``k``, ``v`` of shape (rows, heads, head_dim),
    sequence ``i`` being rows ``cu_seqlens[i]:cu_seqlens[i + 1]``, each attending to all
    of its own rows and nothing else."""

    name: str = ""
    calls: int = 0
    """Attention calls served (one per layer per tower call; for tests and benches)."""

    @property
    def attention_name(self) -> str:
        """The name it is registered under in transformers' ``AttentionInterface``."""
        return NAME_PREFIX + self.name

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float,
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchVarlen(VarlenKernel):
    """``torch.nn.attention.varlen.varlen_attn`` (CUDA only)."""

    name = "torch"

    def __init__(self) -> None:
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        # ``scale`` is a keyword of recent versions; older ones use 1/sqrt(head_dim).
        self._takes_scale = "scale" in inspect.signature(varlen_attn).parameters

    def attend(self, q, k, v, cu_seqlens, max_seqlen, scale):
        if self._takes_scale:
            return self._fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)
        if abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            raise VarlenUnavailableError(f"this torch's varlen_attn has no scale argument (asked {scale})")
        return self._fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


@dataclass
class _Planned:
    """One device's ragged wrapper and what it was last planned for."""

    wrapper: Any
    seqlens: weakref.ref | None = None
    key: tuple = ()
    lock: threading.Lock = field(default_factory=threading.Lock)


class FlashInferRagged(VarlenKernel):
    """flashinfer's ragged prefill, non-causal, one plan per tower call.

    Every layer of a tower call passes the same ``cu_seqlens`` tensor object, so the plan
    is kept while that object (held by a weak reference) and the layer shape stay the same;
    a new call's new tensor plans again (one ``cu_seqlens`` copy to the host per call, which
    ``plan`` needs). ``plans`` counts the plans made (for tests and benches)."""

    name = "flashinfer"

    def __init__(self, workspace_bytes: int = FLASHINFER_WORKSPACE_BYTES) -> None:
        self.workspace_bytes = workspace_bytes
        self._devices: dict[torch.device, _Planned] = {}
        self._lock = threading.Lock()
        self.plans = 0

    def _state(self, device: torch.device) -> _Planned:
        with self._lock:
            st = self._devices.get(device)
            if st is None:
                import flashinfer

                workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
                st = _Planned(flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD"))
                self._devices[device] = st
            return st

    def attend(self, q, k, v, cu_seqlens, max_seqlen, scale):
        st = self._state(q.device)
        key = (q.shape[1], k.shape[1], q.shape[2], q.dtype, k.dtype, scale)
        # Calls from several threads each re-plan when another planned in between; the
        # lock keeps a plan and the run that relies on it together.
        with st.lock:
            if st.seqlens is None or st.seqlens() is not cu_seqlens or st.key != key:
                indptr = cu_seqlens.to("cpu", torch.int32)
                st.wrapper.plan(
                    indptr,
                    indptr,
                    q.shape[1],
                    k.shape[1],
                    q.shape[2],
                    causal=False,
                    sm_scale=scale,
                    q_data_type=q.dtype,
                    kv_data_type=k.dtype,
                )
                st.seqlens, st.key = weakref.ref(cu_seqlens), key
                self.plans += 1
            return st.wrapper.run(q, k, v)


_KERNELS: dict[str, VarlenKernel] = {}
_KERNELS_LOCK = threading.Lock()


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol: ``query``/``key``/``value`` of shape
    (1, heads, rows, head_dim), returns ((1, rows, heads, head_dim), None). Only what a
    packed vision tower asks for is accepted (no mask, not causal, no dropout, the same
    ``cu_seqlens`` for queries and keys); anything else raises rather than attends wrong."""
    kernel = _KERNELS[module.config._attn_implementation]
    if cu_seq_lens_q is None:
        raise ValueError(f"{kernel.attention_name} attends packed sequences: cu_seq_lens_q is required")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError(f"{kernel.attention_name}: queries and keys must share cu_seqlens")
    if attention_mask is not None or is_causal or dropout:
        raise ValueError(
            f"{kernel.attention_name}: no mask, causal attention or dropout (a vision tower's inference)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{kernel.attention_name}: packed rows come as a batch of one, got {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    head_dim = q.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    if max_length_q is None:
        max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    kernel.calls += 1
    out = kernel.attend(q, k, v, cu_seq_lens_q, int(max_length_q), scale)
    return out.unsqueeze(0), None


def register(kernel: VarlenKernel) -> str:
    """Register ``kernel`` with transformers' ``AttentionInterface`` (replacing an earlier
    kernel of the same name) and return its name."""
    from transformers import AttentionInterface

    name = kernel.attention_name
    ok, why = transformers_passes_cu_seqlens(name)
    if not ok:  # the name is what makes the tower pass cu_seqlens: checked, not assumed
        raise VarlenUnavailableError(why)
    with _KERNELS_LOCK:
        _KERNELS[name] = kernel
        AttentionInterface.register(name, varlen_attention_forward)
    return name


def transformers_passes_cu_seqlens(name: str) -> tuple[bool, str]:
    """Whether this transformers' packed vision attentions would hand an implementation
    called ``name`` the ``cu_seqlens`` (they ask ``is_flash_attention_requested``)."""
    try:
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return (
            False,
            "this transformers has no is_flash_attention_requested (its vision towers pass cu_seqlens only to flash_attention_2)",
        )
    if not is_flash_attention_requested(requested_attention_implementation=name):
        return False, f"this transformers' vision towers would not pass cu_seqlens to {name!r}"
    return True, ""


def set_attention(tower: torch.nn.Module, name: str) -> str:
    """Make ``tower`` (and every attention module sharing its config) use the attention
    implementation ``name``; returns the one it had. Goes through the config's own setter,
    not ``set_attn_implementation``, which would swap a custom flash name for a kernel
    from the hub."""
    config = tower.config
    before = config._attn_implementation
    config._attn_implementation = name
    return before


def requested_choice(option: str | None) -> str:
    """``option`` if given, else ``$PIE_MEDIA_VISION_VARLEN``, else ``"auto"``; checked."""
    choice = (option if option is not None else os.environ.get(ENV_VAR, "auto")).strip().lower()
    if choice not in CHOICES:
        source = "varlen_attention" if option is not None else ENV_VAR
        raise VarlenUnavailableError(f"{source}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


def _torch_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[bool, str]:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError as e:
        return False, f"torch {torch.__version__} has no torch.nn.attention.varlen ({e})"
    if head_dim % 8 or head_dim > 256:
        return (
            False,
            f"torch's varlen kernel takes head sizes that are multiples of 8 up to 256, not {head_dim}",
        )
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"torch's varlen kernel needs compute capability 8.0 or newer (this GPU has {major}.x)"
    return True, f"torch {torch.__version__} varlen_attn"


def _flashinfer_usable(head_dim: int) -> tuple[bool, str]:
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return False, f"flashinfer ships head sizes {FLASHINFER_HEAD_DIMS}, not {head_dim}"
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a compiled extension that fails to load
        return False, f"flashinfer does not import ({type(e).__name__}: {e})"
    return True, f"flashinfer {getattr(flashinfer, '__version__', '(unknown version)')} ragged prefill"


_MADE: dict[str, VarlenKernel] = {}


def _kernel(name: str) -> VarlenKernel:
    """One kernel object per name for the process (flashinfer's holds a workspace per device)."""
    with _KERNELS_LOCK:
        if name not in _MADE:
            _MADE[name] = TorchVarlen() if name == "torch" else FlashInferRagged()
        return _MADE[name]


def select_kernel(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, choice: str
) -> tuple[VarlenKernel | None, str]:
    """The kernel for a tower on ``device`` in ``dtype`` with heads of ``head_dim``, or None,
    and a sentence saying why. ``choice`` as :func:`requested_choice` returns; a named
    kernel that cannot run raises :class:`VarlenUnavailableError`."""
    device = torch.device(device)
    if choice == "off":
        return None, f"turned off ({ENV_VAR}=off or varlen_attention='off')"
    why_not: list[str] = []
    if device.type != "cuda" or not torch.cuda.is_available():
        why_not.append(f"the tower runs on {device.type}, and the varlen kernels need CUDA")
    elif dtype not in HALF_DTYPES:
        why_not.append(f"the tower runs in {dtype}, and the varlen kernels take float16/bfloat16")
    elif not transformers_passes_cu_seqlens(NAME_PREFIX + "probe")[0]:
        why_not.append(transformers_passes_cu_seqlens(NAME_PREFIX + "probe")[1])
    else:
        for name in ("torch", "flashinfer") if choice == "auto" else (choice,):
            ok, why = (
                _torch_usable(device, dtype, head_dim) if name == "torch" else _flashinfer_usable(head_dim)
            )
            if ok:
                return _kernel(name), why
            why_not.append(why)
    if choice != "auto":
        raise VarlenUnavailableError(f"vision attention {choice!r} cannot run here: {'; '.join(why_not)}")
    return None, "; ".join(why_not)


def configure_tower(
    tower: torch.nn.Module,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    choice: str,
    what: str,
) -> VarlenKernel | None:
    """Select a kernel for ``tower`` (see :func:`select_kernel`), register it and switch the
    tower to it; log the outcome. Returns the kernel, or None (the tower is left as it is:
    one attention call per image)."""
    kernel, why = select_kernel(device, dtype, head_dim, choice)
    if kernel is None:
        # On CUDA in half precision a kernel was expected: say so louder.
        expected = choice == "auto" and torch.device(device).type == "cuda" and dtype in HALF_DTYPES
        level = logging.WARNING if expected else logging.INFO
        log.log(level, "%s: attention once per image per layer (%s)", what, why)
        return None
    set_attention(tower, register(kernel))
    log.info("%s: one variable-length attention call per layer for all items of a call (%s)", what, why)
    return kernel
