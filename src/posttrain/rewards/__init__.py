"""Rewards: one score per completion. ``get_reward(name)`` resolves a built-in name or a
``module:function`` import path."""
