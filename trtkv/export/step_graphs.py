"""The two graphs ``trtkv export`` writes, as torch modules over the engine's decoder: ``PrefillStep`` and
``DecodeStep``. Their inputs and outputs are the flat lists of ``KVLayout`` (layout.py).

They compute what ``EngineCore.prefill`` / ``decode_step`` compute, minus the host's bookkeeping: the model
pieces are the decoder's own (``qkv``, ``finish_layer``, ``logits``); attention over the pages is the
``paged_attention`` plugin per format; the step's write unit is encoded by ``kv_encode`` in every format the
policy may choose (the host keeps the one it chose) and attended as decoded from those records, exactly as
the PyTorch runtime attends it after writing it. Run eagerly, the modules are the export's torch oracle.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from plugins.formats import get_format
from trtkv.export.layout import KVLayout
from trtkv.export.torch_ops import kv_decode, kv_encode
from trtkv.models.decoder import DecoderModel

TINY = 1e-30


def masked_attention(q, k, v, live, sm_scale: float):
    """``q [b, Hq, D]`` over ``k, v [b, n, H, D]`` where ``live [b, n]``: (out, lse, scaled logits). The
    torch twin of ``trtkv::MaskedAttention``."""
    b, Hq, D = q.shape
    H = k.shape[2]
    logits = torch.matmul(q.reshape(b, H, Hq // H, D), k.permute(0, 2, 3, 1)) * sm_scale
    logits = logits.masked_fill(~live[:, None, None, :], -math.inf)
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - m)
    s = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.transpose(1, 2)) / s.clamp_min(TINY)
    return out.reshape(b, Hq, D), (torch.log(s) + m).reshape(b, Hq), logits.reshape(b, Hq, -1)


def merge_partials(parts):
    """Log-sum-exp merge of ``(out, lse)`` partial attentions; a part with nothing live weighs 0."""
    lses = torch.stack([lse for _, lse in parts])
    m = lses.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m)
    total = w.sum(0).clamp_min(TINY)
    out = parts[0][0] * w[0].unsqueeze(-1)
    for i in range(1, len(parts)):
        out = out + parts[i][0] * w[i].unsqueeze(-1)
    return out / total.unsqueeze(-1)


class _StepGraph(nn.Module):
    def __init__(self, model: DecoderModel, layout: KVLayout, scales: list[list[tuple[float, float]]]):
        super().__init__()
        self.model = model
        self.layout = layout
        self.scales = scales  # [layer][format index] -> (scale_k, scale_v)
        self.codes = [get_format(f).code for f in layout.formats]
        self.n_slot = [len(layout.slot_fields(f)) for f in layout.formats]
        self.sm_scale = 1.0 / math.sqrt(layout.head_dim)

    def encode_all(self, layer: int, k, v, live) -> list[list[torch.Tensor]]:
        """The write unit ``k, v [n, g, H, D]`` encoded in each format: records per format."""
        return [kv_encode(fmt, k, v, live, *self.scales[layer][i]) for i, fmt in enumerate(self.layout.formats)]


class PrefillStep(_StepGraph):
    """Prompt ``input_ids [T]`` -> last logits, the raw K/V (the buffer takes the prompt's tail from them when the
    policy buffers it), and the prompt's K/V records per layer and format (groups of g; the last group partial)."""

    def forward(self, input_ids):
        lay, model = self.layout, self.model
        T, g, H, D = input_ids.shape[0], lay.group, lay.num_kv_heads, lay.head_dim
        dtype = model.model.embed_tokens.weight.dtype
        cos, sin = model.rotary.cos_sin(torch.arange(T, device=input_ids.device), dtype)
        x = model.embed(input_ids)
        records, ks, vs = [], [], []
        G = (T + g - 1) // g
        live = (torch.arange(G * g, device=x.device) < T).reshape(G, g)
        for layer in range(lay.num_layers):
            q, k, v = model.qkv(layer, x, cos, sin)
            G_ = lay.num_q_heads // H
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.repeat_interleave(G_, dim=1).transpose(0, 1)[None],
                v.repeat_interleave(G_, dim=1).transpose(0, 1)[None], is_causal=True,
                scale=self.sm_scale)[0].transpose(0, 1)
            pad = k.new_zeros(G * g - T, H, D)
            kg, vg = torch.cat([k, pad]).reshape(G, g, H, D).float(), torch.cat([v, pad]).reshape(G, g, H, D).float()
            for recs in self.encode_all(layer, kg, vg, live):
                records += recs
            ks.append(k.float())
            vs.append(v.float())
            x = model.finish_layer(layer, x, attn)
        logits = model.logits(x[-1:])
        return (logits, torch.stack(ks), torch.stack(vs), *records)


