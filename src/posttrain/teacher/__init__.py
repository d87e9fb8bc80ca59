"""The frozen teacher role of on-policy distillation: scoring engines, prompt rendering, scoring signals."""
