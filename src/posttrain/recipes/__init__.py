"""Recipes shipped with posttrain; ``--config NAME`` finds them by file name."""