class DecodeStep(_StepGraph):
    """One token per sequence over the paged cache (see layout.py for the inputs and outputs)."""

    def forward(self, *inputs):
        lay, model = self.layout, self.model
        a = dict(zip([s.name for s in lay.decode_inputs()], inputs))
        ids = a["input_ids"]
        dtype = model.model.embed_tokens.weight.dtype
        cos, sin = model.rotary.cos_sin(a["positions"], dtype)
        x = model.embed(ids)
        records, stats, k_new, v_new = [], [], [], []
        no_group = torch.empty(0, dtype=torch.int32, device=ids.device)
        for layer in range(lay.num_layers):
            q, k, v = model.qkv(layer, x, cos, sin)
            parts, logit_parts = [], []
            for i, fmt in enumerate(lay.formats):
                p = f"l{layer}.{fmt}."
                slot = [a[p + f.name] for f in lay.slot_fields(fmt)]
                group = [a[p + f.name] for f in lay.group_fields(fmt)]
                o, lse, lg = torch.ops.trtkv.paged_attention(
                    q, slot, group, a[p + "k_group"] if group else no_group, a[p + "valid"], a[p + "block_table"],
                    self.codes[i], self.sm_scale, *self.scales[layer][i], True)
                parts.append((o, lse))
                logit_parts.append(lg)
            fresh_k, fresh_v, live = self._write_unit(layer, a, k, v, records, k_new, v_new)
            o, lse, lg = masked_attention(q, fresh_k, fresh_v, live, self.sm_scale)
            parts.append((o, lse))
            logit_parts.append(lg)
            stats.append(torch.cat(logit_parts, dim=-1))
            x = model.finish_layer(layer, x, merge_partials(parts))
        logits = model.logits(x)
        return (logits, torch.stack(k_new), torch.stack(v_new), *records, *stats)

    def _write_unit(self, layer, a, k, v, records, k_new, v_new):
        """Encode this step's write unit in every format; return it as the attention will see it once stored:
        decoded from the chosen format's records (a write-through token, or a flush group), else the
        full-precision buffer with the new token appended."""
        lay = self.layout
        b, g = k.shape[0], lay.group
        if g == 1:
            uk, uv = k[:, None].float(), v[:, None].float()
            live = torch.ones(b, 1, dtype=torch.bool, device=k.device)
        else:
            n = a["buffer_len"]
            at = (torch.arange(g, device=k.device)[None, :] == n[:, None])[:, :, None, None]
            bk, bv = a["buffer_k"][layer], a["buffer_v"][layer]
            # the token rounded to the buffer's dtype and back, then selected in fp32: ONNX Runtime's CPU EP has no
            # fp16 Where and runs one in fp32 with the Cast pair around it removed, so a Cast(fp16) -> Where ->
            # Cast(fp32) chain leaves the token unrounded (measured: a flush group then encodes the fp32 token)
            uk = torch.where(at, k[:, None].to(bk.dtype).float(), bk.float())
            uv = torch.where(at, v[:, None].to(bv.dtype).float(), bv.float())
            live = torch.arange(g, device=k.device)[None, :] <= n[:, None]
        k_new.append(k.float())
        v_new.append(v.float())
        dk = dv = None
        for i, recs in enumerate(self.encode_all(layer, uk, uv, live)):
            records += recs
            ns = self.n_slot[i]
            group = [r[:, None].expand(-1, g, *r.shape[1:]) for r in recs[ns:]]
            fk, fv = kv_decode(lay.formats[i], recs[:ns] + group, *self.scales[layer][i])
            if dk is None:
                dk, dv = fk, fv
            else:
                chosen = (a["write_format"] == i)[:, None, None, None]
                dk, dv = torch.where(chosen, fk, dk), torch.where(chosen, fv, dv)
        if g == 1:
            return dk, dv, live
        flush = ((a["buffer_len"] + 1) >= g)[:, None, None, None]
        return torch.where(flush, dk, uk), torch.where(flush, dv, uv), live
