"""Scorer registry: name -> :class:`Scorer` class. A new scorer is one file here and one line below; AMS
(``--set scorer=NAME``) and any :class:`~trtkv.policies.scored.ScorerPolicy` can use it at once."""
from __future__ import annotations

from trtkv.policies.scorers.base import Evidence, Scorer, head_mean
from trtkv.policies.scorers.expected_attention import ExpectedAttentionScorer
from trtkv.policies.scorers.h2o import H2OScorer
from trtkv.policies.scorers.keydiff import KeyDiffScorer
from trtkv.policies.scorers.rkv import RKVScorer
from trtkv.policies.scorers.snapkv import SnapKVScorer
from trtkv.policies.scorers.tova import TOVAScorer

SCORERS: dict[str, type[Scorer]] = {cls.name: cls for cls in (
    TOVAScorer, H2OScorer, SnapKVScorer, RKVScorer, KeyDiffScorer, ExpectedAttentionScorer)}

__all__ = ["SCORERS", "Evidence", "Scorer", "head_mean"]
