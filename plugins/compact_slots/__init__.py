"""Gather compaction of a pool's page lists: each list's live tokens move to the front of its pages."""
