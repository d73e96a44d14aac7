"""KeyDiff's score: a key that points away from the mean key direction is distinctive, so keep it:
``−cos(k, anchor)`` per KV head, the anchor being the mean unit key of the scored tokens. Needs no
attention statistics."""
from __future__ import annotations

import torch

from trtkv.policies.scorers.base import Scorer


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff: ``−cos(k, anchor)`` per KV head, anchor = mean unit key. ``keys [T, H, D]`` -> ``[H, T]``."""
    kn = torch.nn.functional.normalize(keys.float(), dim=-1)
    anchor = kn.mean(0)  # [H, D]
    return -torch.nn.functional.cosine_similarity(kn, anchor[None], dim=-1).T


class KeyDiffScorer(Scorer):
    evidence_suffices = True
    name = "keydiff"

    def score(self, req, layer, positions, memo, ev=None):
        keys = ev.keys if ev is not None and ev.keys is not None else req.keys(layer, positions)
        return keydiff_scores(keys)
