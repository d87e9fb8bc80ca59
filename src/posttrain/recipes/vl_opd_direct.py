"""Multimodal direct OPD on the built-in shape-count task: a tiny Qwen3-VL student, its 4-layer teacher.

The pair is ``models/vl_opd_demo.py``'s, built into ``~/.cache/posttrain/vl-opd-demo`` the first time
this recipe is loaded (or ahead with ``python -m posttrain.models.vl_opd_demo``; a few minutes of
CPU, nothing downloaded): a random Qwen3-VL teacher trained on the true counts of the shape-count
images, and the student, that teacher cut to its first text layer. Each prompt is one image of 1-5
coloured squares and "How many squares are in the image? Reply with only the number."
(``posttrain.data.visual``). The student samples an answer, the teacher renders its own image prefix
from the same raw bytes (``rl.teacher.input_mode=shared_vocab_multimodal``: same tokenizer,
processor, template and placeholders, bound by the preflight) and returns its top-8 at every
position the student reached; the student minimises the reverse KL over the 8 + 1 categories.
``train/opd_divergence`` falls as the truncated student recovers the teacher's behaviour on its
own samples; the count reward is a diagnostic only. docs/multimodal.md ("Multimodal OPD") has the
figures of a run on a 2-core CPU.
"""

from posttrain.config.opd import OPDConfig
from posttrain.models.vl_opd_demo import STUDENT, TEACHER, ensure_vl_opd_demo


def make_config() -> OPDConfig:
    pair = ensure_vl_opd_demo()
    cfg = OPDConfig()
    cfg.job.group = "opd"
    cfg.job.name = "shapes_tiny_qwen3_vl_direct"
    cfg.model.name_or_path = str(pair / STUDENT)
    cfg.rl.teacher.name_or_path = str(pair / TEACHER)
    cfg.rl.teacher.input_mode = "shared_vocab_multimodal"
    cfg.rl.teacher.signal_mode = "topk"
    cfg.rl.teacher.top_k = 8
    cfg.rl.distillation_mode = "direct"
    cfg.rl.jsd_beta = 1.0
    cfg.rl.data.factory = "posttrain.data.visual:shape_count_rows"
    cfg.rl.reward = "arithmetic"
    cfg.rl.max_steps = 20
    cfg.rl.group_size = 4
    cfg.rl.batch_per_replica = 16
    cfg.rl.optimizer.lr = 3e-3
    cfg.rollout.max_tokens = 4
    return cfg
