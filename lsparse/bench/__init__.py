"""Measurements: quality against held-out text now; the ladder of baselines and ablations to come."""
