"""Shared machinery of the E4M3-block-scaled symmetric formats (NVFP4, ternary and their key-offset twins).

Both follow spec §3.2/§3.3 and differ only in the element grid, so the scale and group-axis logic
lives here once. Keys are grouped per channel over the flush group's tokens (scale in the group
arena, A14); values per token over 16 channels (scale in the slot). Every step is fp32, in this
order (kernels replicate it bit-exactly):

    s_glob = fp32(scales.k | scales.v)
    s_fp8  = E4M3_round_up(amax / (qmax * s_glob))     # saturates at 448 (then elements may clip)
    s_eff  = s_fp8 * s_glob
    code   = element_encode(x / s_eff)                  # groups with s_eff == 0 get code 0
    x_hat  = (element_value(code) * s_fp8) * s_glob     # one rounding: the first product is exact

Rounding the scale up keeps ``|x / s_eff| <= qmax`` (to fp32 rounding), so nothing clips unless the
scale saturated. The ``key_offset`` variants store a per-channel fp16 midpoint ``(max+min)/2`` of
the group's keys and quantize the residual: SmolLM2 keys carry large per-channel offsets that a
symmetric grid wastes its levels on (specs/thinkv-small-models.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FieldSpec, KVFormat, LayerScales
from .e4m3 import E4M3_MAX, e4m3_decode, e4m3_encode
from .packing import pack, per_channel, value_groups


@dataclass(frozen=True)
class BlockScaledFormat(KVFormat):
    key_offset: bool = False
    qmax: float = 6.0  # largest element magnitude: amax maps onto it
    code_bits: int = 4  # stored bits per element code
    calib_range: float = 6.0 * E4M3_MAX  # s_glob = calibrated amax / calib_range

    # --- element grid (subclass) ---------------------------------------------------------------
    def element_encode(self, r: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def element_decode(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # --- layout --------------------------------------------------------------------------------
    def slot_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]:
        packed = (num_heads, head_dim * self.code_bits // 8)
        return [
            FieldSpec("k", packed, torch.uint8),
            FieldSpec("v", packed, torch.uint8),
            FieldSpec("v_scale", (num_heads, head_dim // 16), torch.uint8),
        ]

    def group_fields(self, num_heads: int, head_dim: int) -> list[FieldSpec]:
        fields = [FieldSpec("k_scale", (num_heads, head_dim), torch.uint8)]
        if self.key_offset:
            fields.append(FieldSpec("k_offset", (num_heads, head_dim), torch.float16))
        return fields

    # --- math ----------------------------------------------------------------------------------
    def _ratios(self, k, v, scales: LayerScales):
        """Key residual, offset (or None), and the pre-rounding scale ratios of K and V groups."""
        k, v = k.float(), v.float()
        offset = None
        if self.key_offset:
            offset = ((k.amax(0) + k.amin(0)) / 2).half()
            k = k - offset.float()
        gk, gv = self._glob(scales.k, k), self._glob(scales.v, v)
        rk = k.abs().amax(0) / (self.qmax * gk)  # [H, D]: per channel over the group's tokens
        rv = value_groups(v).abs().amax(-1) / (self.qmax * gv)  # [n, H, D/16]: per token
        return k, v, offset, gk, gv, rk, rv

    @staticmethod
    def _glob(s: float, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(s, dtype=torch.float32, device=like.device)

    def _codes(self, x, s_eff):
        r = torch.where(s_eff > 0, x / s_eff, torch.zeros_like(x))
        return self.element_encode(r)

    def encode(self, k, v, scales: LayerScales):
        k, v, offset, gk, gv, rk, rv = self._ratios(k, v, scales)
        k_scale, v_scale = e4m3_encode(rk, round_up=True), e4m3_encode(rv, round_up=True)
        sk = e4m3_decode(k_scale) * gk
        sv = per_channel(e4m3_decode(v_scale) * gv)
        slot = {
            "k": pack(self._codes(k, sk), self.code_bits),
            "v": pack(self._codes(v, sv), self.code_bits),
            "v_scale": v_scale,
        }
        group = {"k_scale": k_scale}
        if offset is not None:
            group["k_offset"] = offset
        return slot, group

    def decode(self, slot, group, scales: LayerScales):
        from .lut import decode_packed, e4m3_lookup

        vc = decode_packed(slot["v"], self.element_decode, self.code_bits)
        v = (vc * per_channel(e4m3_lookup(slot["v_scale"]))) * self._glob(scales.v, vc)
        return self.decode_keys(slot, group, scales), v

    def decode_keys(self, slot, group, scales: LayerScales):
        from .lut import decode_packed, e4m3_lookup

        kc = decode_packed(slot["k"], self.element_decode, self.code_bits)
        k = (kc * e4m3_lookup(group["k_scale"])) * self._glob(scales.k, kc)
        if self.key_offset:
            k = k + group["k_offset"].float()
        return k

    def saturated(self, k, v, scales: LayerScales) -> tuple[torch.Tensor, torch.Tensor]:
        """Number of K and V scale groups whose scale clipped at 448 (0-dim tensors; no host sync)."""
        *_, rk, rv = self._ratios(k, v, scales)
        return (rk > E4M3_MAX).sum(), (rv > E4M3_MAX).sum()
