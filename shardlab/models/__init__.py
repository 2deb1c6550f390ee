"""Models that name their parameter dims logically and contain no parallel code."""
